"""
Where one training step's GPU memory goes (one GPU, TP=1, the loop of `bench.py hf`: fp32 weights
under bf16 autocast, compiled, fused AdamW, clipping), and what the book's `recompute` setting saves
and costs:

    ""         every activation kept for the backward
    pointwise  the norms' outputs and the MLP's activation recomputed (elementwise passes a matmul reads)
    mlp        each MLP's fc and activation recomputed in the backward (its widest tensors)
    block      every block recomputed whole (full activation checkpointing: the floor)

    python -m lab.memory configs/qwen2_5_0_5b.py [--steps 10] [--variants ",mlp,block"] [--budgets 1,0.5] [-- --key=value]
    python -m lab.memory configs/qwen2_5_0_5b.py --cpu 512      # no GPU: what the forward keeps
    python -m lab.memory configs/qwen2_5_0_5b.py --at_peak      # what is live at the step's peak, by book line

Per variant: the resident memory (weights, AdamW state), what the forward keeps for the backward
(allocated after the forward less the resident), the step's peak, ms/step: results/memory_<tag>.json.
With --cpu: the bytes one eager forward keeps for the backward, per sequence and fixed (the fused
loss's head gradient, bf16 copies of weights): results/memory_<tag>_cpu.json. With --at_peak: one
step of the first variant recorded by the CUDA caching allocator, the blocks live at its peak summed by
the innermost line of the book that allocated them: results/memory_<tag>_at_peak.json.
"""

import argparse
import dataclasses
import os
import sys
import time

import torch

import config as settings
import model as book
import recompute
from benchmarks.common import ROOT, save, split_at_dashes, table
from benchmarks.models import _batch, _trainer

VARIANTS = book.RECOMPUTE


def measure(cfg, name, steps, warmup=4, budget=1.0):
    """One row: cfg's model with recompute=name, compiled, on the GPU: its memory and ms/step. budget < 1:
    torch.compile's activation memory budget (the partitioner then recomputes what its solver picks, the
    cheapest first, to keep about that fraction of the activations it would save)."""
    mc, dev = dataclasses.replace(cfg.model_config(), recompute=name), torch.device("cuda")
    torch._dynamo.reset()  # else a new model of the same class reuses the last row's compiled graph and its budget
    x, y = _batch(mc, cfg.batch_size, cfg.block_size, dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = book.GPT(mc, seed=0).to(dev)
    run = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    kept = []

    def step(probe=False):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(x, y)[1]
        if probe:
            torch.cuda.synchronize()
            kept.append(torch.cuda.memory_allocated())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    with torch._functorch.config.patch(activation_memory_budget=budget):  # read when the step compiles
        for _ in range(warmup):
            step()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    step(probe=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    row = {
        "recompute": name or "none",
        "memory budget": budget,
        "ms/step": round(ms, 2),
        "resident GiB": round(resident / 2**30, 2),
        "kept for backward GiB": round((kept[0] - base - resident) / 2**30, 2),
        "peak GiB": round(peak / 2**30, 2),
        "loss": round(loss.item(), 4),
    }
    return row  # the model, its optimizer and their memory go with this frame


# the files whose lines a block is attributed to: the route's Python and its appendices
BOOK = ("model.py", "parallel.py", "taco.py", "train.py", "loss.py", "optim.py", "recompute.py")


def live_at_peak(trace, root=ROOT, book=BOOK):
    """Replay an allocator trace (torch.cuda.memory._snapshot()["device_traces"][0]) to its peak: bytes of
    the blocks live there, summed by the innermost frame in a book file under root ("file:line function"), largest
    first. The peak is of the bytes allocated since the trace began, less the frees of blocks from before it."""
    live, now, peak, at_peak = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
        elif e["action"] == "free_completed":
            now -= live.pop(e["addr"])["size"] if e["addr"] in live else e["size"]
        if now > peak:
            peak, at_peak = now, dict(live)
    by_line = {}
    for e in at_peak.values():
        ours = [f for f in e.get("frames", []) if os.path.dirname(f["filename"]) == root]
        ours = [f for f in ours if os.path.basename(f["filename"]) in book]
        key = f"{os.path.basename(ours[0]['filename'])}:{ours[0]['line']} {ours[0]['name']}" if ours else "elsewhere"
        n, size = by_line.get(key, (0, 0))
        by_line[key] = (n + 1, size + e["size"])
    return peak, sorted(by_line.items(), key=lambda kv: -kv[1][1])


def at_peak(cfg, warmup=4):
    """One step of cfg's model in bench.py hf's loop (after warmup steps) under the allocator's recorder: live_at_peak."""
    mc, dev = cfg.model_config(), torch.device("cuda")
    x, y = _batch(mc, cfg.batch_size, cfg.block_size, dev)
    step = _trainer(book.GPT(mc, seed=0).to(dev), lambda m: m(x, y)[1])
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, lines = live_at_peak(trace)
    return start, torch.cuda.max_memory_allocated(), peak, lines


def kept_for_backward(mc, name, batch, seq):
    """Bytes one forward keeps for the backward, eager on the CPU under bf16 autocast: autograd's saved
    tensors (each storage once, the weights left out) and the inputs each checkpoint keeps to
    recompute from. Compiled, the partitioner may keep less (it recomputes cheap pointwise results)."""
    model = book.GPT(dataclasses.replace(mc, recompute=name), seed=0)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def note(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def noted(fn, *args, **kw):  # a checkpoint keeps its inputs
        [note(a) for a in args]
        return checkpoint(fn, *args, **kw)

    x = torch.randint(0, mc.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    checkpoint, recompute.checkpoint = recompute.checkpoint, noted
    try:
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            model(x, x)
    finally:
        recompute.checkpoint = checkpoint
    return sum(kept.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="recompute settings, comma-separated")
    ap.add_argument("--budgets", default="1", help="torch.compile activation memory budgets, comma-separated")
    ap.add_argument(
        "--cpu", type=int, default=0, metavar="SEQ", help="no GPU: count what the forward keeps, at SEQ tokens"
    )
    ap.add_argument("--at_peak", action="store_true", help="what is live at one step's peak, by book line")
    ap.add_argument("--tag", default="")
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, extra = split_at_dashes(argv)
    a = ap.parse_args(ours)
    a.extra = extra
    cfg = settings.parse([a.config, *a.extra])
    mc, names, tag = cfg.model_config(), [v.strip() for v in a.variants.split(",")], a.tag or cfg.model_config().family
    if a.cpu:  # one sequence and two: what grows with the batch, and what does not
        rows = []
        for v in names:
            one, two = (kept_for_backward(mc, v, b, a.cpu) for b in (1, 2))
            rows.append({"recompute": v or "none", f"GiB per {a.cpu}-token sequence": round((two - one) / 2**30, 3),
                         "GiB fixed": round((2 * one - two) / 2**30, 3)})  # fmt: skip
        save(f"memory_{tag}_cpu", rows, config=a.config, extra=a.extra, seq=a.cpu, note=kept_for_backward.__doc__)
        table(rows, list(rows[0]))
        return
    if a.at_peak:
        start, top, peak, lines = at_peak(cfg)
        rows = [{"allocated by": "the step's start (weights, AdamW state, the batch)", "blocks": "",
                 "GiB": round(start / 2**30, 3)}]  # fmt: skip
        rows += [{"allocated by": k, "blocks": n, "GiB": round(b / 2**30, 3)} for k, (n, b) in lines]
        save(f"memory_{tag}_at_peak", rows, config=a.config, extra=a.extra, batch=cfg.batch_size,
             seq=cfg.block_size, peak_gib=round(top / 2**30, 3), live_at_peak_above_start_gib=round(peak / 2**30, 3),
             note=live_at_peak.__doc__)  # fmt: skip
        table(rows[:40], ["allocated by", "blocks", "GiB"])
        return
    rows = [measure(cfg, v, a.steps, budget=float(b)) for v in names for b in a.budgets.split(",")]
    base = rows[0]["ms/step"]
    for r in rows:
        r["vs first"] = f"{base / r['ms/step']:.3f}x"
    save(f"memory_{tag}", rows, config=a.config, extra=a.extra, batch=cfg.batch_size, seq=cfg.block_size)
    cols = ["recompute", "memory budget", "ms/step", "vs first", "resident GiB", "kept for backward GiB", "peak GiB"]
    table(rows, cols + ["loss"])


if __name__ == "__main__":
    main()
