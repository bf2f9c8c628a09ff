# Qwen2.5-0.5B's shape (24 x 896, 14 query heads on 2 key/value heads, SwiGLU 4864, 151,936 tied
# embedding rows, rotary base 1e6) for one or two GPUs, on Qwen2-tokenised data:
#   python data/prepare.py large_qwen2 --corpus=large --tokenizer=qwen2
#   torchrun --nproc_per_node=2 train.py configs/qwen2_5_0_5b.py --compile=True
# From Hugging Face weights: add --init_from=path/to/Qwen2.5-0.5B (config.json + model.safetensors).
out_dir = "out/qwen2_5_0_5b"
dataset = "large_qwen2"
family = "qwen2"
vocab_size = 151936
n_layer = 24
n_head = 14
n_kv_head = 2
n_embd = 896
intermediate_size = 4864
rope_theta = 1000000.0
norm_eps = 1e-6
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
tp = 2  # 1 or 2: the 2 key/value heads split no further
tp_codec = "hint8"
sample_tokens = 0
