# A ~1B-parameter GPT (1.01B non-embedding, 1.11B in all) at TP=2 on two GPUs: the baseline of the
# end-to-end throughput benchmark. bf16 autocast, fused AdamW, SDPA flash attention; no bias (fewer
# small kernels). Large enough that the matmuls, not the launches, set the pace.
#   torchrun --nproc_per_node=2 train.py configs/gpt1b.py --compile=True
#   python bench.py e2e configs/gpt1b.py none,hint8 --nproc=2 --tag=gpt1b_nvlink -- --compile=True --max_iters=30
out_dir = "out/gpt1b"
dataset = "large"
n_layer = 20
n_head = 16
n_embd = 2048
block_size = 2048
qkv_bias = False  # no biases anywhere (nanoGPT's bias=False)
linear_bias = False
norm_bias = False
dropout = 0.0
batch_size = 8  # 16k tokens per step (both TP ranks see the same batch)
gradient_accumulation_steps = 1
learning_rate = 3e-4
min_lr = 3e-5
max_iters = 2000
warmup_iters = 100
lr_decay_iters = 2000
eval_interval = 250
eval_iters = 10
log_interval = 5
ckpt_interval = -1  # a checkpoint is ~13 GB per rank with the optimizer state: ask for it
tp = 2
tp_codec = "hint8"
sample_tokens = 0
