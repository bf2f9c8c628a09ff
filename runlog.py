"""
runlog.py — what a training run writes: rank 0's banner and log lines, log.jsonl, the kernel trace.

train.py calls these; `r` is its run state (train.Run).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


class Output:
    """Rank 0's banner, progress bar (only when the output is a terminal), log lines and log.jsonl
    records; other ranks write nothing."""

    def __init__(self, r):
        self.master, self.bar, self.jlog, self.tb = r.grid.rank == 0, None, None, None
        if self.master:
            banner(r)
            self.jlog = open_log(r)
            if r.cfg.tensorboard:  # a resume drops the events after its step, as open_log drops records
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(r.cfg.out_dir, purge_step=r.it0 + 1 if r.resumed_from else None)
            if r.cfg.progress and sys.stderr.isatty():
                from tqdm import tqdm

                self.bar = tqdm(
                    total=r.cfg.max_iters, initial=r.it0, desc="train", unit="it", dynamic_ncols=True, leave=False
                )

    def step(self):
        if self.bar is not None:
            self.bar.update(1)

    def line(self, text, record=None):
        if self.master:
            (self.bar.write if self.bar is not None else print)(text)
            if record is not None:
                self.jlog.write(json.dumps(record) + "\n")
                self.jlog.flush()
                if self.tb is not None:
                    self.scalars(record)

    def scalars(self, record):
        """A record's numbers as TensorBoard scalars at its step: val/ for an evaluation, train/ else."""
        group = "val" if "val_loss" in record else "train"
        for k, v in record.items():
            if k != "iter" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(f"{group}/{k}", v, record["iter"])
        self.tb.flush()  # a stopped run keeps its last lines

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


class Profile:
    """--profile_steps=N: every rank's CUDA kernel timeline of the run's last N steps (write_trace)."""

    def __init__(self, r):
        self.r, self.prof = r, None

    def before_step(self, it):
        c = self.r.cfg
        if self.r.use_cuda and c.profile_steps and it == max(self.r.it0, c.max_iters - c.profile_steps):
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.start()
            self.t, self.it = time.time(), it

    def finish(self):
        if self.prof is not None:
            torch.cuda.synchronize()
            self.prof.stop()
            write_trace(self.r, self.prof, self.r.cfg.max_iters - self.it, time.time() - self.t)


def banner(r):
    """Rank 0's first lines: the settings, the rank grid, what tp_codec=auto chose, the model's size."""
    grid = r.grid
    print("config:", json.dumps(r.cfg.as_dict(), sort_keys=True))
    print(f"grid: world {grid.world} = dp {grid.dp} x pp {grid.pp} x tp {grid.tp} | device {r.dev} | {r.dtype}")
    if r.resumed_from:
        print(f"resumed from {r.resumed_from} (iteration {r.it0}, run {r.run_id})")
    elif r.cfg.init_from:
        mc = r.model.config
        print(f"init_from: {r.cfg.init_from} ({mc.family}, {mc.num_params(False) / 1e6:.1f}M parameters)")
    if r.tp_auto:
        print(f"tp_codec=auto: forward {r.comm.fwd_codec}, backward {r.comm.bwd_codec} ({r.tp_auto})")
    print(model_line(r.model.config))


def model_line(mc):
    """What the parameters are, in words: the token embedding (the padded vocabulary's rows) is most
    of a small model's, and a tied one is also the LM head."""
    m = lambda n: f"{n / 1e6:.2f} M"
    emb = mc.padded_vocab * mc.n_embd
    parts = [f"{m(emb)} of them the token embedding" + (" (tied: also the LM head)" if mc.tie_embeddings else "")]
    if not mc.tie_embeddings:
        parts.append(f"{m(emb)} the LM head")
    if mc.positions == "learned":
        parts.append(f"{m(mc.block_size * mc.n_embd)} the learned positions")
    return f"model: {m(mc.num_params(False))} parameters, " + ", ".join(parts)


def step_line(r, it, mean, lr, dt, tokens, flops, grad_norm):
    """The rank-0 line of a log step, and its log.jsonl record (also the last step's gradient norm, before
    clipping)."""
    mfu = 100 * flops / (dt * r.grid.world * r.cfg.peak_flops) if r.use_cuda else None
    line = f"step {it + 1:6d}/{r.cfg.max_iters} | loss {mean:7.4f} | lr {lr:.2e} | "
    line += f"{dt * 1000:8.1f} ms | {tokens / dt:9.0f} tok/s"
    if mfu is not None:
        line += f" | mfu {mfu:5.1f}%"
    for name, s, on in (
        ("tp", r.comm.stats, r.grid.tp > 1),
        ("pp", r.pp_stats, r.grid.pp > 1),
        ("dp", r.dp_stats, r.grid.dp > 1),
    ):
        if on:  # this rank's bytes on the wire, and how much less than uncompressed
            line += f" | {name}{f' {s.calls:3d} ar' if name == 'tp' else ''} {s.wire_bytes / 2**20:8.2f} MiB wire x{s.ratio:4.2f}"
    mem = None
    if r.use_cuda:  # the peak GPU memory of the run so far, the largest of any rank
        mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=r.dev)
        if r.grid.world > 1:
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        mem = mem.item()
        line += f" | mem {mem:5.1f} GiB"
    eta = (r.cfg.max_iters - it - 1) * dt  # at this line's pace, evaluations and saves not counted
    # the run's first step also warms up (allocations, kernels built or compiled): no pace to go by yet
    line += f" | eta {duration(eta) if it > r.it0 else '-'}"
    record = dict(iter=it + 1, loss=mean, lr=lr, grad_norm=grad_norm, ms=dt * 1000, tok_s=tokens / dt, mfu=mfu)
    record["peak_mem_gib"] = mem
    for name, s in (("tp", r.comm.stats), ("dp", r.dp_stats), ("pp", r.pp_stats)):
        record.update({f"{name}_wire_bytes": s.wire_bytes, f"{name}_ratio": s.ratio})
    return line, record


def duration(seconds):
    """1h02m, 3m05s, 42s: a time to read in a log line."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def write_trace(r, prof, steps, seconds):
    """The profiled steps' CUDA kernel timeline of this rank (chrome trace, gzipped: chrome://tracing,
    or bench.py e2e / lab.analysis trace-report read it), and on rank 0 profile.json."""
    os.makedirs(r.cfg.out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(r.cfg.out_dir, f"trace_rank{r.grid.rank}.json.gz"))
    if r.grid.rank == 0:
        with open(os.path.join(r.cfg.out_dir, "profile.json"), "w") as f:
            json.dump({"steps": steps, "wall_ms_per_step": 1000 * seconds / steps}, f)


def open_log(r):
    """Rank 0's log.jsonl: the resolved config first; on resume the records after the resumed
    iteration (a run that went on past its last checkpoint) are dropped, so no step appears twice."""
    path = os.path.join(r.cfg.out_dir, "log.jsonl")
    os.makedirs(r.cfg.out_dir, exist_ok=True)
    kept = []
    if r.resumed_from and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line).get("iter", 0) <= r.it0]
    f = open(path, "w")
    f.writelines(kept)
    f.write(
        json.dumps(
            {
                "config": r.cfg.as_dict(),
                "run_id": r.run_id,
                "resumed_from": r.resumed_from,
                "iter0": r.it0,
                "tp_auto": r.tp_auto,
            }
        )
        + "\n"
    )
    return f
