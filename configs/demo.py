# The CPU demo: a tiny GPT-2 (BPE vocabulary) on ~1 MB of Shakespeare, TP=2 with the default codec.
#   torchrun --nproc_per_node=2 train.py configs/demo.py
# Takes about 3 minutes on 2 CPU cores (2m47s measured); the loss falls from 10.8 (uniform over 50257 tokens) and
# the sample at the end is English-looking word salad in a play's layout: it is a 7M-parameter model
# that has seen 100k tokens.
out_dir = "out/demo"
dataset = "small"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
batch_size = 8
max_iters = 200
lr_decay_iters = 200
eval_interval = 100
tp = 2
tp_codec = "hint8"
taco_min_bytes = 0              # compress every TP all-reduce, however small, to show it on CPU
