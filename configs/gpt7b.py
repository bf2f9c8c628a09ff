# The paper's largest end-to-end model shape, GPT-6.7B (32 x 4096, 32 heads), for TP=4 / TP=8 on
# 4- or 8-GPU machines (bash .ci/gpu tp48):
#   torchrun --nproc_per_node=8 train.py configs/gpt7b.py --tp=8 --compile=True
# 6.7B parameters with fp32 AdamW state are ~107 GB: 13-27 GB per GPU at TP=8 / TP=4, plus the
# activations of 16k tokens per step.
out_dir = "out/gpt7b"
dataset = "large"
n_layer = 32
n_head = 32
n_embd = 4096
block_size = 2048
qkv_bias = False  # no biases anywhere (nanoGPT's bias=False)
linear_bias = False
norm_bias = False
dropout = 0.0
batch_size = 8  # 16k tokens per step
gradient_accumulation_steps = 1
learning_rate = 1.5e-4
min_lr = 1.5e-5
max_iters = 2000
warmup_iters = 100
lr_decay_iters = 2000
eval_interval = 250
eval_iters = 8
log_interval = 5
ckpt_interval = -1  # ~80 GB of optimizer state: ask for it
tp = 8
tp_codec = "hint8"
sample_tokens = 0
