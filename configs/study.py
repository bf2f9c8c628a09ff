# Accuracy study (bench.py study): a small GPT-2 trained on a third of the large dataset
# on ONE GPU, with TP emulated (tp_emulate, set per run by the study) so TP=4/8 compression is
# reproduced exactly without 8 GPUs. 300 x 32 x 256 = 2.5M tokens of the 6.7M-token train split
# (sized so that the whole study, 27 runs, fits one 10-minute device call: see .ci/gpu_study).
out_dir = "out/study"
dataset = "large"
n_layer = 6
n_head = 8
n_embd = 512
block_size = 256
batch_size = 32
learning_rate = 1e-3
min_lr = 1e-4
max_iters = 300
warmup_iters = 30
lr_decay_iters = 300
eval_interval = 150
eval_iters = 20
log_interval = 10
ckpt_interval = -1
sample_tokens = 0
progress = False
tp = 1
taco_min_bytes = 0               # compress every all-reduce: the study is about accuracy
