# Qwen3-0.6B's shape (28 x 1024, 16 query heads on 8 key/value heads of 128 (an explicit head size:
# 16 x 128 = 2048 > 1024), q/k-norm, SwiGLU 3072, 151,936 tied embedding rows, rotary base 1e6) on
# Qwen-tokenised data (Qwen3 reads Qwen2's tokenizer); tp 1, 2, 4 or 8, pp a divisor of 28:
#   python data/prepare.py large_qwen2 --corpus=large --tokenizer=qwen2
#   torchrun --nproc_per_node=2 train.py configs/qwen3_0_6b.py --compile=True
# From Hugging Face weights: --init_from=path/to/Qwen3-0.6B.
out_dir = "out/qwen3_0_6b"
dataset = "large_qwen2"
family = "qwen3"
vocab_size = 151936
n_layer = 28
n_head = 16
n_kv_head = 8
n_embd = 1024
head_dim = 128
intermediate_size = 3072
rope_theta = 1000000.0
max_positions = 40960
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
tp = 2
tp_codec = "hint8"
sample_tokens = 0
