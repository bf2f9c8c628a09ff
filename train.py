"""
Train a tensor-parallel GPT, optionally with compressed TP all-reduces.

    python train.py                                            # one process, the CPU demo defaults
    torchrun --nproc_per_node=4 train.py configs/demo.py       # TP=2 x PP=2 on CPU (gloo) or GPU (NCCL)
    torchrun --nproc_per_node=2 train.py configs/gpt2s.py --tp_codec=taco --max_iters=200
    torchrun --nproc_per_node=4 train.py configs/demo.py --resume  # continue from out_dir

Config (nanoGPT style): the globals below are the defaults; a config file is plain assignments
that override them; --key=value overrides are type-checked against the default's type.
"""
import ast
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import data_parallel
import parallel
import taco
import taco_kernels
from data.loader import Batches
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# defaults (the embedded default is the CPU demo: a tiny GPT on ~1 MB of Shakespeare)
out_dir = "out"
dataset = "small"               # data/<dataset>/{train,val}.bin (python data/prepare.py small)
# model
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
dropout = 0.0
bias = True
# batch: tokens per step = batch_size * block_size * gradient_accumulation_steps * dp
batch_size = 16
gradient_accumulation_steps = 1     # with pp > 1: the pipeline's micro-batches
# optimizer: AdamW, linear warmup then cosine decay to min_lr
learning_rate = 2e-3
min_lr = 2e-4
max_iters = 300
warmup_iters = 30
lr_decay_iters = 300
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
# evaluation, logging, checkpoints
eval_interval = 100
eval_iters = 10
log_interval = 10
ckpt_interval = 0               # 0: only at the end; -1: never
resume = False
progress = True                 # tqdm bar on rank 0
sample_tokens = 120             # sample this many tokens at the end (0: none)
sample_prompt = "\n"
# parallelism: world = tp * pp * dp (dp is derived)
tp = 1
pp = 1
schedule = "1f1b"               # pipeline schedule: 1f1b | gpipe
sequence_parallel = False       # shard LayerNorm/residual regions along the sequence over the TP group
pp_verbose = False              # print every pipeline send/receive (for learning how a schedule runs)
# tensor-parallel compression (taco.py): codec for forward activations / backward gradients
tp_codec = "none"
tp_codec_bwd = ""               # "" = same as tp_codec
codec_block = 256
dp_codec = "none"               # data-parallel gradient all-reduce codec (SDP4Bit-style: hint8 | hint4)
dp_overlap = True               # start each DP gradient bucket's all-reduce during the backward pass (False: after it)
zero1 = False                   # ZeRO stage 1 over DP: AdamW state (fp32 master + moments) sharded, 1/dp per rank
zero_codec = "none"             # with zero1: the parameter all-gather sends weight differences in this codec (SDP4Bit: hint4)
pp_codec = "none"               # activations between pipeline stages (TAH-Quant-style: tahquant, see lab/tahquant.py)
pp_codec_bwd = ""               # gradients between stages ("" = same as pp_codec; TAH-Quant: higher precision, hint8)
tp_transport = "auto"           # auto: symmetric memory inside a node (GPU peers), else NCCL/gloo | dist | symm
taco_chunks = 1                 # split each compressed all-reduce into pipelined chunks
taco_min_bytes = 8388608        # smaller TP all-reduces stay uncompressed (the codec's fixed costs dominate)
# system
seed = 1337
device = "auto"                 # auto | cpu | cuda
dtype = "auto"                  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
compile = False
profile_steps = 0               # > 0: every rank's CUDA kernel timeline of the last N steps -> out_dir/trace_rank<r>.json.gz
peak_flops = 989e12             # per-GPU dense bf16 peak for MFU (H100/H200 SXM datasheet)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in list(globals().items()) if not k.startswith("_")
               and isinstance(v, (int, float, bool, str))]


def configure(g, argv):
    """Apply a config file (plain assignments) and --key=value overrides to the globals dict g."""
    for arg in argv:
        if not arg.startswith("--"):
            if not os.path.exists(arg):
                raise SystemExit(f"config file {arg} not found")
            with open(arg) as f:
                exec(f.read(), g)
            continue
        key, _, val = arg[2:].partition("=")
        if key not in g or key not in config_keys:
            raise SystemExit(f"unknown config key --{key}; known keys: {', '.join(config_keys)}")
        if val == "" and isinstance(g[key], bool):
            val = "True"
        try:
            v = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            v = val
        if isinstance(g[key], float) and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if type(v) is not type(g[key]):
            raise SystemExit(f"--{key}={val}: expected {type(g[key]).__name__}, got {type(v).__name__}")
        g[key] = v


def check_config(cfg, world):
    """Everything that can be refused before launch."""
    mc = GPTConfig(block_size=cfg["block_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                   n_embd=cfg["n_embd"])
    dp = parallel.check_layout(cfg["tp"], cfg["pp"], world, None, mc.n_head, mc.n_embd, mc.padded_vocab,
                               mc.n_layer, cfg["schedule"])
    if cfg["eval_interval"] and cfg["eval_iters"] % dp:
        raise parallel.ConfigError(f"eval_iters={cfg['eval_iters']} is not divisible by dp={dp}: every DP rank "
                                   f"evaluates the same number of batches; use a multiple of {dp}")
    if cfg["sequence_parallel"] and cfg["block_size"] % cfg["tp"]:
        raise parallel.ConfigError(f"sequence_parallel needs block_size ({cfg['block_size']}) divisible by "
                                   f"tp={cfg['tp']}")
    if cfg["zero1"] and dp == 1:
        raise parallel.ConfigError(f"zero1 shards the optimizer over data parallelism, but dp=1: launch "
                                   f"{2 * cfg['tp'] * cfg['pp']} processes (dp=2) or set zero1=False")
    if cfg["zero_codec"] not in ("", "none") and not cfg["zero1"]:
        raise parallel.ConfigError("zero_codec compresses ZeRO-1's parameter all-gather: set zero1=True too")
    for k in ("tp_codec", "tp_codec_bwd", "dp_codec", "pp_codec", "pp_codec_bwd", "zero_codec"):
        if cfg[k] not in ("", *taco.codec_names()):
            raise parallel.ConfigError(f"{k}={cfg[k]!r} is not a codec; choose from {', '.join(taco.codec_names())} "
                                       f"(the lab's tahquant: launch with -m lab.tahquant instead of train.py)")
    if cfg["tp_transport"] not in taco.TRANSPORTS:
        raise parallel.ConfigError(f"tp_transport={cfg['tp_transport']!r}: choose {', '.join(taco.TRANSPORTS)}")
    if cfg["tp_transport"] == "symm" and (cfg["device"] == "cpu" or not torch.cuda.is_available()):
        raise parallel.ConfigError("tp_transport='symm' needs GPUs (symmetric memory): use auto or dist")
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise parallel.ConfigError("device='cuda' but no GPU is visible; use --device=cpu")
    for split in ("train", "val"):
        path = os.path.join("data", cfg["dataset"], f"{split}.bin")
        if not os.path.exists(path):
            raise parallel.ConfigError(f"{path} is missing: run  python data/prepare.py {cfg['dataset']}")


def get_lr(it, c):
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    if it > c["lr_decay_iters"]:
        return c["min_lr"]
    ratio = (it - c["warmup_iters"]) / max(1, c["lr_decay_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


def clip_grad_norm(params, max_norm, grid, zero=None):
    """Global gradient norm over the whole (sharded, staged) model: the squares of TP-split
    parameters are summed over the TP group, replicated ones counted once, then every pipeline
    stage's sum is added (the last stage's copy of the tied embedding is not counted twice).
    Scales the gradients to norm <= max_norm; with ZeRO (`zero`, a data_parallel.ZeroAdamW) the squares
    come from its DP-reduced gradient slices and the scale is applied in its step.
    Returns (norm, scale)."""
    dev = params[0].device
    if zero is not None:
        sq, repl_sq = zero.reduce_grads()
    else:
        grads = [p for p in params if p.grad is not None and not getattr(p, "pp_tied_copy", False)]
        split = [p.grad for p in grads if getattr(p, "tp_split", False)]
        repl = [p.grad for p in grads if not getattr(p, "tp_split", False)]
        sq = torch.stack([g.float().pow(2).sum() for g in split]).sum() if split else torch.zeros((), device=dev)
        repl_sq = torch.stack([g.float().pow(2).sum() for g in repl]).sum() if repl else 0.0
    if grid.tp > 1:
        dist.all_reduce(sq, group=grid.tp_group)
    sq = sq + repl_sq
    if grid.pp > 1:
        dist.all_reduce(sq, group=grid.pp_group)
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)
    if zero is None and max_norm > 0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
    return norm, coef


def ckpt_path(out, grid, zero1=False):
    return os.path.join(out, f"ckpt_tp{grid.tp_rank}_pp{grid.pp_rank}" + (f"_dp{grid.dp_rank}" if zero1 else "") + ".pt")


def save_checkpoint(r, it):
    """One file per (tp, pp) rank, written by dp rank 0 (with ZeRO-1 one per dp rank too: each
    holds its own optimizer shard): temp file + rename, so a crash mid-write never leaves a torn
    checkpoint."""
    if r.grid.dp_rank == 0 or r.cfg["zero1"]:
        os.makedirs(r.cfg["out_dir"], exist_ok=True)
        path = ckpt_path(r.cfg["out_dir"], r.grid, r.cfg["zero1"])
        torch.save({"model": r.model.state_dict(), "optimizer": r.opt.state_dict(), "iter": it, "config": r.cfg,
                    "layout": [r.grid.tp, r.grid.pp]}, path + ".tmp")
        os.replace(path + ".tmp", path)
    if r.grid.world > 1:
        dist.barrier()


# -----------------------------------------------------------------------------
# a run: processes, model, optimizer; one step; evaluation; the step line

def setup(cfg, model_hook=None):
    """Process groups, device, model, optimizer (and the resumed state): everything a step needs,
    as one namespace. model_hook(model, comm), if given, may change the model before the optimizer
    sees its parameters (lab/emulate.py replaces the TP layers with emulated ones this way)."""
    c = cfg
    use_cuda = c["device"] == "cuda" or (c["device"] == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    grid = parallel.init_grid(tp=c["tp"], pp=c["pp"])
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    ptdtype = {"auto": torch.bfloat16 if use_cuda else torch.float32, "float32": torch.float32,
               "bfloat16": torch.bfloat16}[c["dtype"]]
    torch.manual_seed(c["seed"])
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    codecs = ([c["tp_codec"], c["tp_codec_bwd"]] * (grid.tp > 1) + [c["dp_codec"], c["zero_codec"]] * (grid.dp > 1)
              + [c["pp_codec"], c["pp_codec_bwd"]] * (grid.pp > 1))
    if use_cuda and any(taco_kernels.supports(taco.get_codec(k, c["codec_block"])) for k in codecs if k):
        taco_kernels.load()                                  # every rank; local rank 0 builds first
    comm = parallel.TPComm(group=grid.tp_group, size=grid.tp, rank=grid.tp_rank, fwd_codec=c["tp_codec"],
                           bwd_codec=c["tp_codec_bwd"] or c["tp_codec"], block_size=c["codec_block"],
                           chunks=c["taco_chunks"], min_bytes=c["taco_min_bytes"], sp=c["sequence_parallel"],
                           transport=c["tp_transport"])
    mcfg = GPTConfig(block_size=c["block_size"], n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"],
                     dropout=c["dropout"], bias=c["bias"])
    model = GPT(mcfg, comm, seed=c["seed"], stage=grid.pp_rank, stages=grid.pp).to(dev)
    if model_hook is not None:
        model_hook(model, comm)
    r = SimpleNamespace(cfg=c, grid=grid, dev=dev, dtype=ptdtype, use_cuda=use_cuda, comm=comm, model=model,
                        params=list(model.parameters()),
                        fwd_model=torch.compile(model) if c["compile"] else model,
                        autocast=torch.autocast(dev.type, dtype=ptdtype, enabled=ptdtype != torch.float32),
                        batches=Batches(c["dataset"], c["block_size"], c["batch_size"], c["seed"], grid.dp_rank,
                                        dev, grid.dp),
                        dp_stats=taco.CommStats(), pp_stats=taco.CommStats(), zero=None, dpsync=None, it0=0)
    build_optimizer(r)
    if c["resume"]:
        path = ckpt_path(c["out_dir"], grid, c["zero1"])
        if not os.path.exists(path):
            raise SystemExit(f"--resume: no checkpoint at {path}")
        ck = torch.load(path, map_location=dev, weights_only=False)
        if ck["layout"] != [grid.tp, grid.pp]:
            raise SystemExit(f"checkpoint layout tp,pp={ck['layout']} but this run has {[grid.tp, grid.pp]}")
        model.load_state_dict(ck["model"])
        r.opt.load_state_dict(ck["optimizer"])
        r.it0 = ck["iter"]
    return r


def build_optimizer(r):
    """AdamW (weight decay on 2-D weights only), with DP gradient averaging, or ZeRO-1's sharded AdamW."""
    c, grid, params = r.cfg, r.grid, r.params
    if c["zero1"]:
        r.zero = r.opt = data_parallel.ZeroAdamW(params, grid, c["learning_rate"], (c["beta1"], c["beta2"]), 1e-8,
                                                 c["weight_decay"], grad_codec=c["dp_codec"],
                                                 param_codec=c["zero_codec"], block_size=c["codec_block"],
                                                 stats=r.dp_stats)
        return
    if grid.dp > 1:
        r.dpsync = data_parallel.DPGradSync(params, grid.dp_group, grid.dp, codec=c["dp_codec"],
                                            block_size=c["codec_block"], stats=r.dp_stats, overlap=c["dp_overlap"])
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    r.opt = torch.optim.AdamW(groups, lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]), fused=r.use_cuda)


def mean_loss(r, split, it, n, train):
    """Mean loss of the n micro-batches of iteration `it` (and their backward if train), known
    on every rank: a plain loop at pp = 1, the pipeline schedule otherwise."""
    model, grid, c = r.model, r.grid, r.cfg

    def forward(i, hidden):
        x, y = r.batches.get(split, it, i)
        with r.autocast:
            out, loss = r.fwd_model(x if model.first else None, y if model.last else None, hidden)
        return out, (None if loss is None else loss / n)
    if grid.pp == 1:
        total = 0.0
        for i in range(n):
            loss = forward(i, None)[1]
            if train:
                loss.backward()
            total = total + loss.detach()
        return total
    actions = (parallel.pipeline_schedule(c["schedule"], n, grid.pp_rank, grid.pp) if train
               else [("F", i) for i in range(n)])
    seq = c["block_size"] // grid.tp if c["sequence_parallel"] else c["block_size"]   # the activation between stages
    total = parallel.run_pipeline(actions, forward, grid, (c["batch_size"], seq, c["n_embd"]), torch.float32,
                                  r.dev, verbose=c["pp_verbose"], codec=c["pp_codec"],
                                  codec_bwd=c["pp_codec_bwd"] or c["pp_codec"], block_size=c["codec_block"],
                                  stats=r.pp_stats if train else None)
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
    torch.manual_seed(c["seed"] + 100003 * it + grid.dp_rank)   # dropout RNG: stateless, same on TP peers
    for s in (r.comm.stats, r.dp_stats, r.pp_stats):
        s.reset()
    if r.dpsync is not None:
        r.dpsync.start(c["gradient_accumulation_steps"])    # dp_overlap: buckets start as their gradients finish
    loss = mean_loss(r, "train", it, c["gradient_accumulation_steps"], train=True)
    if r.dpsync is not None:
        r.dpsync.finish()             # first: it writes the DP averages over .grad (the sums below commute)
    parallel.sync_sp_grads(r.params, r.comm)
    parallel.sync_tied_grads(r.model, grid)
    gnorm, coef = clip_grad_norm(r.params, c["grad_clip"], grid, r.zero)
    if r.zero is not None:                               # ZeRO-1: reduce-scatter, clip, step, all-gather
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


def step_line(r, it, mean, lr, dt, tokens, flops):
    """The rank-0 line of a log step, and its log.jsonl record."""
    mfu = 100 * flops / (dt * r.grid.world * r.cfg["peak_flops"]) if r.use_cuda else None
    line = f"step {it + 1:6d} | loss {mean:7.4f} | lr {lr:.2e} | {dt * 1000:8.1f} ms | {tokens / dt:9.0f} tok/s"
    if mfu is not None:
        line += f" | mfu {mfu:5.1f}%"
    for name, s, on in (("tp", r.comm.stats, r.grid.tp > 1), ("pp", r.pp_stats, r.grid.pp > 1),
                        ("dp", r.dp_stats, r.grid.dp > 1)):
        if on:              # this rank's bytes on the wire, and how much less than uncompressed
            line += f" | {name}{f' {s.calls:3d} ar' if name == 'tp' else ''} {s.wire_bytes / 2 ** 20:8.2f} MiB wire x{s.ratio:4.2f}"
    record = dict(iter=it + 1, loss=mean, lr=lr, ms=dt * 1000, tok_s=tokens / dt, mfu=mfu)
    for name, s in (("tp", r.comm.stats), ("dp", r.dp_stats), ("pp", r.pp_stats)):
        record.update({f"{name}_wire_bytes": s.wire_bytes, f"{name}_ratio": s.ratio})
    return line, record


def write_trace(r, prof, steps, seconds):
    """The profiled steps' CUDA kernel timeline of this rank (chrome trace, gzipped: chrome://tracing,
    or bench.py e2e / lab.analysis trace-report read it), and on rank 0 profile.json."""
    os.makedirs(r.cfg["out_dir"], exist_ok=True)
    prof.export_chrome_trace(os.path.join(r.cfg["out_dir"], f"trace_rank{r.grid.rank}.json.gz"))
    if r.grid.rank == 0:
        with open(os.path.join(r.cfg["out_dir"], "profile.json"), "w") as f:
            json.dump({"steps": steps, "wall_ms_per_step": 1000 * seconds / steps}, f)


def main(argv=None, model_hook=None):
    g = globals()
    configure(g, sys.argv[1:] if argv is None else argv)
    c = {k: g[k] for k in config_keys}
    try:
        check_config(c, int(os.environ.get("WORLD_SIZE", "1")))
    except parallel.ConfigError as e:
        raise SystemExit(f"config error: {e}")
    r = setup(c, model_hook)
    grid, master = r.grid, r.grid.rank == 0
    if master:
        print("config:", json.dumps(c, sort_keys=True))
        print(f"grid: world {grid.world} = dp {grid.dp} x pp {grid.pp} x tp {grid.tp} | device {r.dev} | {r.dtype}")
        if r.it0:
            print(f"resumed from {c['out_dir']} at iteration {r.it0}")
        print(f"model: {r.model.num_params() / 1e6:.2f} M parameters (non-embedding), "
              f"{r.model.num_params(False) / 1e6:.2f} M in all")
    tokens = c["batch_size"] * c["block_size"] * c["gradient_accumulation_steps"] * grid.dp
    flops = (6 * r.model.num_params() + 12 * c["n_layer"] * c["n_embd"] * c["block_size"]) * tokens
    bar = jlog = None
    if master and c["progress"]:
        from tqdm import tqdm
        bar = tqdm(total=c["max_iters"], initial=r.it0, desc="train", unit="it", dynamic_ncols=True, leave=False)
    log = bar.write if bar is not None else print
    if master:
        os.makedirs(c["out_dir"], exist_ok=True)
        jlog = open(os.path.join(c["out_dir"], "log.jsonl"), "a" if c["resume"] else "w")   # machine-readable log
    record = lambda kv: jlog and (jlog.write(json.dumps(kv) + "\n"), jlog.flush())
    t0, loss_sum, nsum, prof = time.time(), 0.0, 0, None
    for it in range(r.it0, c["max_iters"]):
        if r.use_cuda and c["profile_steps"] and it == max(r.it0, c["max_iters"] - c["profile_steps"]):
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.start()
            t_prof, it_prof = time.time(), it
        loss, gnorm, lr = train_step(r, it)
        # the loss stays on the device (float64, as a Python float would sum it): no host sync in a
        # step; the host reads it only on the steps below, so it can prepare the next step meanwhile
        loss_sum, nsum = loss_sum + loss.detach().double(), nsum + 1
        if bar is not None:
            bar.update(1)
        last = it + 1 == c["max_iters"]
        logging = (it + 1) % c["log_interval"] == 0 or it == r.it0
        evaluating = c["eval_interval"] and ((it + 1) % c["eval_interval"] == 0 or last)
        saving = c["ckpt_interval"] >= 0 and ((c["ckpt_interval"] and (it + 1) % c["ckpt_interval"] == 0) or last)
        if logging or evaluating or saving:
            mean = (loss_sum / nsum).item()                  # NaN in any step since the last log line shows here
            if not math.isfinite(mean):
                raise SystemExit(f"step {it + 1}: loss is {mean} (gradient norm {gnorm.item():.3g}; checked every "
                                 f"log_interval={c['log_interval']} steps). Stopping. Try a lower --learning_rate, "
                                 f"--grad_clip, or --tp_codec=none to rule out the codec.")
        if logging:
            if r.use_cuda:
                torch.cuda.synchronize()
            line, rec = step_line(r, it, mean, lr, (time.time() - t0) / nsum, tokens, flops)
            if master:
                log(line)
                record(rec)
            t0, loss_sum, nsum = time.time(), 0.0, 0
        if evaluating:
            ev = evaluate(r, it)
            if master:
                log(f"step {it + 1:6d} | train {ev['train']:.4f} | val {ev['val']:.4f}")
                record(dict(iter=it + 1, train_loss=ev["train"], val_loss=ev["val"]))
            t0 = time.time()
        if saving:
            save_checkpoint(r, it + 1)
    if bar is not None:
        bar.close()
    if prof is not None:
        torch.cuda.synchronize()
        prof.stop()
        write_trace(r, prof, c["max_iters"] - it_prof, time.time() - t_prof)
    if c["sample_tokens"] > 0:
        from sample import print_sample
        print_sample(r.model, c["sample_prompt"], c["sample_tokens"], r.grid, c["seed"], r.autocast)
    if grid.world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
