# Llama-3.2-1B's shape (16 x 2048, 32 query heads on 8 key/value heads of 64, SwiGLU 8192, 128,256 tied
# embedding rows, rotary base 5e5 with Llama 3's scaling) on Llama-3-tokenised data; tp 1, 2, 4 or 8
# (the 8 key/value heads), pp a divisor of 16:
#   python data/prepare.py large_llama3 --corpus=large --tokenizer=llama3
#   torchrun --nproc_per_node=2 train.py configs/llama3_2_1b.py --compile=True
# From Hugging Face weights: --init_from=path/to/Llama-3.2-1B (its config.json gives the same shape;
# prepare the data with --tokenizer=path/to/Llama-3.2-1B, the folder's own tokenizer.json).
out_dir = "out/llama3_2_1b"
dataset = "large_llama3"
family = "llama"
vocab_size = 128256
n_layer = 16
n_head = 32
n_kv_head = 8
n_embd = 2048
head_dim = 64
intermediate_size = 8192
rope_theta = 500000.0
rope_scaling = "llama3"
rope_factor = 32.0
rope_low_freq = 1.0
rope_high_freq = 4.0
rope_original_positions = 8192
max_positions = 131072
norm_eps = 1e-5
tie_embeddings = True
block_size = 2048
batch_size = 8
gradient_accumulation_steps = 1
learning_rate = 3e-4
min_lr = 3e-5
max_iters = 2000
warmup_iters = 100
lr_decay_iters = 2000
eval_interval = 250
eval_iters = 8
log_interval = 10
ckpt_interval = -1  # ~15 GB of optimizer state: ask for it
tp = 2
tp_codec = "hint8"
sample_tokens = 0
