"""
Train a tensor-parallel GPT, optionally with compressed TP all-reduces.

    python train.py                                            # one process, the CPU demo defaults
    torchrun --nproc_per_node=4 train.py configs/demo.py       # TP=2 x PP=2 on CPU (gloo) or GPU (NCCL)
    torchrun --nproc_per_node=2 train.py configs/gpt2s.py --tp_codec=taco --max_iters=200
    torchrun --nproc_per_node=4 train.py configs/demo.py --resume  # continue from out_dir

Settings: config.Settings holds every setting with its type, default and comment, and `--help` prints
them; a config file is plain assignments that override them (nanoGPT style), --key=value overrides after
it (config.py reads both, type-checks them and refuses what cannot work before anything starts).
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
import hf
import optim
import parallel
import runlog
import taco
import watchdog
from data.loader import Batches
from model import GPT


def get_lr(it, cfg):
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def clip_grad_norm(params, max_norm, grid, zero=None):
    """Global gradient norm over the whole (sharded, staged) model: the squares of TP-split parameters
    summed over the TP group, replicated ones counted once, then every pipeline stage's sum added (the
    last stage's copy of the tied embedding not twice); with ZeRO (`zero`) the squares come from its
    DP-reduced slices. Returns (norm, coef): the optimizer's step scales the gradients by coef, so that their
    norm is <= max_norm (coef None: max_norm 0, no clipping). The gradients themselves are left as they are."""
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
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else None
    return norm, coef


# -----------------------------------------------------------------------------
# a run: its state, processes, model, optimizer; one step; evaluation; the step line


@dataclass
class Run:
    """Everything a step needs: setup() makes it; runlog, checkpoint, watchdog and the lab read it."""

    cfg: config.Settings  # the settings: the defaults, then config files, then --key=value (config.parse)
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
    dp_stats: taco.CommStats = field(default_factory=taco.CommStats)  # bytes of the DP gradient syncs
    pp_stats: taco.CommStats = field(default_factory=taco.CommStats)  # bytes between pipeline stages
    it0: int = 0  # the first iteration: 0, or the resumed checkpoint set's
    resumed_from: str = None  # the checkpoint set resumed from, or None
    run_id: str = ""  # the run's id, the same across resumes (checkpoint.new_run_id)


def setup(cfg, model_hook=None):
    """Process groups, device, model, optimizer (and the resumed state): the Run. model_hook(model, comm, cfg)
    may change the model before the optimizer sees it (lab/emulate.py: emulated TP layers)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    grid = parallel.init_grid(tp=cfg.tp, pp=cfg.pp, timeout=cfg.timeout)
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    ptdtype = {
        "auto": torch.bfloat16 if use_cuda else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[cfg.dtype]
    torch.manual_seed(cfg.seed)
    ways = {"tp": grid.tp, "dp": grid.dp, "zero": grid.dp, "pp": grid.pp}  # a codec acts where its group has 2+ ranks
    taco.load_kernels(cfg.codecs_in_use(ways), cfg.codec_block, dev)  # if a codec runs on them (local rank 0 builds)
    comm = parallel.TPComm(
        group=grid.tp_group,
        size=grid.tp,
        rank=grid.tp_rank,
        fwd_codec=cfg.tp_codec,
        bwd_codec=cfg.tp_codec_bwd or cfg.tp_codec,
        embed_codec=cfg.tp_codec_embed,
        codec_block=cfg.codec_block,
        chunks=cfg.taco_chunks,
        min_bytes=cfg.taco_min_bytes,
        sp=cfg.sequence_parallel,
        transport=cfg.tp_transport,
        site_codecs={"attn": cfg.tp_codec_attn, "mlp": cfg.tp_codec_mlp},
    )
    auto = None
    if "auto" in (comm.fwd_codec, comm.bwd_codec):  # timed on this group and link
        import tp_auto

        auto = tp_auto.choose(
            comm, cfg.batch_size * cfg.block_size * cfg.n_embd, cfg.n_embd, ptdtype, dev, cfg.tp_auto_bits
        )
    mc = cfg.model_config()
    model = GPT(mc, comm, seed=None if cfg.init_from else cfg.seed, stage=grid.pp_rank, stages=grid.pp)
    if cfg.init_from:  # every rank reads its own slices of the tensors, one at a time
        hf.load_into(model, cfg.init_from)
    model = model.to(dev)
    if model_hook is not None:
        model_hook(model, comm, cfg)
    r = Run(
        cfg=cfg,
        grid=grid,
        dev=dev,
        dtype=ptdtype,
        use_cuda=use_cuda,
        comm=comm,
        model=model,
        params=list(model.parameters()),
        fwd_model=torch.compile(model) if cfg.compile else model,
        autocast=torch.autocast(dev.type, dtype=ptdtype, enabled=ptdtype != torch.float32),
        batches=Batches(config.data_dir(cfg), cfg.block_size, cfg.batch_size, cfg.seed, grid.dp_rank, dev, grid.dp),
        tp_auto=auto,
    )
    build_optimizer(r)
    r.resumed_from = checkpoint.resume(r) if cfg.resume else None
    if not cfg.resume:
        r.run_id = checkpoint.new_run_id(grid)
    return r


def build_optimizer(r):
    """AdamW (weight decay on 2-D weights only; which AdamW a device takes: optim.py), with DP gradient averaging,
    or ZeRO-1's sharded AdamW."""
    cfg, grid, params = r.cfg, r.grid, r.params
    if cfg.zero1:
        r.zero = r.opt = data_parallel.ZeroAdamW(
            params,
            grid,
            cfg.learning_rate,
            (cfg.beta1, cfg.beta2),
            1e-8,
            cfg.weight_decay,
            grad_codec=cfg.dp_codec,
            param_codec=cfg.zero_codec,
            codec_block=cfg.codec_block,
            stats=r.dp_stats,
        )
        return
    if grid.dp > 1:
        r.dpsync = data_parallel.DPGradSync(
            params,
            grid.dp_group,
            grid.dp,
            codec=cfg.dp_codec,
            codec_block=cfg.codec_block,
            stats=r.dp_stats,
            overlap=cfg.dp_overlap,
        )
    betas = (cfg.beta1, cfg.beta2)
    r.opt = optim.adamw(params, cfg.learning_rate, betas, cfg.weight_decay, r.use_cuda, cfg.compile)


def mean_loss(r, split, it, n, train):
    """Mean loss of the n micro-batches of iteration `it` (and their backward if train), known
    on every rank: a plain loop at pp = 1, the pipeline schedule otherwise."""
    model, grid, cfg = r.model, r.grid, r.cfg

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
        parallel.pipeline_schedule(cfg.schedule, n, grid.pp_rank, grid.pp) if train else [("fwd", i) for i in range(n)]
    )
    seq = cfg.block_size // grid.tp if cfg.sequence_parallel else cfg.block_size  # the activation between stages
    total = parallel.run_pipeline(
        actions,
        forward,
        grid,
        (cfg.batch_size, seq, cfg.n_embd),
        torch.float32,
        r.dev,
        verbose=cfg.pp_verbose,
        codec=cfg.pp_codec,
        codec_bwd=cfg.pp_codec_bwd or cfg.pp_codec,
        codec_block=cfg.codec_block,
        stats=r.pp_stats if train else None,
    )
    total = total if model.last else torch.zeros((), device=r.dev)
    dist.broadcast(total, src=grid.last_stage_rank, group=grid.pp_group)
    return total


def train_step(r, it):
    """One optimizer step: forward/backward of every micro-batch, gradient syncs, clip, update.
    Returns the step's mean loss (on the device), the gradient norm and the learning rate."""
    cfg, grid = r.cfg, r.grid
    lr = get_lr(it, cfg)
    for group in r.opt.param_groups if r.zero is None else ():
        group["lr"] = lr
    torch.manual_seed(cfg.seed + 100003 * it + grid.dp_rank)  # dropout RNG: stateless, same on TP peers
    for stats in (r.comm.stats, r.dp_stats, r.pp_stats):
        stats.reset()
    if r.dpsync is not None:
        r.dpsync.start(cfg.gradient_accumulation_steps)  # dp_overlap: buckets start as their gradients finish
    loss = mean_loss(r, "train", it, cfg.gradient_accumulation_steps, train=True)
    if r.dpsync is not None:
        r.dpsync.finish()  # first: it writes the DP averages over .grad (the sums below commute)
    parallel.sync_replicated_grads(r.params, r.comm)
    parallel.sync_tied_grads(r.model, grid)
    gnorm, coef = clip_grad_norm(r.params, cfg.grad_clip, grid, r.zero)
    if r.zero is not None:  # ZeRO-1: reduce-scatter, clip, step, all-gather
        r.zero.step(lr, coef)
    else:
        r.opt.step(coef)  # the step applies the clip as it reads the gradients (optim.py)
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
        loss = mean_loss(r, split, -1 - it, r.cfg.eval_iters // r.grid.dp, train=False)
        if r.grid.dp > 1:
            dist.all_reduce(loss, group=r.grid.dp_group)
            loss /= r.grid.dp
        out[split] = loss.item()
    r.model.train()
    return out


def main(argv=None, model_hook=None):
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(config.help_text())
        return
    r = setup(config.start(argv), model_hook)
    try:
        train(r)
    except RuntimeError as e:
        if not watchdog.timed_out(e):
            raise
        raise SystemExit(watchdog.stalled_exit(r.grid, r.cfg.timeout, e)) from None
    leave(r.grid)


def leave(grid):
    """Every rank at the same point: a barrier, then the process groups destroyed while the interpreter is whole
    (left to its exit, gloo's teardown can abort a rank)."""
    if grid.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def train(r):
    cfg, grid = r.cfg, r.grid
    tokens = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps * grid.dp
    flops = (6 * r.model.config.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size) * tokens
    out, prof, stop = runlog.Output(r), runlog.Profile(r), watchdog.Stop(grid.rank == 0)
    t0, loss_sum, nsum = time.time(), 0.0, 0
    for it in range(r.it0, cfg.max_iters):
        prof.before_step(it)
        loss, gnorm, lr = train_step(r, it)
        # the loss stays on the device (float64, as a Python float would sum it): no host sync in a
        # step; the host reads it only on the steps below, so it can prepare the next step meanwhile
        loss_sum, nsum = loss_sum + loss.detach().double(), nsum + 1
        out.step()
        last = it + 1 == cfg.max_iters
        logging = (it + 1) % cfg.log_interval == 0 or it == 0 or last
        evaluating = cfg.eval_interval and ((it + 1) % cfg.eval_interval == 0 or last)
        saving = cfg.ckpt_interval >= 0 and (
            last or ((it + 1) % cfg.ckpt_interval == 0 if cfg.ckpt_interval else evaluating)
        )
        stopping = 0
        if logging or evaluating or saving:
            mean = (loss_sum / nsum).item()  # NaN in any step since the last log line shows here
            if not math.isfinite(mean):
                raise SystemExit(
                    f"step {it + 1}: loss is {mean} (gradient norm {gnorm.item():.3g}; checked every "
                    f"log_interval={cfg.log_interval} steps). Stopping. Try a lower --learning_rate, "
                    f"--grad_clip, or --tp_codec=none to rule out the codec."
                )
            stopping = stop.agreed(grid, r.dev)  # a signal on any rank: every rank saves here, then ends
            evaluating = evaluating and not stopping
            saving = saving or (stopping and cfg.ckpt_interval >= 0)
        if logging:
            if r.use_cuda:
                torch.cuda.synchronize()
            out.line(*runlog.step_line(r, it, mean, lr, (time.time() - t0) / nsum, tokens, flops, gnorm.item()))
            t0, loss_sum, nsum = time.time(), 0.0, 0
        if evaluating:
            ev = evaluate(r, it)
            out.line(
                f"step {it + 1:6d} | train {ev['train']:.4f} | val {ev['val']:.4f}",
                dict(iter=it + 1, train_loss=ev["train"], val_loss=ev["val"]),
            )
            t0 = time.time()
        if saving:
            out.line(f"saved checkpoint {checkpoint.save(r, it + 1)}")
        if stopping:
            out.line(f"stopped at step {it + 1}" + ("; continue with --resume" if saving else ""))
            if grid.rank == 0 and "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun
                print("(torchrun reports the signal next: its traceback and exit code 1 are its own)", flush=True)
            leave(grid)  # every rank stops at this step (stop.agreed): they leave together, before torchrun goes
            raise SystemExit(128 + stopping)
    stop.restore()
    out.close()
    prof.finish()
    if cfg.sample_tokens > 0:
        from sample import print_sample

        print_sample(
            r.model,
            cfg.sample_prompt,
            cfg.sample_tokens,
            r.grid,
            cfg.seed,
            r.autocast,
            cfg.tokenizer,
        )
    if grid.rank == 0:
        saved = f"checkpoints in {os.path.join(cfg.out_dir, 'ckpt')}, " if cfg.ckpt_interval >= 0 else ""
        where = f"{saved}the log in {os.path.join(cfg.out_dir, 'log.jsonl')}"
        print(f"done: {where}; its curves: python -m lab.analysis curves {cfg.out_dir}", flush=True)


if __name__ == "__main__":
    main()
