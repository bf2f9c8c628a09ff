# The paper's Qwen claim at our scale (python -m lab.study fork ... --tp=4 --config=configs/study_qwen.py):
# configs/study_long.py's data, length and schedule with a Qwen2-shaped model: Qwen2.5-7B's heads
# (28 query heads on 4 key/value heads, so emulated TP=4 gives each rank 7 query heads and one key/value
# head), RMSNorm, rotary positions (base 1e6), SwiGLU 5.3x wide as 7B's, an untied head; width 448.
out_dir = "out/study_qwen"
dataset = "large"
family = "qwen2"
tokenizer = "gpt2"  # the large corpus in GPT-2's tokens, not the family's own
n_layer = 6
n_head = 28
n_kv_head = 4
n_embd = 448
intermediate_size = 2368
rope_theta = 1000000.0
norm_eps = 1e-6
tie_embeddings = False
block_size = 256
batch_size = 64
learning_rate = 2e-3
min_lr = 2e-4
max_iters = 1400
warmup_iters = 100
lr_decay_iters = 1400
eval_interval = 200
eval_iters = 20
log_interval = 10
ckpt_interval = -1
sample_tokens = 0
progress = False
tp = 1
taco_min_bytes = 0  # compress every all-reduce: the study is about accuracy
