# The CPU demo: a tiny GPT-2 (BPE vocabulary) on ~1 MB of Shakespeare, on 4 ranks as TP=2 x PP=2:
# two pipeline stages (2 blocks each, 1F1B over 2 micro-batches of 4 sequences), each stage split
# over 2 tensor-parallel ranks; TP all-reduces and the activations/gradients between the stages
# are compressed with the default codec (hint8).
#   torchrun --nproc_per_node=4 train.py configs/demo.py
# The loss starts at ln(50257) = 10.8 (uniform over the vocabulary); the sample at the end shows what
# a 7M-parameter model learns from 100k tokens. (--tp=2 --pp=1 --gradient_accumulation_steps=1
# --batch_size=8 with 2 processes is the same model and data budget on TP alone; add --zero1=True and
# 8 processes for dp=2 with a sharded optimizer.)
out_dir = "out/demo"
dataset = "small"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
batch_size = 4
gradient_accumulation_steps = 2  # the pipeline's micro-batches
max_iters = 200
lr_decay_iters = 200
eval_interval = 100
tp = 2
pp = 2
tp_codec = "hint8"
pp_codec = "hint8"  # activations forward and gradients backward between the stages
taco_min_bytes = 0  # compress every TP all-reduce, however small, to show it on CPU
