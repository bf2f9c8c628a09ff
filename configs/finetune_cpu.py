# Fine-tune a Hugging Face folder on the CPU. The folder gives the family, the shape and the weights
# (--init_from), and its tokenizer the data: this file sets only the run, a short schedule at a fine-tuning
# learning rate, one process (--tp=2 with torchrun --nproc_per_node=2 where the heads divide by 2).
#   python data/prepare.py small_smollm2 --corpus=small --tokenizer=path/to/SmolLM2-135M
#   python train.py configs/finetune_cpu.py --init_from=path/to/SmolLM2-135M --dataset=small_smollm2
out_dir = "out/finetune"
device = "cpu"
block_size = 128
batch_size = 4
max_iters = 50
learning_rate = 3e-5
min_lr = 3e-6
warmup_iters = 5
lr_decay_iters = 50
eval_interval = 25
eval_iters = 4
log_interval = 5
tp_codec = "hint8"  # where tp > 1
sample_tokens = 60
