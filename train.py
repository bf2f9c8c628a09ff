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
import gzip
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import parallel
import taco
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
tp_emulate = 1                  # > 1 with tp=1: every TP all-reduce computed as a TP=t group would (one GPU studies TP=8)
# tensor-parallel compression (taco.py): codec for forward activations / backward gradients
tp_codec = "none"
tp_codec_bwd = ""               # "" = same as tp_codec
codec_block = 256
dp_codec = "none"               # data-parallel gradient all-reduce codec (SDP4Bit-style: hint8 | hint4)
dp_overlap = True               # start each DP gradient bucket's all-reduce during the backward pass (False: after it)
zero1 = False                   # ZeRO stage 1 over DP: AdamW state (fp32 master + moments) sharded, 1/dp per rank
zero_codec = "none"             # with zero1: the parameter all-gather sends weight differences in this codec (SDP4Bit: hint4)
pp_codec = "none"               # activations between pipeline stages (TAH-Quant-style: tahquant)
pp_codec_bwd = ""               # gradients between stages ("" = same as pp_codec; TAH-Quant: higher precision, hint8)
tp_transport = "auto"           # auto: symmetric memory inside a node (GPU peers), else NCCL/gloo | dist | symm
taco_chunks = 1                 # measured on 2xH200: more chunks only add host overhead (README)
taco_min_bytes = 8388608        # smaller all-reduces stay uncompressed: compression won only >= 16 MB (README)
# system
seed = 1337
device = "auto"                 # auto | cpu | cuda
dtype = "auto"                  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
compile = False
profile_steps = 0               # > 0: profile the last N steps (CUDA kernels by kind) into out_dir/profile.json
profile_trace = False           # with profile_steps: also every rank's kernel timeline, out_dir/trace_rank<r>.json.gz
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


def kernel_kind(name):
    """What a CUDA kernel is: the TP transport (NCCL kernels, symmetric-memory barriers, torch's
    symmetric-memory all-reduce), our codec kernels, copies, or the rest (compute)."""
    name = name.lower()
    return ("comm: nccl" if "nccl" in name else "comm: symm barrier" if "barrier" in name else
            "comm: symm two-shot" if "all_reduce" in name else             # torch's symm_mem kernels
            "codec kernels" if "encode_kernel" in name or "decode_kernel" in name else
            "memcpy/memset" if "memcpy" in name or "memset" in name else "compute")


def kernel_time_by_kind(prof, steps):
    """GPU time per step (ms) of the profiled CUDA kernels, by kernel_kind.
    Kernels on different streams overlap (communication runs beside the matmuls), so the kinds
    can add up to more than the step."""
    kinds = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = kernel_kind(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + e.time_range.elapsed_us() / 1000 / steps
    return kinds


def check_config(cfg, world):
    """Everything that can be refused before launch."""
    mc = GPTConfig(block_size=cfg["block_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                   n_embd=cfg["n_embd"])
    if world % (cfg["tp"] * cfg["pp"]):
        raise parallel.ConfigError(f"world size {world} is not divisible by tp*pp = {cfg['tp'] * cfg['pp']}: "
                                   f"launch with a multiple of {cfg['tp'] * cfg['pp']} processes")
    dp = world // (cfg["tp"] * cfg["pp"])
    parallel.check_layout(cfg["tp"], cfg["pp"], dp, world, mc.n_head, mc.n_embd, mc.padded_vocab, mc.n_layer)
    if cfg["eval_interval"] and cfg["eval_iters"] % dp:
        raise parallel.ConfigError(f"eval_iters={cfg['eval_iters']} is not divisible by dp={dp}: every DP rank "
                                   f"evaluates the same number of batches; use a multiple of {dp}")
    if cfg["schedule"] not in ("1f1b", "gpipe"):
        raise parallel.ConfigError(f"schedule={cfg['schedule']!r}: choose 1f1b or gpipe")
    if cfg["sequence_parallel"] and cfg["block_size"] % cfg["tp"]:
        raise parallel.ConfigError(f"sequence_parallel needs block_size ({cfg['block_size']}) divisible by "
                                   f"tp={cfg['tp']}")
    if cfg["sequence_parallel"] and cfg["tp_emulate"] > 1:
        raise parallel.ConfigError("tp_emulate does not emulate sequence parallelism: drop one of them")
    if cfg["tp_emulate"] > 1:
        t = cfg["tp_emulate"]
        if cfg["tp"] != 1 or cfg["taco_chunks"] != 1:
            raise parallel.ConfigError(f"tp_emulate={t} emulates TP on one rank: set tp=1 and taco_chunks=1")
        parallel.check_layout(t, 1, 1, t, mc.n_head, mc.n_embd, mc.padded_vocab, mc.n_layer)
    if cfg["zero1"] and dp == 1:
        raise parallel.ConfigError(f"zero1 shards the optimizer over data parallelism, but dp=1: launch "
                                   f"{2 * cfg['tp'] * cfg['pp']} processes (dp=2) or set zero1=False")
    if cfg["zero_codec"] not in ("", "none") and not cfg["zero1"]:
        raise parallel.ConfigError("zero_codec compresses ZeRO-1's parameter all-gather: set zero1=True too")
    for k in ("tp_codec", "tp_codec_bwd", "dp_codec", "pp_codec", "pp_codec_bwd", "zero_codec"):
        if cfg[k] not in ("", *taco.codec_names()):
            raise parallel.ConfigError(f"{k}={cfg[k]!r} is not a codec; choose from {', '.join(taco.codec_names())}")
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


class Batches:
    """Random windows from a uint16 memmap. Stateless: the batch for (iteration, micro-step,
    dp rank) is a pure function of the seed, so resuming from a checkpoint is bit-exact. DP rank d
    of D takes the global micro-batches d, D + d, 2D + d, ...: one rank with D times the
    micro-steps sees exactly the same samples (what the parity tests compare)."""

    def __init__(self, dataset, block_size, batch_size, seed, dp_rank, device, dp=1):
        self.data = {s: np.memmap(os.path.join("data", dataset, f"{s}.bin"), dtype=np.uint16, mode="r")
                     for s in ("train", "val")}
        self.T, self.B, self.seed, self.dp_rank, self.dp, self.device = block_size, batch_size, seed, dp_rank, dp, device

    def get(self, split, it, micro=0):
        data = self.data[split]
        g = micro * self.dp + self.dp_rank                        # the global micro-batch index
        key = (((self.seed * 1_000_003 + (split == "val")) * 1_000_003 + it) * 1009 + g) * 1009
        g = torch.Generator().manual_seed(key % 2 ** 62)
        ix = torch.randint(len(data) - self.T - 1, (self.B,), generator=g).tolist()
        x = torch.stack([torch.from_numpy(data[i:i + self.T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + self.T].astype(np.int64)) for i in ix])
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


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
    Scales the gradients to norm <= max_norm; with ZeRO (`zero`, a parallel.ZeroAdamW) the squares
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


def save_checkpoint(out, grid, model, opt, it, cfg):
    """One file per (tp, pp) rank, written by dp rank 0 (with ZeRO-1 one per dp rank too: each
    holds its own optimizer shard): temp file + rename, so a crash mid-write never leaves a torn
    checkpoint."""
    if grid.dp_rank == 0 or cfg["zero1"]:
        os.makedirs(out, exist_ok=True)
        path = ckpt_path(out, grid, cfg["zero1"])
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter": it, "config": cfg,
                    "layout": [grid.tp, grid.pp]}, path + ".tmp")
        os.replace(path + ".tmp", path)
    if grid.world > 1:
        dist.barrier()


def main():
    g = globals()
    configure(g, sys.argv[1:])
    cfg = {k: g[k] for k in config_keys}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_config(cfg, world)
    except parallel.ConfigError as e:
        raise SystemExit(f"config error: {e}")

    # === processes, devices, groups ===
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    grid = parallel.init_grid(tp=tp, pp=pp)
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    ptdtype = {"auto": torch.bfloat16 if use_cuda else torch.float32, "float32": torch.float32,
               "bfloat16": torch.bfloat16}[dtype]
    master = grid.rank == 0
    if master:
        print("config:", json.dumps(cfg, sort_keys=True))
        print(f"grid: world {grid.world} = dp {grid.dp} x pp {grid.pp} x tp {grid.tp} | device {dev} | {ptdtype}"
              + (f" | TP={tp_emulate} emulated" if tp_emulate > 1 else ""))
    torch.manual_seed(seed)
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    used = ([tp_codec, tp_codec_bwd] * (max(grid.tp, tp_emulate) > 1) + [dp_codec, zero_codec] * (grid.dp > 1)
            + [pp_codec, pp_codec_bwd] * (grid.pp > 1))
    if use_cuda and any(c not in ("", "none", "tahquant") for c in used):
        taco.load_kernels()                                  # every rank; local rank 0 builds first

    # === model, optimizer ===
    comm = parallel.tp_comm_from_grid(grid, fwd_codec=tp_codec, bwd_codec=tp_codec_bwd or tp_codec,
                                      block_size=codec_block, chunks=taco_chunks, min_bytes=taco_min_bytes,
                                      emulate=tp_emulate, sp=sequence_parallel, transport=tp_transport)
    mcfg = GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                     dropout=dropout, bias=bias)
    model = GPT(mcfg, comm, seed=seed, stage=grid.pp_rank, stages=grid.pp).to(dev)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    dp_stats, pp_stats = taco.CommStats(), taco.CommStats()
    zero = dpsync = None
    if zero1:
        zero = opt = parallel.ZeroAdamW(params, grid, learning_rate, (beta1, beta2), 1e-8, weight_decay,
                                        grad_codec=dp_codec, param_codec=zero_codec, block_size=codec_block,
                                        stats=dp_stats)
    else:
        if grid.dp > 1:
            dpsync = parallel.DPGradSync(params, grid.dp_group, grid.dp, codec=dp_codec, block_size=codec_block,
                                         stats=dp_stats, overlap=dp_overlap)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=learning_rate, betas=(beta1, beta2), fused=use_cuda)
    it0 = 0
    if resume:
        path = ckpt_path(out_dir, grid, zero1)
        if not os.path.exists(path):
            raise SystemExit(f"--resume: no checkpoint at {path}")
        ck = torch.load(path, map_location=dev, weights_only=False)
        if ck["layout"] != [grid.tp, grid.pp]:
            raise SystemExit(f"checkpoint layout tp,pp={ck['layout']} but this run has {[grid.tp, grid.pp]}")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        it0 = ck["iter"]
        if master:
            print(f"resumed from {out_dir} at iteration {it0}")
    fwd_model = torch.compile(model) if compile else model
    if master:
        print(f"model: {model.num_params() / 1e6:.2f} M parameters (non-embedding), "
              f"{model.num_params(False) / 1e6:.2f} M in all")

    batches = Batches(dataset, block_size, batch_size, seed, grid.dp_rank, dev, grid.dp)
    autocast = torch.autocast(dev.type, dtype=ptdtype, enabled=ptdtype != torch.float32)
    tokens_per_iter = batch_size * block_size * gradient_accumulation_steps * grid.dp
    flops_per_iter = (6 * model.num_params() + 12 * n_layer * n_embd * block_size) * tokens_per_iter

    def mean_loss(split, it, n, train):
        """Mean loss of the n micro-batches of iteration `it` (and their backward if train), known
        on every rank: a plain loop at pp = 1, the pipeline schedule otherwise."""
        def forward(i, hidden):
            x, y = batches.get(split, it, i)
            with autocast:
                out, loss = fwd_model(x if model.first else None, y if model.last else None, hidden)
            return out, (None if loss is None else loss / n)
        if grid.pp == 1:
            total = 0.0
            for i in range(n):
                loss = forward(i, None)[1]
                if train:
                    loss.backward()
                total = total + loss.detach()
            return total
        actions = (parallel.pipeline_schedule(schedule, n, grid.pp_rank, grid.pp) if train
                   else [("F", i) for i in range(n)])
        seq = block_size // grid.tp if sequence_parallel else block_size       # the activation between stages
        total = parallel.run_pipeline(actions, forward, grid, (batch_size, seq, n_embd), torch.float32,
                                      dev, verbose=pp_verbose, codec=pp_codec, codec_bwd=pp_codec_bwd or pp_codec,
                                      block_size=codec_block, stats=pp_stats if train else None)
        total = total if model.last else torch.zeros((), device=dev)
        dist.broadcast(total, src=grid.rank + (grid.pp - 1 - grid.pp_rank) * grid.tp, group=grid.pp_group)
        return total

    @torch.no_grad()
    def evaluate(it):
        model.eval()
        out = {}
        for split in ("train", "val"):
            # the same eval_iters micro-batches whatever the layout: DP rank d takes d, d + dp, ...
            # (negative "iterations": never trained on)
            loss = mean_loss(split, -1 - it, eval_iters // grid.dp, train=False)
            if grid.dp > 1:
                dist.all_reduce(loss, group=grid.dp_group)
                loss /= grid.dp
            out[split] = loss.item()
        model.train()
        return out

    # === the loop ===
    bar = None
    if master and progress:
        from tqdm import tqdm
        bar = tqdm(total=max_iters, initial=it0, desc="train", unit="it", dynamic_ncols=True, leave=False)
    log = bar.write if bar is not None else print
    if master:
        os.makedirs(out_dir, exist_ok=True)
        jlog = open(os.path.join(out_dir, "log.jsonl"), "a" if resume else "w")   # machine-readable log

    def record(**kv):
        if master:
            jlog.write(json.dumps(kv) + "\n")
            jlog.flush()
    t0, loss_sum, nsum = time.time(), 0.0, 0
    prof = None
    for it in range(it0, max_iters):
        if use_cuda and profile_steps and it == max(it0, max_iters - profile_steps):
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.start()
            t_prof, it_prof = time.time(), it
        lr = get_lr(it, cfg)
        for group in opt.param_groups if zero is None else ():
            group["lr"] = lr
        torch.manual_seed(seed + 100003 * it + grid.dp_rank)   # dropout RNG: stateless, same on TP peers
        comm.stats.reset()
        dp_stats.reset()
        pp_stats.reset()
        if dpsync is not None:
            dpsync.start(gradient_accumulation_steps)        # dp_overlap: buckets start as their gradients finish
        lossf = mean_loss("train", it, gradient_accumulation_steps, train=True)
        if dpsync is not None:
            dpsync.finish()             # first: it writes the DP averages over .grad (the sums below commute)
        parallel.sync_sp_grads(params, comm)
        parallel.sync_tied_grads(model, grid)
        if zero is not None:                                 # ZeRO-1: reduce-scatter, clip, step, all-gather
            gnorm, coef = clip_grad_norm(params, grad_clip, grid, zero)
            zero.step(lr, coef)
        else:
            gnorm, _ = clip_grad_norm(params, grad_clip, grid)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if grid.dp > 1:
            dist.all_reduce(lossf, group=grid.dp_group)
            lossf /= grid.dp
        # the loss stays on the device (float64, as a Python float would sum it): no host sync in a
        # step; the host reads it only on the steps below, so it can prepare the next step meanwhile
        loss_sum, nsum = loss_sum + lossf.detach().double(), nsum + 1
        if bar is not None:
            bar.update(1)
        last = it + 1 == max_iters
        logging = (it + 1) % log_interval == 0 or it == it0
        evaluating = eval_interval and ((it + 1) % eval_interval == 0 or last)
        saving = ckpt_interval >= 0 and ((ckpt_interval and (it + 1) % ckpt_interval == 0) or last)
        if logging or evaluating or saving:
            mean = (loss_sum / nsum).item()                  # NaN in any step since the last log line shows here
            if not math.isfinite(mean):
                raise SystemExit(f"step {it + 1}: loss is {mean} (gradient norm {gnorm.item():.3g}; checked every "
                                 f"log_interval={log_interval} steps). Stopping. Try a lower --learning_rate, "
                                 f"--grad_clip, or --tp_codec=none to rule out the codec.")
        if logging:
            if use_cuda:
                torch.cuda.synchronize()
            dt = (time.time() - t0) / nsum
            line = (f"step {it + 1:6d} | loss {mean:7.4f} | lr {lr:.2e} | {dt * 1000:8.1f} ms | "
                    f"{tokens_per_iter / dt:9.0f} tok/s")
            if use_cuda:
                line += f" | mfu {100 * flops_per_iter / (dt * grid.world * peak_flops):5.1f}%"
            if grid.tp > 1:
                s = comm.stats
                line += (f" | tp {s.calls:3d} ar {s.wire_bytes / 2 ** 20:8.2f} MiB wire x{s.ratio:4.2f}")
            if grid.pp > 1:       # this rank's sends to its neighbour stages
                line += f" | pp {pp_stats.wire_bytes / 2 ** 20:8.2f} MiB wire x{pp_stats.ratio:4.2f}"
            if grid.dp > 1:
                line += f" | dp {dp_stats.wire_bytes / 2 ** 20:8.2f} MiB wire x{dp_stats.ratio:4.2f}"
            if master:
                log(line)
            record(iter=it + 1, loss=mean, lr=lr, ms=dt * 1000, tok_s=tokens_per_iter / dt,
                   tp_wire_bytes=comm.stats.wire_bytes, tp_ratio=comm.stats.ratio,
                   dp_wire_bytes=dp_stats.wire_bytes, dp_ratio=dp_stats.ratio,
                   pp_wire_bytes=pp_stats.wire_bytes, pp_ratio=pp_stats.ratio,
                   mfu=100 * flops_per_iter / (dt * grid.world * peak_flops) if use_cuda else None)
            t0, loss_sum, nsum = time.time(), 0.0, 0
        if evaluating:
            ev = evaluate(it)
            if master:
                log(f"step {it + 1:6d} | train {ev['train']:.4f} | val {ev['val']:.4f}")
            record(iter=it + 1, train_loss=ev["train"], val_loss=ev["val"])
            t0 = time.time()
        if saving:
            save_checkpoint(out_dir, grid, model, opt, it + 1, cfg)
    if bar is not None:
        bar.close()
    if prof is not None:
        torch.cuda.synchronize()
        prof.stop()
        steps = max_iters - it_prof
        kinds = kernel_time_by_kind(prof, steps)
        if master:
            summary = {"steps": steps, "wall_ms_per_step": 1000 * (time.time() - t_prof) / steps,
                       "kernel_ms_per_step": kinds}
            with open(os.path.join(out_dir, "profile.json"), "w") as f:
                json.dump(summary, f, indent=1)
            log("profile (ms per step, kernels by kind; streams overlap): " +
                ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds.items())))
        if profile_trace:                        # chrome://tracing or `python bench.py trace-report`
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"trace_rank{grid.rank}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                shutil.copyfileobj(f, g)
            os.remove(path)

    # === a sample, so you can see what it learned ===
    if sample_tokens > 0 and sequence_parallel and master:
        print("(no sample: generation is not implemented with sequence parallelism)")
    if sample_tokens > 0 and not sequence_parallel:
        from data.tokenizer import get_encoding
        enc = get_encoding()
        model.eval()
        idx = torch.tensor([enc.encode_ordinary(sample_prompt)], device=dev)
        gen = torch.Generator().manual_seed(seed)             # identical on every TP rank
        with autocast:
            out = model.generate(idx, sample_tokens, temperature=0.8, top_k=100, generator=gen, grid=grid)
        if master:
            print("sample:\n" + enc.decode(out[0].tolist()))
    if grid.world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
