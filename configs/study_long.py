# The accuracy study trained to a lower loss (python -m lab.study run long:3): the model of
# configs/study.py on the large dataset, 1400 steps x 64 x 256 = 22.9M tokens, about 3.4 epochs of
# the 6.7M-token train split (fewer tokens do not reach validation loss 4.5 with this model). Batch,
# learning rate and length were chosen from uncompressed TP=1 runs (docs/RESULTS.md).
out_dir = "out/study_long"
dataset = "large"
n_layer = 6
n_head = 8
n_embd = 512
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
