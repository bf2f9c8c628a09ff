# The CPU demo in the Qwen2 family: the demo's size and layout (TP=2 x PP=2 on 4 ranks, hint8 on the
# TP all-reduces and between the stages) with Qwen2's block (RMSNorm, rotary positions, grouped-query
# attention with 4 query heads on 2 key/value heads, SwiGLU, a bias on q/k/v) and Qwen2's tokenizer
# (151,646 ids; the embedding has Qwen2.5's 151,936 rows, tied to the head as in Qwen2.5-0.5B):
#   python data/prepare.py small_qwen2 --corpus=small --tokenizer=qwen2
#   torchrun --nproc_per_node=4 train.py configs/qwen_demo.py
# The loss starts at ln(151936) = 11.9.
out_dir = "out/qwen_demo"
dataset = "small_qwen2"
family = "qwen2"
vocab_size = 151936
n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
intermediate_size = 352
rope_theta = 1000000.0
norm_eps = 1e-6
block_size = 64
batch_size = 4
gradient_accumulation_steps = 2  # the pipeline's micro-batches
max_iters = 100
lr_decay_iters = 100
warmup_iters = 10
eval_interval = 50
tp = 2
pp = 2
tp_codec = "hint8"
pp_codec = "hint8"
taco_min_bytes = 0  # compress every TP all-reduce, however small, to show it on CPU
