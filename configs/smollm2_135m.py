# SmolLM2-135M's shape (30 x 576, 9 query heads on 3 key/value heads, SwiGLU 1536, 49,152 tied embedding
# rows, rotary base 1e5): a Llama with a tokenizer of its own, which its Hugging Face folder carries
# (tokenizer.json); tp 1 or 3 (the 3 key/value heads), pp a divisor of 30:
#   python data/prepare.py large_smollm2 --corpus=large --tokenizer=path/to/SmolLM2-135M
#   torchrun --nproc_per_node=3 train.py configs/smollm2_135m.py --tokenizer=path/to/SmolLM2-135M
# Fine-tuning: --init_from=path/to/SmolLM2-135M instead of --tokenizer (the folder gives both).
out_dir = "out/smollm2_135m"
dataset = "large_smollm2"
family = "llama"
vocab_size = 49152
n_layer = 30
n_head = 9
n_kv_head = 3
n_embd = 576
intermediate_size = 1536
rope_theta = 100000.0
max_positions = 8192
norm_eps = 1e-5
tie_embeddings = True
block_size = 2048
batch_size = 16
gradient_accumulation_steps = 1
learning_rate = 1e-3
min_lr = 1e-4
max_iters = 2000
warmup_iters = 100
lr_decay_iters = 2000
eval_interval = 250
eval_iters = 9
log_interval = 10
tp = 3
tp_codec = "hint8"
sample_tokens = 0
