"""
Train a tensor-parallel GPT, optionally with compressed TP all-reduces.

    python train.py                                            # one process, the CPU demo defaults
    torchrun --nproc_per_node=4 train.py configs/demo.py       # TP=2 x PP=2 on CPU (gloo) or GPU (NCCL)
    torchrun --nproc_per_node=2 train.py configs/gpt2s.py --tp_codec=taco --max_iters=200
    torchrun --nproc_per_node=4 train.py configs/demo.py --resume  # continue from out_dir

Config (nanoGPT style): the globals below are the defaults, and `--help` prints them with their
comments; a config file is plain assignments that override them, --key=value overrides after it
(config.py reads both, type-checks them and refuses what cannot work before anything starts).
"""

import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import checkpoint
import config
import data_parallel
import parallel
import runlog
import taco
import watchdog
from data.loader import Batches, read_meta
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# run and data (the embedded defaults are the CPU demo: a tiny GPT on ~1 MB of Shakespeare)
out_dir = "out"  # log.jsonl and checkpoint sets (ckpt/iter_N/) go here
overwrite = False  # start a new run in an out_dir that holds another run's checkpoints
dataset = "small"  # <data_dir>/<dataset>/{train,val}.bin (python data/prepare.py small)
data_dir = ""  # "" = this repository's data/ folder, wherever you run from
init_from = ""  # Hugging Face weights (GPT-2 or Qwen2): a folder with config.json and the weights
# model
arch = "gpt2"  # gpt2 | qwen2 (RMSNorm, rotary positions, grouped-query attention, SwiGLU)
vocab_size = 50257  # rows of the token embedding: GPT-2's tokenizer 50257, Qwen2's 151936
n_layer = 4  # transformer blocks
n_head = 4  # attention heads (a multiple of tp)
n_kv_head = 0  # key/value heads, dividing n_head and a multiple of tp (0: n_head)
n_embd = 128  # model width C
intermediate_size = 0  # the MLP's width (0: 4 * n_embd); qwen2: each of SwiGLU's gate and up
rope_theta = 10000.0  # qwen2: the rotary positions' base
norm_eps = 1e-5  # epsilon of LayerNorm (gpt2) / RMSNorm (qwen2)
tie_embeddings = True  # the LM head's weight is the token embedding's (untied: a weight of its own)
block_size = 64  # context length T in tokens
dropout = 0.0  # in [0, 1)
bias = True  # gpt2: biases in the linears and LayerNorms; qwen2: in the QKV projection
# batch: tokens per step = batch_size * block_size * gradient_accumulation_steps * dp
batch_size = 16  # sequences per micro-batch per DP rank
gradient_accumulation_steps = 1  # with pp > 1: the pipeline's micro-batches
# optimizer: AdamW, linear warmup then cosine decay to min_lr
learning_rate = 2e-3  # peak learning rate
min_lr = 2e-4  # learning rate at the end of the decay
max_iters = 300  # optimizer steps of the whole run
warmup_iters = 30  # steps of linear warmup
lr_decay_iters = 300  # step where the cosine decay reaches min_lr
weight_decay = 0.1  # AdamW weight decay (2-D weights only)
beta1 = 0.9  # AdamW beta1
beta2 = 0.95  # AdamW beta2
grad_clip = 1.0  # clip the global gradient norm to this (0: no clipping)
# evaluation, logging, checkpoints
eval_interval = 100  # evaluate train/val loss every N steps and at the end (0: never)
eval_iters = 10  # micro-batches per evaluation (a multiple of dp)
log_interval = 10  # one log line (mean loss, ms, tok/s, wire bytes) every N steps
ckpt_interval = 0  # 0: at every evaluation, the end and on SIGINT/SIGTERM; N: every N steps; -1: never
resume = False  # continue from out_dir's newest complete checkpoint set (of out_dir's own run)
resume_from = ""  # with resume: this set's folder instead (also another run's: it goes on as that run)
progress = True  # tqdm bar on rank 0 (only when the output is a terminal)
sample_tokens = 120  # sample this many tokens at the end (0: none)
sample_prompt = "\n"  # the text the sample starts from
# parallelism: world = tp * pp * dp (dp is derived)
tp = 1  # tensor-parallel ranks (inside one node)
pp = 1  # pipeline stages (n_layer divisible by pp)
schedule = "1f1b"  # pipeline schedule: 1f1b | gpipe
sequence_parallel = False  # shard LayerNorm/residual regions along the sequence over the TP group
pp_verbose = False  # print every pipeline send/receive (for learning how a schedule runs)
# tensor-parallel compression (taco.py): codec for forward activations / backward gradients
tp_codec = "none"  # codec of the forward TP all-reduces: none | hint8 | taco | hint6 | ... | auto
tp_codec_bwd = ""  # "" = same as tp_codec (auto: decided per direction, timed at start: tp_auto.py)
tp_codec_embed = ""  # the embedding's forward all-reduce ("" = tp_codec's forward codec; none: exact)
tp_codec_attn = ""  # the attention blocks' all-reduces, where their direction compresses ("": its codec)
tp_codec_mlp = ""  # the MLP blocks' all-reduces, likewise
tp_auto_bits = 8  # the codecs auto may choose: 8 (hint8) or 6 (hint8, hint6)
codec_block = 256  # elements per codec block (a power of two; the kernels: 256)
dp_codec = "none"  # data-parallel gradient all-reduce codec (SDP4Bit-style: hint8 | hint4)
dp_overlap = True  # start each DP gradient bucket's all-reduce during the backward pass (False: after it)
zero1 = False  # ZeRO stage 1 over DP: AdamW state (fp32 master + moments) sharded, 1/dp per rank
zero_codec = "none"  # with zero1: the parameter all-gather sends weight differences in this codec (SDP4Bit: hint4)
pp_codec = "none"  # activations between pipeline stages (TAH-Quant-style: tahquant, see lab/tahquant.py)
pp_codec_bwd = ""  # gradients between stages ("" = same as pp_codec; TAH-Quant: higher precision, hint8)
tp_transport = "auto"  # auto: symmetric memory inside a node (GPU peers), else NCCL/gloo | dist | symm
taco_chunks = 1  # split each compressed all-reduce into pipelined chunks
taco_min_bytes = 8388608  # smaller TP all-reduces stay uncompressed (the codec's fixed costs dominate)
# system
seed = 1337  # weights, data order and dropout
device = "auto"  # auto | cpu | cuda
dtype = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
compile = False  # torch.compile the model
timeout = 600  # seconds a collective may wait for a stalled rank before the job stops
profile_steps = 0  # > 0: every rank's CUDA kernel timeline of the last N steps -> out_dir/trace_rank<r>.json.gz
peak_flops = 989e12  # per-GPU dense bf16 peak for MFU (H100/H200 SXM datasheet)
# -----------------------------------------------------------------------------
DEFAULTS = {
    k: v for k, v in list(globals().items()) if not k.startswith("_") and isinstance(v, (int, float, bool, str))
}


def get_lr(it, c):
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    if it > c["lr_decay_iters"]:
        return c["min_lr"]
    ratio = (it - c["warmup_iters"]) / max(1, c["lr_decay_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


def clip_grad_norm(params, max_norm, grid, zero=None, opt=None):
    """Global gradient norm over the whole (sharded, staged) model: the squares of TP-split parameters
    summed over the TP group, replicated ones counted once, then every pipeline stage's sum added (the
    last stage's copy of the tied embedding not twice). Scales the gradients to norm <= max_norm; with ZeRO
    (`zero`) the squares come from its DP-reduced slices and its step scales. Returns (norm, scale)."""
    dev = params[0].device
    if zero is not None:
        sq, repl_sq = zero.reduce_grads()
    else:
        grads = [p for p in params if p.grad is not None and not getattr(p, "pp_tied_copy", False)]
        split = [p.grad for p in grads if getattr(p, "tp_split", False)]
        repl = [p.grad for p in grads if not getattr(p, "tp_split", False)]
        sq = torch.stack(torch._foreach_norm(split)).square().sum() if split else torch.zeros((), device=dev)
        repl_sq = torch.stack(torch._foreach_norm(repl)).square().sum() if repl else 0.0  # a few fused kernels
    if grid.tp > 1:
        dist.all_reduce(sq, group=grid.tp_group)
    sq = sq + repl_sq
    if grid.pp > 1:
        dist.all_reduce(sq, group=grid.pp_group)
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)
    if zero is None and max_norm > 0 and getattr(opt, "defaults", {}).get("fused"):
        opt.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)  # fused AdamW divides by it as it reads
    elif zero is None and max_norm > 0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
    return norm, coef


# -----------------------------------------------------------------------------
# a run: its state, processes, model, optimizer; one step; evaluation; the step line


@dataclass
class Run:
    """Everything a step needs: setup() makes it; runlog, checkpoint, watchdog and the lab read it."""

    cfg: dict  # the settings: DEFAULTS, then a config file, then --key=value (config.parse)
    grid: parallel.Grid  # this rank's place in the TP x PP x DP grid, and its process groups
    dev: torch.device  # this rank's device: cuda:LOCAL_RANK, or cpu
    dtype: torch.dtype  # the forward's compute dtype (bf16 on a GPU unless --dtype says otherwise)
    use_cuda: bool  # dev is a GPU
    comm: parallel.TPComm  # the TP group's one all-reduce door: its codecs, transport and byte counts
    model: GPT  # this rank's shard of its pipeline stage
    params: list  # model.parameters(), in the order the optimizer, the clip and the syncs use
    fwd_model: torch.nn.Module  # model, or torch.compile(model)
    autocast: torch.autocast  # the forward's autocast (disabled in float32)
    batches: Batches  # the stateless batches: (split, iteration, micro-batch) -> (x, y)
    tp_auto: object = None  # tp_codec=auto: its choice and timings (tp_auto.choose), else None
    opt: object = None  # AdamW, or ZeRO-1's sharded AdamW (build_optimizer)
    zero: object = None  # with zero1: that data_parallel.ZeroAdamW, else None
    dpsync: object = None  # dp > 1 without ZeRO: data_parallel.DPGradSync (its buckets), else None
    dp_stats: runlog.CommStats = field(default_factory=runlog.CommStats)  # bytes of the DP gradient syncs
    pp_stats: runlog.CommStats = field(default_factory=runlog.CommStats)  # bytes between pipeline stages
    it0: int = 0  # the first iteration: 0, or the resumed checkpoint set's
    resumed_from: str = None  # the checkpoint set resumed from, or None
    run_id: str = ""  # the run's id, the same across resumes (checkpoint.new_run_id)


def setup(c, model_hook=None):
    """Process groups, device, model, optimizer (and the resumed state): the Run. model_hook(model, comm, c)
    may change the model before the optimizer sees it (lab/emulate.py: emulated TP layers)."""
    use_cuda = c["device"] == "cuda" or (c["device"] == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    grid = parallel.init_grid(tp=c["tp"], pp=c["pp"], timeout=c["timeout"])
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    ptdtype = {
        "auto": torch.bfloat16 if use_cuda else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[c["dtype"]]
    torch.manual_seed(c["seed"])
    ways = {"tp": grid.tp, "dp": grid.dp, "zero": grid.dp, "pp": grid.pp}  # a codec acts where its group has 2+ ranks
    codecs = ["hint8" if v == "auto" else v for k, v in c.items() if "_codec" in k and v and ways[k.split("_")[0]] > 1]
    taco.load_kernels(codecs, c["codec_block"], dev)  # if a codec runs on them (local rank 0 builds)
    comm = parallel.TPComm(
        group=grid.tp_group,
        size=grid.tp,
        rank=grid.tp_rank,
        fwd_codec=c["tp_codec"],
        bwd_codec=c["tp_codec_bwd"] or c["tp_codec"],
        embed_codec=c["tp_codec_embed"],
        block_size=c["codec_block"],
        chunks=c["taco_chunks"],
        min_bytes=c["taco_min_bytes"],
        sp=c["sequence_parallel"],
        transport=c["tp_transport"],
        site_codecs={"attn": c["tp_codec_attn"], "mlp": c["tp_codec_mlp"]},
    )
    auto = None
    if "auto" in (comm.fwd_codec, comm.bwd_codec):  # timed on this group and link
        import tp_auto

        auto = tp_auto.choose(
            comm, c["batch_size"] * c["block_size"] * c["n_embd"], c["n_embd"], ptdtype, dev, c["tp_auto_bits"]
        )
    mc = GPTConfig.from_settings(c)
    model = GPT(mc, comm, seed=None if c["init_from"] else c["seed"], stage=grid.pp_rank, stages=grid.pp)
    if c["init_from"]:  # every rank reads its own slices of the tensors, one at a time
        checkpoint.init_from(model, c["init_from"], grid.rank == 0)
    model = model.to(dev)
    if model_hook is not None:
        model_hook(model, comm, c)
    r = Run(
        cfg=c,
        grid=grid,
        dev=dev,
        dtype=ptdtype,
        use_cuda=use_cuda,
        comm=comm,
        model=model,
        params=list(model.parameters()),
        fwd_model=torch.compile(model) if c["compile"] else model,
        autocast=torch.autocast(dev.type, dtype=ptdtype, enabled=ptdtype != torch.float32),
        batches=Batches(config.data_dir(c), c["block_size"], c["batch_size"], c["seed"], grid.dp_rank, dev, grid.dp),
        tp_auto=auto,
    )
    build_optimizer(r)
    r.resumed_from = checkpoint.resume(r) if c["resume"] else None
    if not c["resume"]:
        r.run_id = checkpoint.new_run_id(grid)
    return r


def build_optimizer(r):
    """AdamW (weight decay on 2-D weights only), with DP gradient averaging, or ZeRO-1's sharded AdamW."""
    c, grid, params = r.cfg, r.grid, r.params
    if c["zero1"]:
        r.zero = r.opt = data_parallel.ZeroAdamW(
            params,
            grid,
            c["learning_rate"],
            (c["beta1"], c["beta2"]),
            1e-8,
            c["weight_decay"],
            grad_codec=c["dp_codec"],
            param_codec=c["zero_codec"],
            block_size=c["codec_block"],
            stats=r.dp_stats,
        )
        return
    if grid.dp > 1:
        r.dpsync = data_parallel.DPGradSync(
            params,
            grid.dp_group,
            grid.dp,
            codec=c["dp_codec"],
            block_size=c["codec_block"],
            stats=r.dp_stats,
            overlap=c["dp_overlap"],
        )
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    r.opt = torch.optim.AdamW(groups, lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]), fused=r.use_cuda)


def mean_loss(r, split, it, n, train):
    """Mean loss of the n micro-batches of iteration `it` (and their backward if train), known
    on every rank: a plain loop at pp = 1, the pipeline schedule otherwise."""
    model, grid, c = r.model, r.grid, r.cfg

    if grid.pp == 1:
        total = 0.0
        for i in range(n):
            x, y = r.batches.get(split, it, i)
            with r.autocast:
                loss = r.fwd_model(x, y)[1] / n
            if train:
                loss.backward()
            total = total + loss.detach()
        return total

    def forward(i, hidden):  # one micro-batch on this stage, for run_pipeline
        x, y = r.batches.get(split, it, i)
        with r.autocast:
            out, loss = r.fwd_model(x if model.first else None, y if model.last else None, hidden)
        return out, (None if loss is None else loss / n)

    actions = (
        parallel.pipeline_schedule(c["schedule"], n, grid.pp_rank, grid.pp) if train else [("F", i) for i in range(n)]
    )
    seq = c["block_size"] // grid.tp if c["sequence_parallel"] else c["block_size"]  # the activation between stages
    total = parallel.run_pipeline(
        actions,
        forward,
        grid,
        (c["batch_size"], seq, c["n_embd"]),
        torch.float32,
        r.dev,
        verbose=c["pp_verbose"],
        codec=c["pp_codec"],
        codec_bwd=c["pp_codec_bwd"] or c["pp_codec"],
        block_size=c["codec_block"],
        stats=r.pp_stats if train else None,
    )
    total = total if model.last else torch.zeros((), device=r.dev)
    dist.broadcast(total, src=grid.last_stage_rank, group=grid.pp_group)
    return total


def train_step(r, it):
    """One optimizer step: forward/backward of every micro-batch, gradient syncs, clip, update.
    Returns the step's mean loss (on the device), the gradient norm and the learning rate."""
    c, grid = r.cfg, r.grid
    lr = get_lr(it, c)
    for group in r.opt.param_groups if r.zero is None else ():
        group["lr"] = lr
    torch.manual_seed(c["seed"] + 100003 * it + grid.dp_rank)  # dropout RNG: stateless, same on TP peers
    for s in (r.comm.stats, r.dp_stats, r.pp_stats):
        s.reset()
    if r.dpsync is not None:
        r.dpsync.start(c["gradient_accumulation_steps"])  # dp_overlap: buckets start as their gradients finish
    loss = mean_loss(r, "train", it, c["gradient_accumulation_steps"], train=True)
    if r.dpsync is not None:
        r.dpsync.finish()  # first: it writes the DP averages over .grad (the sums below commute)
    parallel.sync_sp_grads(r.params, r.comm)
    parallel.sync_tied_grads(r.model, grid)
    gnorm, coef = clip_grad_norm(r.params, c["grad_clip"], grid, r.zero, r.opt)
    if r.zero is not None:  # ZeRO-1: reduce-scatter, clip, step, all-gather
        r.zero.step(lr, coef)
    else:
        r.opt.step()
        r.opt.zero_grad(set_to_none=True)
    if grid.dp > 1:
        dist.all_reduce(loss, group=grid.dp_group)
        loss /= grid.dp
    return loss, gnorm, lr


@torch.no_grad()
def evaluate(r, it):
    r.model.eval()
    out = {}
    for split in ("train", "val"):
        # the same eval_iters micro-batches whatever the layout: DP rank d takes d, d + dp, ...
        # (negative "iterations": never trained on)
        loss = mean_loss(r, split, -1 - it, r.cfg["eval_iters"] // r.grid.dp, train=False)
        if r.grid.dp > 1:
            dist.all_reduce(loss, group=r.grid.dp_group)
            loss /= r.grid.dp
        out[split] = loss.item()
    r.model.train()
    return out


def main(argv=None, model_hook=None):
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(config.help_text(__file__))
        return
    r = setup(config.start(DEFAULTS, argv), model_hook)
    try:
        train(r)
    except RuntimeError as e:
        if not watchdog.timed_out(e):
            raise
        raise SystemExit(watchdog.stalled_exit(r.grid, r.cfg["timeout"], e)) from None
    if r.grid.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def train(r):
    c, grid = r.cfg, r.grid
    tokens = c["batch_size"] * c["block_size"] * c["gradient_accumulation_steps"] * grid.dp
    flops = (6 * r.model.config.num_params() + 12 * c["n_layer"] * c["n_embd"] * c["block_size"]) * tokens
    out, prof, stop = runlog.Output(r), runlog.Profile(r), watchdog.Stop(grid.rank == 0)
    t0, loss_sum, nsum = time.time(), 0.0, 0
    for it in range(r.it0, c["max_iters"]):
        prof.before_step(it)
        loss, gnorm, lr = train_step(r, it)
        # the loss stays on the device (float64, as a Python float would sum it): no host sync in a
        # step; the host reads it only on the steps below, so it can prepare the next step meanwhile
        loss_sum, nsum = loss_sum + loss.detach().double(), nsum + 1
        out.step()
        last = it + 1 == c["max_iters"]
        logging = (it + 1) % c["log_interval"] == 0 or it == 0
        evaluating = c["eval_interval"] and ((it + 1) % c["eval_interval"] == 0 or last)
        saving = c["ckpt_interval"] >= 0 and (
            last or ((it + 1) % c["ckpt_interval"] == 0 if c["ckpt_interval"] else evaluating)
        )
        stopping = 0
        if logging or evaluating or saving:
            mean = (loss_sum / nsum).item()  # NaN in any step since the last log line shows here
            if not math.isfinite(mean):
                raise SystemExit(
                    f"step {it + 1}: loss is {mean} (gradient norm {gnorm.item():.3g}; checked every "
                    f"log_interval={c['log_interval']} steps). Stopping. Try a lower --learning_rate, "
                    f"--grad_clip, or --tp_codec=none to rule out the codec."
                )
            stopping = stop.agreed(grid, r.dev)  # a signal on any rank: every rank saves here, then ends
            evaluating, saving = evaluating and not stopping, saving or (stopping and c["ckpt_interval"] >= 0)
        if logging:
            if r.use_cuda:
                torch.cuda.synchronize()
            out.line(*runlog.step_line(r, it, mean, lr, (time.time() - t0) / nsum, tokens, flops))
            t0, loss_sum, nsum = time.time(), 0.0, 0
        if evaluating:
            ev = evaluate(r, it)
            out.line(
                f"step {it + 1:6d} | train {ev['train']:.4f} | val {ev['val']:.4f}",
                dict(iter=it + 1, train_loss=ev["train"], val_loss=ev["val"]),
            )
            t0 = time.time()
        if saving:
            checkpoint.save(r, it + 1)
        if stopping:
            out.line(f"stopped at step {it + 1}" + ("; continue with --resume" if saving else ""))
            raise SystemExit(128 + stopping)
    stop.restore()
    out.close()
    prof.finish()
    if c["sample_tokens"] > 0:
        from sample import print_sample

        print_sample(
            r.model,
            c["sample_prompt"],
            c["sample_tokens"],
            r.grid,
            c["seed"],
            r.autocast,
            read_meta(config.data_dir(c))["tokenizer"],
        )


if __name__ == "__main__":
    main()
