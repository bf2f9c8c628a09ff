# Qwen2.5-7B's shape, the paper's third model (28 x 3584, 28 query heads on 4 key/value heads, SwiGLU
# 18944, 152,064 untied embedding rows, rotary base 1e6), for TP=2 or TP=4:
#   torchrun --nproc_per_node=4 train.py configs/qwen2_5_7b.py --tp=4 --compile=True
# 7.6B parameters with fp32 AdamW state are ~122 GB: ~30 GB per GPU at TP=4, plus activations.
out_dir = "out/qwen2_5_7b"
dataset = "large_qwen2"
family = "qwen2"
vocab_size = 152064
n_layer = 28
n_head = 28
n_kv_head = 4
n_embd = 3584
intermediate_size = 18944
rope_theta = 1000000.0
norm_eps = 1e-6
tie_embeddings = False
block_size = 2048
batch_size = 4
gradient_accumulation_steps = 1
learning_rate = 1.5e-4
min_lr = 1.5e-5
max_iters = 2000
warmup_iters = 100
lr_decay_iters = 2000
eval_interval = 250
eval_iters = 8
log_interval = 5
ckpt_interval = -1  # ~90 GB of optimizer state: ask for it
tp = 4  # 2 or 4: the 4 key/value heads split no further
tp_codec = "hint8"
sample_tokens = 0
