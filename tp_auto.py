"""
tp_codec=auto: compress a direction of the TP all-reduces only where it pays, decided at start-up
by timing, on the real TP group and link, the all-reduces this model will send.

For each direction, the uncompressed all-reduce and each allowed codec are timed at the model's
message size (B * T * C elements of the compute dtype), with the run's transport and chunking:
- forward (g): the all-reduce alone, as it runs on the critical path;
- backward (f): the all-reduce started asynchronously and a (C x B*T) @ (B*T x C) matmul run
  meanwhile, as _F.backward computes the weight gradient, minus the matmul alone: what the overlap
  leaves exposed.
Every rank times; the job takes the largest time of each entry (so every rank decides alike);
a codec is chosen only if it beats `none` by more than MARGIN (so `auto` is never slower than
uncompressed beyond the timing noise). Without GPUs (gloo), auto is `none`: there is nothing to
measure that a GPU run would see.
"""

import time

import torch
import torch.distributed as dist

import taco

MARGIN = 0.03  # a codec must beat `none` by 3% to be chosen
CANDIDATES = {8: ("hint8",), 6: ("hint8", "hint6")}  # tp_auto_bits: the codecs auto may choose


def decide(times, margin=MARGIN):
    """{direction: {codec: seconds}} -> {direction: codec}: the fastest, if it beats `none` by more
    than `margin`, else `none`."""
    out = {}
    for d, t in times.items():
        best = min(t, key=t.get)
        out[d] = best if best != "none" and t[best] < t["none"] * (1 - margin) else "none"
    return out


def _seconds(fn, reps, sync):
    """The median of `reps` timed calls (each waited for), after a warm-up call (kernels, workspaces,
    NCCL channels): robust to a slow outlier."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(comm, numel, in_features, dtype, device, codecs, reps=7):
    """{"fwd": {codec: s}, "bwd": {codec: s}} for an all-reduce of `numel` elements on comm's group
    (its transport and chunks), the largest over the group's ranks."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(numel, dtype=dtype, device=device)
    rows = numel // in_features
    gy, a = (
        torch.randn(in_features, rows, dtype=dtype, device=device),
        torch.randn(rows, in_features, dtype=dtype, device=device),
    )
    names = ["none", *codecs]

    def reduce(codec, async_op=False):
        return taco.all_reduce(
            x,
            group=comm.group,
            codec=codec,
            codec_block=comm.codec_block,
            chunks=comm.chunks,
            async_op=async_op,
            transport=comm.transport,
        )

    def overlapped(codec):
        h = reduce(codec, async_op=True)
        gy @ a  # the weight gradient's matmul meanwhile
        h.wait()

    matmul = _seconds(lambda: gy @ a, reps, sync)
    t = torch.tensor(
        [
            [_seconds(lambda: reduce(c), reps, sync) for c in names],
            [max(0.0, _seconds(lambda: overlapped(c), reps, sync) - matmul) for c in names],
        ],
        dtype=torch.float64,
        device=device,
    )
    if dist.is_initialized():  # every rank of the job decides alike
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {d: dict(zip(names, t[i].tolist())) for i, d in enumerate(("fwd", "bwd"))}


def choose(comm, numel, in_features, dtype, device, bits=8):
    """The codecs for comm's directions set to "auto" (set on comm; a direction given explicitly
    stays) and the timings they came from."""
    auto = [d for d in ("fwd", "bwd") if getattr(comm, f"{d}_codec") == "auto"]
    if device.type != "cuda" or comm.size == 1 or numel * torch.finfo(dtype).bits // 8 < comm.min_bytes:
        picked, out = {"fwd": "none", "bwd": "none"}, {"why": "no GPU, one rank, or messages under taco_min_bytes"}
    else:
        times = measure(comm, numel, in_features, dtype, device, CANDIDATES[bits])
        picked = decide(times)
        out = {"ms": {d: {c: round(1e3 * s, 3) for c, s in t.items()} for d, t in times.items()}}
    for d in auto:
        setattr(comm, f"{d}_codec", picked[d])
    return {**picked, **out}
