"""
Benchmarks, each side by side with its baseline in one run; each prints a short table last and
writes its full results (date, machine, versions, the command) to results/<name>.json.

    python bench.py kernels                                  # GPU: fused kernels vs copy bandwidth vs PyTorch
    python bench.py overlap                                  # GPU: codec kernels beside a matmul, two streams
    python bench.py host                                     # GPU: host time of one eager compressed all-reduce
    torchrun --nproc_per_node=2 bench.py collective nvlink   # GPUs: taco.all_reduce vs NCCL bf16, 1..256 MB
    python bench.py e2e configs/gpt1b.py none,hint8 --nproc=2 --tag=gpt1b -- --compile=True --max_iters=30
    python bench.py hf configs/qwen2_5_0_5b.py               # GPU: our model vs transformers', TP=1, compiled
    python bench.py peer --nanogpt=../shared/anchors         # GPU: train.py at TP=1 vs nanoGPT's bench loop
"""

import argparse
import contextlib
import gzip
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import taco
import taco_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.environ.get("NANOTACO_RESULTS", os.path.join(ROOT, "results"))


def command():
    """How this process was started, relative to the repository (no machine paths in results)."""
    prog = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    if prog.startswith("lab" + os.sep):
        prog = "-m " + prog[:-3].replace(os.sep, ".")
    return " ".join(["python", prog, *sys.argv[1:]])


def environment():
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env.update(
            gpu=torch.cuda.get_device_name(),
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    return env


def save(name, rows, **extra):
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"env": environment(), **extra, "rows": rows}, f, indent=1)
    print("wrote", os.path.relpath(path, ROOT) if path.startswith(ROOT) else path)


def table(rows, cols):
    widths = [max([len(c)] + [len(f"{r.get(c, '-')}") for r in rows]) for c in cols]
    print(" | ".join(c.rjust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(f"{r.get(c, '-')}".rjust(w) for c, w in zip(cols, widths)))


# -----------------------------------------------------------------------------
# GPU timing


def cuda_time(fn, iters=20, warmup=3, before=None):
    """Median time in microseconds of fn() over `iters` runs, each bracketed by CUDA events
    (`before`, e.g. restoring an in-place input, runs outside the events): what a caller sees."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(iters):
        if before:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) * 1000 for a, b in times)
    return ts[len(ts) // 2]


def device_time(fn, iters=50, warmup=3):
    """Mean GPU microseconds per fn() when the runs go back to back: a sleep kernel holds the GPU
    while the host queues all of them, so launch and Python overhead do not count (kernel speed)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def host_time(fn, iters=50, reps=5):
    """Host microseconds per fn() call, issued back to back while a sleep kernel queued first keeps
    the GPU busy (the host never waits for it): the median of reps batches of iters calls."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ts.append((time.perf_counter() - t0) * 1e6 / iters)
    torch.cuda.synchronize()
    return sorted(ts)[len(ts) // 2]


# -----------------------------------------------------------------------------
# reading a kernel timeline (train.py --profile_steps; lab.analysis trace-report splits it further)


def kernel_kind(name):
    """What a CUDA kernel is: the TP transport (NCCL kernels, symmetric-memory barriers, torch's
    symmetric-memory all-reduce), our codec kernels, copies, or the rest (compute)."""
    name = name.lower()
    return (
        "comm: nccl"
        if "nccl" in name
        else "comm: symm barrier"
        if "barrier" in name
        else "comm: symm two-shot"
        if "all_reduce" in name
        # torch's symm_mem kernels
        else "codec kernels"
        if "encode_kernel" in name or "decode_kernel" in name
        else "memcpy/memset"
        if "memcpy" in name or "memset" in name
        else "compute"
    )


def trace_kernels(path):
    """(start us, end us, name) of every GPU kernel, copy and memset in a chrome trace (train.py
    --profile_steps writes one per rank)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        ev = json.load(f)
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    return [
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


def kernel_ms_by_kind(path, steps):
    """GPU time per step (ms) of the traced kernels, by kernel_kind. Kernels on different streams
    overlap (communication runs beside the matmuls), so the kinds can add up to more than the step."""
    kinds = {}
    for a, b, name in trace_kernels(path):
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + (b - a) / 1000 / steps
    return kinds


# -----------------------------------------------------------------------------
# the kernels, against the copy ceiling and the unfused reference


def bench_kernels(codecs=("hint8", "taco", "hint6"), sizes_m=(1, 4, 16, 64, 256), tag="kernels", dtype="bfloat16"):
    """Fused compress / decompress / reduce-compress GB/s (bytes read + written), input and output in
    dtype, next to a device-to-device copy of it (the ceiling) and the unfused PyTorch reference."""
    dt = getattr(torch, dtype)
    es = torch.empty((), dtype=dt).element_size()
    taco_ext.load()
    rows = []
    for m in sizes_m:
        n = m * 2**20
        x = torch.randn(n, device="cuda", dtype=dt)
        y = torch.empty_like(x)
        t_copy = device_time(lambda: y.copy_(x))
        copy_gbs = 2 * es * n / t_copy / 1e3
        rows.append(
            {
                "elements": f"{m}M",
                "op": "copy (ceiling)",
                "codec": "-",
                "us": f"{t_copy:.1f}",
                "GB/s": f"{copy_gbs:.0f}",
                "% of copy": "100",
            }
        )
        for name in codecs:
            cd = taco.get_codec(name)
            S = cd.nbytes(n)
            buf, half = cd.encode(x, 1, n), cd.encode(x, 2, n // 2)
            ops = [
                ("compress", lambda: cd.encode(x, 1, n), es * n + S),
                ("decompress", lambda: cd.decode(buf, n, n, dt, out=y), S + es * n),
                ("reduce-compress P=2", lambda: cd.reduce_encode(half, n // 2), 3 * cd.nbytes(n // 2)),
            ]
            if m <= 64:
                ops.append(("compress, unfused torch", lambda: cd._encode_ref(x, 1, n), es * n + S))
            for op, fn, nbytes in ops:
                t = cuda_time(fn, iters=5) if "unfused" in op else device_time(fn)
                gbs = nbytes / t / 1e3
                rows.append(
                    {
                        "elements": f"{m}M",
                        "op": op,
                        "codec": name,
                        "us": f"{t:.1f}",
                        "GB/s": f"{gbs:.0f}",
                        "% of copy": f"{100 * gbs / copy_gbs:.0f}",
                    }
                )
        x = y = None  # freed before the next size
        torch.cuda.empty_cache()
    save(
        tag,
        rows,
        nvcc_flags=os.environ.get("TACO_NVCC_FLAGS", ""),
        note="GB/s = (bytes read + bytes written) / "
        f"time; input and output {dtype} (reduce-compress: codes only); time = mean GPU time of 50 back-to-back "
        "runs (launch overhead hidden), the unfused reference: median of 5 single runs",
    )
    table(rows, ["elements", "op", "codec", "us", "GB/s", "% of copy"])


# -----------------------------------------------------------------------------
# the backward's overlap in isolation: codec kernels beside a weight-gradient matmul

OVERLAP_SHAPES = {  # name: (tokens, width C, TP size): one rank's MLP fc backward (input gradient T x C)
    "gpt1b tp2": (16384, 2048, 2),
    "gpt2s tp2": (16384, 768, 2),
    "gpt2s tp8": (16384, 768, 8),
    "gpt7b tp2": (16384, 4096, 2),
    "gpt7b tp8": (16384, 4096, 8),
}
# how the pair is issued: which goes first, stream priorities, the matmul split; and SM partitions:
# the codec on a green context of k SMs (torch.cuda.green_contexts), the matmul told to target all
# but k (cuBLASLt's SM count target: torch._C._set_sm_carveout_experimental), or both. (Grids capped
# at N CTAs, with the kernels of commit 0d5a585, lost everywhere: docs/RESULTS.md.)
OVERLAP_VARIANTS = [
    ("codec first", dict(first="codec")),
    ("codec first, its stream high priority", dict(first="codec", codec_prio=-1)),
    ("matmul first", dict(first="matmul")),
    ("matmul first, its stream high priority", dict(first="matmul", mm_prio=-1)),
    ("matmul in two halves, codec after the first", dict(first="split")),
]
OVERLAP_VARIANTS += [(f"codec on {k} SMs (green context)", dict(first="codec", codec_sms=k)) for k in (8, 16, 32)]
OVERLAP_VARIANTS += [(f"matmul targets all but {k} SMs (cuBLASLt)", dict(first="codec", carve=k)) for k in (8, 16, 32)]
OVERLAP_VARIANTS += [
    (f"codec on {k} SMs, matmul on the rest", dict(first="codec", codec_sms=k, carve=k)) for k in (8, 16, 32)
]
_GREEN = {}


@contextlib.contextmanager
def _codec_on(k):
    """Kernels issued inside run on k SMs only: on a stream of a green context of k SMs, after the
    current stream's work and before its next (k None: where they are)."""
    if not k:
        yield
        return
    if k not in _GREEN:  # the context and, torch >= 2.12, its own stream
        gc = torch.cuda.green_contexts.GreenContext.create(num_sms=k)
        _GREEN[k] = gc, gc.Stream() if hasattr(gc, "Stream") else None
    (gc, s), here = _GREEN[k], torch.cuda.current_stream()
    if s is not None:
        s.wait_stream(here)
        with torch.cuda.stream(s):
            yield
        here.wait_stream(s)
    else:  # torch 2.10-2.11: the context made current
        (getattr(gc, "set_context", None) or gc.make_current)()  # its default stream waits for `here`
        try:
            yield
        finally:
            (getattr(gc, "pop_context", None) or gc.pop_current)()  # and `here` for it


@contextlib.contextmanager
def _matmul_on(carve):
    """Matmuls issued inside go through cuBLASLt, told to use all SMs but `carve` (None: as usual;
    0: cuBLASLt on every SM)."""
    if carve is None:
        yield
        return
    lib = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(carve or None)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library(lib)


def bench_overlap(codecs=("hint8", "hint6", "taco"), shapes=tuple(OVERLAP_SHAPES), tag="overlap", iters=20):
    """One GPU. In the backward a TP all-reduce is started, then the weight-gradient matmul runs
    while it is on the wire. Here, without the wire: the codec kernels of one all-reduce (encode t
    messages, reduce t, decode all) on a side stream beside the weight-gradient matmul of the MLP's
    first linear (4C/t x T by T x C), each alone and then together in several ways (OVERLAP_VARIANTS).
    Per row: the pair's time from the common start, against the matmul alone (the target: <= 1.05x)
    and against the two one after the other (serial: > 1.00x means overlapping lost time)."""
    taco_ext.load()
    rows = []
    for shape in shapes:
        T, C, t = OVERLAP_SHAPES[shape]
        gy, x = (torch.randn(T, d, device="cuda", dtype=torch.bfloat16) for d in (4 * C // t, C))
        gw, h = torch.empty(4 * C // t, C, device="cuda", dtype=torch.bfloat16), 2 * C // t
        mm = [lambda: torch.mm(gy.t(), x, out=gw)]
        halves = [lambda: torch.mm(gy[:, :h].t(), x, out=gw[:h]), lambda: torch.mm(gy[:, h:].t(), x, out=gw[h:])]
        for codec in codecs:
            cd, n = taco.get_codec(codec), T * C
            L, grad = cd.padded(taco.cdiv(n, t)), torch.randn(n, device="cuda", dtype=torch.bfloat16)
            msgs, out = cd.encode(grad, t, L), torch.empty_like(grad)

            def codec_kernels():
                cd.encode(grad, t, L), cd.reduce_encode(msgs, L), cd.decode(msgs, L, n, out=out)

            alone_mm, alone_cd = device_time(mm[0]), device_time(codec_kernels)
            serial = alone_mm + alone_cd
            base = dict(
                shape=shape, codec=codec, **{"matmul alone us": f"{alone_mm:.1f}", "codec alone us": f"{alone_cd:.1f}"}
            )
            rows.append(
                dict(
                    base,
                    variant="one after the other",
                    **{"pair us": f"{serial:.1f}", "vs matmul": f"{serial / alone_mm:.2f}x", "vs serial": "1.00x"},
                )
            )
            for name, fn in (
                [("alone: matmul through cuBLASLt", lambda: _alone(mm[0], carve=0))]
                + [
                    (f"alone: matmul, all but {k} SMs (cuBLASLt)", lambda k=k: _alone(mm[0], carve=k))
                    for k in (8, 16, 32)
                ]
                + [
                    (f"alone: codec on {k} SMs (green context)", lambda k=k: _alone(codec_kernels, k))
                    for k in (8, 16, 32)
                ]
            ):
                t_alone = device_time(fn)
                rows.append(
                    dict(
                        base,
                        variant=name,
                        **{"pair us": f"{t_alone:.1f}", "vs matmul": f"{t_alone / alone_mm:.2f}x", "vs serial": "-"},
                    )
                )
            for name, v in OVERLAP_VARIANTS:
                pair = _overlap_pair(mm if v["first"] != "split" else halves, codec_kernels, iters, **v)
                rows.append(
                    dict(
                        base,
                        variant=name,
                        **{
                            "pair us": f"{pair:.1f}",
                            "vs matmul": f"{pair / alone_mm:.2f}x",
                            "vs serial": f"{pair / serial:.2f}x",
                        },
                    )
                )
    save(tag, rows, note=bench_overlap.__doc__)
    table(rows, ["shape", "codec", "variant", "matmul alone us", "codec alone us", "pair us", "vs matmul", "vs serial"])


def _alone(fn, codec_sms=None, carve=None):
    with _codec_on(codec_sms), _matmul_on(carve):
        fn()


def _overlap_pair(matmuls, codec_kernels, iters, first, codec_prio=0, mm_prio=0, codec_sms=None, carve=None):
    """Median microseconds from a common start until both the matmul (one or two calls on the
    matmul stream) and the codec kernels (a side stream) are done, issued in the given order
    (`split`: the codec after the first of two matmul halves). Both wait behind a sleep kernel
    until everything is queued, so the host's launch time does not count. codec_sms, carve: the SM
    partitions (_codec_on, _matmul_on)."""
    mm_stream, cd_stream = torch.cuda.Stream(priority=mm_prio), torch.cuda.Stream(priority=codec_prio)
    spans = []
    for i in range(iters + 3):
        start, end, half = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        with torch.cuda.stream(mm_stream):
            torch.cuda._sleep(20_000_000)  # holds both streams while the host queues the pair
            start.record()
        cd_stream.wait_event(start)
        with torch.cuda.stream(mm_stream), _matmul_on(carve):
            if first == "matmul":
                matmuls[0]()
            elif first == "split":
                matmuls[0]()
                half.record(mm_stream)
                cd_stream.wait_event(half)  # the codec starts once the first half is done
        with torch.cuda.stream(cd_stream), _codec_on(codec_sms):
            codec_kernels()
        with torch.cuda.stream(mm_stream), _matmul_on(carve):
            for m in matmuls[1:] if first == "split" else matmuls if first == "codec" else []:
                m()
            mm_stream.wait_stream(cd_stream)
            end.record()  # after both
        torch.cuda.synchronize()
        if i >= 3:  # warm-up rounds left out
            spans.append(start.elapsed_time(end) * 1000)
    return sorted(spans)[len(spans) // 2]


# -----------------------------------------------------------------------------
# the host's share of one eager all-reduce call


def bench_host(sizes_mb=(4, 64), tag="host"):
    """One GPU, a 1-rank group: host microseconds to issue one eager compressed all-reduce over
    symmetric memory (taco_symm.Workspace.two_shot: one binding call that queues encode, barrier,
    reduce, barrier, decode as one CUDA graph), sync and async, that binding call alone, with five
    launches instead of the graph, and one barrier launch, plus the checks taco.all_reduce makes
    before it (on one rank taco.all_reduce itself returns at once); next to NCCL's all-reduce and
    one small torch kernel on the same GPU. Per call, issued back to back (host_time)."""
    import taco_symm

    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl", rank=0, world_size=1)
    taco_ext.load()
    cd, rows = taco.get_codec("hint8"), []
    for mb in sizes_mb:
        x = torch.randn(mb * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
        ws = taco_symm.workspace(x, None, True, "symm")
        ws.two_shot(x, cd, None, False)  # the plan and the buffer
        plan = ws.plans[(x.numel(), cd)]
        for label, fn in (
            ("hint8 symm all-reduce, eager", lambda: ws.two_shot(x, cd, None, False)),
            ("  its binding call alone (a graph)", lambda: taco_ext.two_shot_peers(x, plan, ws.side, True)),
            (
                "  the binding call, five launches",
                lambda: taco_ext.two_shot_peers(x, plan, ws.side, True, replay=False),
            ),
            ("  onto its stream and back, nothing run", lambda: taco_ext.on_side(ws.side, True, lambda: None)),
            ("  one barrier launch", lambda: taco_ext.barrier(ws.pads, 0, 0)),
            ("hint8 symm all-reduce, async + wait", lambda: ws.two_shot(x, cd, None, True).wait()),
            (
                "taco.all_reduce's checks before it",
                lambda: (taco._check(x, None, cd), taco_symm.workspace(x, None, cd.kernel_ok(x), "auto")),
            ),
            ("NCCL all-reduce (bf16, 1 rank)", lambda: dist.all_reduce(x)),
            ("one small torch kernel (add_)", lambda: x[:1].add_(0)),
        ):
            rows.append({"MB": mb, "call": label, "host us": f"{host_time(fn):.1f}"})
    dist.destroy_process_group()
    save(tag, rows, note=bench_host.__doc__)
    table(rows, ["MB", "call", "host us"])


# -----------------------------------------------------------------------------
# the collective, against NCCL and PyTorch's symmetric-memory all-reduce


def _collective_variants(peers):
    """(label, codec, transport, chunks): NCCL's bf16 all-reduce first (the baseline)."""
    v = [
        ("nccl bf16", "none", "dist", 1),
        ("hint8", "hint8", "dist", 1),
        ("hint8", "hint8", "dist", 2),
        ("taco", "taco", "dist", 1),
        ("hint6", "hint6", "dist", 1),
    ]
    if peers:
        v = (
            v[:1]
            + [("symm bf16 two-shot", "none", "torch-symm", 1)]
            + v[1:]
            + [
                ("hint8", "hint8", "symm", 1),
                ("taco", "taco", "symm", 1),
                ("hint6", "hint6", "symm", 1),
                ("hint8", "hint8", "symm-graph", 1),
                ("hint6", "hint6", "symm-graph", 1),
            ]
        )
    return v


def _collective_runner(codec, transport, chunks, x, n):
    """(the tensor the all-reduce works on, a function running it once)."""
    if transport == "torch-symm":  # the input must live in symmetric memory
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        target = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(target, name)
        return target, lambda: torch.ops.symm_mem.two_shot_all_reduce_(target, "sum", name)
    if codec == "none":
        return x, lambda: dist.all_reduce(x)
    return x, lambda: taco.all_reduce(x, codec=codec, chunks=chunks, transport=transport.replace("-graph", ""))


def _time_collective(label, codec, transport, chunks, src, exact, world):
    """One row: correctness (every rank the same bits, error vs the exact sum), then the time."""
    target, run = _collective_runner(codec, transport, chunks, torch.empty_like(src), src.numel())
    target.copy_(src)
    run()
    if transport == "symm-graph":  # captured once (after the warm-up call above)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
        target.copy_(src)
        run()
    h = torch.stack(
        [target.view(torch.int16).long().sum(), (target.view(torch.int16).long() * 31).remainder(65521).sum()]
    )
    hs = [torch.empty_like(h) for _ in range(world)]
    dist.all_gather(hs, h)
    err = ((target.float() - exact).norm() / exact.norm()).item()
    dist.barrier()
    t = torch.tensor(cuda_time(run, iters=20, warmup=3, before=lambda: target.copy_(src)), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median
    return {
        "variant": label,
        "transport": transport,
        "chunks": chunks,
        "us": f"{t.item():.0f}",
        "host us": f"{host_time(run):.0f}",
        "t": t.item(),
        "algbw GB/s": f"{2 * src.numel() / t.item() / 1e3:.0f}",
        "rel err": f"{err:.1e}",
        "identical": "yes" if all(torch.equal(hs[0], o) for o in hs) else "NO",
    }


def bench_collective(sizes_mb=(1, 4, 16, 64, 256), tag="nvlink"):
    """taco.all_reduce vs torch.distributed.all_reduce (NCCL, bf16) and, when the GPUs are peers
    (no NCCL_P2P_DISABLE), vs PyTorch's symmetric-memory bf16 two-shot, same run, under torchrun.
    Ours on both transports ("dist": NCCL all-to-all + all-gather; "symm": peer reads), symm also
    replayed from a CUDA graph (no host overhead); NCCL's all-to-all and all-gather of hint8's
    bytes alone. algbw on LOGICAL bytes (the bf16 tensor), nccl-tests convention."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    taco_ext.load()
    peers = os.environ.get("NCCL_P2P_DISABLE", "0") in ("", "0")
    rows = []
    for mb in sizes_mb:
        n = mb * 2**20 // 2
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(rank))
        exact = src.float()
        dist.all_reduce(exact)
        these = [_time_collective(*v, src, exact, world) for v in _collective_variants(peers)]
        cd = taco.get_codec("hint8")
        S = cd.nbytes(cd.padded(-(-n // world)))
        send, recv = (torch.zeros(world * S, dtype=torch.uint8, device="cuda") for _ in range(2))
        for label, fn in (
            ("nccl all_to_all u8", lambda: dist.all_to_all_single(recv, send)),
            ("nccl all_gather u8", lambda: taco._all_gather_flat(recv, send[:S])),
        ):
            these.append(
                {
                    "variant": label,
                    "transport": "dist",
                    "chunks": 1,
                    "us": f"{cuda_time(fn):.0f}",
                    "host us": f"{host_time(fn):.0f}",
                }
            )
        base = {r["variant"]: r["t"] for r in these if "t" in r}
        for r in these:  # speedups against this size's two baselines
            r["MB"] = mb
            if "t" in r:
                t = r.pop("t")
                r["vs nccl"] = f"{base['nccl bf16'] / t:.2f}x"
                r["vs symm bf16"] = f"{base['symm bf16 two-shot'] / t:.2f}x" if peers else "-"
        rows += these
        torch.cuda.synchronize()
    if rank == 0:
        save(
            f"collective_{tag}",
            rows,
            world=world,
            tag=tag,
            env_vars={
                k: os.environ.get(k)
                for k in (
                    "NCCL_P2P_DISABLE",
                    "NCCL_SHM_DISABLE",
                    "NCCL_NVLS_ENABLE",
                    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                )
            },
        )
        print(f"\ncompressed all-reduce vs NCCL bf16 and symmetric-memory bf16, {world} GPUs, {tag}:")
        table(
            rows,
            [
                "MB",
                "variant",
                "transport",
                "chunks",
                "us",
                "host us",
                "algbw GB/s",
                "vs nccl",
                "vs symm bf16",
                "rel err",
                "identical",
            ],
        )
    dist.destroy_process_group()


# -----------------------------------------------------------------------------
# end-to-end training throughput: the same config with each codec, one invocation


def _e2e_row(entry, out):
    """The row of one trained entry: mean step time over the log lines after the first (the profiled
    steps excluded), tokens/s and MFU of that mean step, GPU kernel time per step by kind."""
    logs = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if '"ms"' in line]
    prof_path = os.path.join(out, "profile.json")
    prof = json.load(open(prof_path)) if os.path.exists(prof_path) else None
    if prof:
        logs = [r for r in logs if r["iter"] <= logs[-1]["iter"] - prof["steps"]]
    logs = logs[1:]
    if not logs:
        raise SystemExit(f"{entry}: too few steps to time; raise --max_iters or lower --log_interval")
    ms, last = sum(r["ms"] for r in logs) / len(logs), logs[-1]
    k = kernel_ms_by_kind(os.path.join(out, "trace_rank0.json.gz"), prof["steps"]) if prof else {}
    mfu = last["mfu"] * last["ms"] / ms if last.get("mfu") is not None else None
    return {
        "codec": entry,
        "ms/step": round(ms, 2),
        "tok/s": round(last["tok_s"] * last["ms"] / ms),
        "MFU %": round(mfu, 1) if mfu is not None else "-",
        "compute ms": round(k.get("compute", 0), 1) if prof else "-",
        "comm ms": round(sum(v for n, v in k.items() if n.startswith("comm")), 1) if prof else "-",
        "codec ms": round(k.get("codec kernels", 0), 1) if prof else "-",
        "tp wire MiB/step": round(last["tp_wire_bytes"] / 2**20, 2),
        "loss": round(last["loss"], 4),
        "peak GiB": round(last["peak_mem_gib"], 2) if last.get("peak_mem_gib") is not None else "-",
        "profile": {"kernel_ms_per_step": k, **(prof or {})},
    }


def bench_e2e(config, entries, nproc, extra, tag="e2e", profile_steps=5):
    """Train `config` once per entry (torchrun, nproc ranks), in this one invocation, and compare step
    time, tokens/s and MFU with the first entry (should be none). An entry is a TP codec, or
    KEY=VALUE[/KEY=VALUE...] train.py settings, or sol:fwd | sol:bwd | sol:all, the speed of light
    (lab/speed_of_light.py: those TP all-reduces skipped; timing only, the results are wrong). The
    peak GPU memory is the largest of any rank. On a GPU the last `profile_steps` steps are profiled
    (their kernel timeline gives the compute / comm / codec columns) and left out of the timing."""
    rows = []
    for entry in entries:
        out = os.path.join("out", f"{tag}_{entry.replace('=', '-').replace('/', '_')}")
        if entry.startswith("sol:"):  # the speed of light: lab.speed_of_light, TP all-reduces skipped
            entry_point, settings = ["-m", "lab.speed_of_light", entry[4:]], ["--tp_codec=none"]
        else:
            entry_point = ["train.py"]
            settings = [f"--{kv}" for kv in entry.split("/")] if "=" in entry else [f"--tp_codec={entry}"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            *entry_point,
            config,
            *settings,
            "--eval_interval=0",
            "--sample_tokens=0",
            "--progress=False",
            "--ckpt_interval=-1",
            f"--profile_steps={profile_steps if torch.cuda.is_available() else 0}",
            *extra,
            f"--out_dir={out}",
        ]
        print(" ".join(cmd), flush=True)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "output.txt"), "w") as f:  # everything train.py printed
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, timeout=int(os.environ.get("E2E_TIMEOUT", 900))
                ).returncode
            except subprocess.TimeoutExpired:  # e.g. a hung collective
                rc = "timeout"
        if rc != 0:  # say so with the first traceback, go on with the next entry
            lines = open(os.path.join(out, "output.txt")).read().splitlines()
            first = next((i for i, line in enumerate(lines) if "Traceback" in line), max(0, len(lines) - 40))
            print(f"{entry}: train.py FAILED ({rc}); {out}/output.txt:\n" + "\n".join(lines[first : first + 40]))
        rows.append(_e2e_row(entry, out) if rc == 0 else {"codec": entry, "ms/step": None, "failed": True})
    base = rows[0]["ms/step"]
    for r in rows:
        r["speedup"] = f"{base / r['ms/step']:.2f}x" if base and r["ms/step"] else "FAILED"
    save(
        f"e2e_{tag}",
        rows,
        config=config,
        nproc=nproc,
        extra=extra,
        note="mean step time over the log lines after the first (profiled steps excluded); speedup = first "
        "entry's ms / this entry's ms; compute/comm/codec ms = GPU kernel time per step by kind in the "
        "profiled steps (streams overlap, so they need not add up to the step)",
    )
    table(
        rows,
        [
            "codec",
            "ms/step",
            "speedup",
            "tok/s",
            "MFU %",
            "compute ms",
            "comm ms",
            "codec ms",
            "tp wire MiB/step",
            "peak GiB",
            "loss",
        ],
    )


# -----------------------------------------------------------------------------
# one GPU, TP=1: our model against transformers' model of the same family and shape


def _hf_model(mc, dev):
    """transformers' model of our config's family and shape (Qwen2ForCausalLM / GPT2LMHeadModel), SDPA."""
    import transformers

    import checkpoint

    cfg = checkpoint.hf_config(mc)
    conf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    return transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa").to(dev)


def bench_hf(config, steps=20, warmup=5, batch=0, tag="hf"):
    """Our model, built from `config`'s settings at TP=1, against transformers' model of the same family
    and shape, on one GPU in one invocation, with the same loop: fp32 weights under bf16 autocast,
    torch.compile, fused AdamW, gradient clipping at 1.0, the same random batch. Both stay resident;
    each is timed twice in the order ours, theirs, theirs, ours, so the noise shows. Peak memory is a
    block's peak less the other model's resident weights and optimizer state."""
    import config as settings
    import train
    from model import GPT, GPTConfig

    c = settings.parse(train.DEFAULTS, [config] + ([f"--batch_size={batch}"] if batch else []))
    mc, dev = GPTConfig.from_settings(c), torch.device("cuda")
    B, T = c["batch_size"], c["block_size"]
    x = torch.randint(0, mc.vocab_size, (B, T + 1), device=dev, generator=torch.Generator(dev).manual_seed(0))
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    ours = GPT(mc, seed=0).to(dev)
    theirs = _hf_model(mc, dev)
    losses = {
        "ours": lambda m: m(x, y)[1],  # next-token loss on T positions
        "transformers": lambda m: m(input_ids=x, labels=x).loss,
    }  # HF shifts: T - 1 positions
    runs = {}
    for name, model in (("ours", ours), ("transformers", theirs)):
        compiled, opt = torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(compiled=compiled, opt=opt, model=model, loss_of=losses[name]):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(compiled)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(warmup):  # compiles, and fills AdamW's state
            step()
        torch.cuda.synchronize()
        runs[name] = {
            "step": step,
            "resident": torch.cuda.memory_allocated() - sum(r["resident"] for r in runs.values()),
            "params": sum(p.numel() for p in model.parameters()),
        }
    flops = (6 * mc.num_params() + 12 * mc.n_layer * mc.n_embd * T) * B * T
    rows = []
    for name in ("ours", "transformers", "transformers", "ours"):
        other = sum(r["resident"] for n, r in runs.items() if n != name)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = runs[name]["step"]()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / steps * 1e3
        rows.append(
            {
                "model": name,
                "ms/step": round(ms, 2),
                "tok/s": round(B * T / ms * 1e3),
                "MFU %": round(flops / (ms / 1e3) / c["peak_flops"] * 100, 1),
                "peak GiB": round((torch.cuda.max_memory_allocated() - other) / 2**30, 2),
                "params": runs[name]["params"],
                "loss": round(loss.item(), 4),
            }
        )
    mean = lambda n: sum(r["ms/step"] for r in rows if r["model"] == n) / 2
    for r in rows:
        r["vs transformers"] = f"{mean('transformers') / r['ms/step']:.3f}x"
    save(
        f"hf_{tag}",
        rows,
        config=config,
        batch=B,
        seq=T,
        steps=steps,
        warmup=warmup,
        note="the same loop for both (bf16 autocast over fp32 weights, torch.compile, fused AdamW, clipping); "
        "MFU from our model's 6N + attention FLOPs per token against peak_flops; peak GiB: the block's "
        "peak less the other model's resident memory; vs transformers: the mean of transformers' two "
        "blocks over this block's ms",
    )
    table(rows, ["model", "ms/step", "vs transformers", "tok/s", "MFU %", "peak GiB", "params", "loss"])


# -----------------------------------------------------------------------------
# one GPU, TP=1: train.py against nanoGPT's own bench loop (the peer) on the same shapes

PEER_SHAPES = {
    "gpt2-small": dict(batch_size=12, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "1b": dict(batch_size=8, block_size=2048, n_layer=20, n_head=16, n_embd=2048),
}
# runs nanoGPT's bench_peer.py unchanged in its folder and adds its peak memory; with PEER_CLIP set, every
# AdamW step first clips the gradient norm to 1.0 the way nanoGPT's train.py does (its bench loop does not)
_PEER_RUNNER = """import os, runpy, sys, torch
if os.environ.get("PEER_CLIP"):
    step = torch.optim.AdamW.step
    def clipped(self, *args, **kw):
        torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 1.0)
        return step(self, *args, **kw)
    torch.optim.AdamW.step = clipped
sys.argv = ["bench_peer.py"] + sys.argv[1:]
runpy.run_path("bench_peer.py", run_name="__main__")
print("peak bytes", torch.cuda.max_memory_allocated())"""


def peer_folder(nanogpt):
    """The folder holding nanoGPT's bench_peer.py: `nanogpt` itself or its subfolder nanogpt/."""
    folder = nanogpt if os.path.exists(os.path.join(nanogpt, "bench_peer.py")) else os.path.join(nanogpt, "nanogpt")
    if not os.path.exists(os.path.join(folder, "bench_peer.py")):
        raise SystemExit(f"{nanogpt}: no bench_peer.py there (a nanoGPT folder with it, or the folder above one)")
    return folder


def run_nanogpt(folder, shape, clip=False, extra=()):
    """nanoGPT's bench_peer.py (through _PEER_RUNNER) in `folder` on the shape; its stdout."""
    p = subprocess.run(
        [sys.executable, "-c", _PEER_RUNNER, *[f"--{k}={v}" for k, v in shape.items()], *extra],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PEER_CLIP": "1" if clip else ""},
    )
    if p.returncode:
        raise SystemExit(f"{folder}/bench_peer.py failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout


def run_ours(shape, out, extra=()):
    """train.py at TP=1 on the shape (no bias, no dropout, compiled, 30 steps, a log line every 10) into `out`."""
    cmd = [
        sys.executable,
        "train.py",
        *[f"--{k}={v}" for k, v in shape.items()],
        "--bias=False",
        "--compile=True",
        "--max_iters=30",
        "--log_interval=10",
        "--eval_interval=0",
        "--ckpt_interval=-1",
        "--sample_tokens=0",
        "--progress=False",
        "--overwrite=True",
        f"--out_dir={out}",
        *extra,
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def _peer_nanogpt(folder, shape, clip=False):
    """nanoGPT's bench loop (10 steps of burn-in, then 20 timed; compiled, bf16 autocast, fused AdamW,
    random tokens on the GPU; clip: with its train.py's clipping): (ms/step, peak GiB)."""
    import re

    out = run_nanogpt(folder, shape, clip)
    ms, peak = re.search(r"time per iteration: ([\d.]+)ms", out), re.search(r"peak bytes (\d+)", out)
    if not ms:
        raise SystemExit(f"{folder}/bench_peer.py printed no time per iteration:\n{out[-2000:]}")
    return float(ms.group(1)), int(peak.group(1)) / 2**30


def _peer_ours(shape, extra):
    """train.py at TP=1 on the shape (run_ours): the mean of its log lines at steps 20 and 30 (steps
    11-30, as the peer's 20 after 10), and its peak GiB."""
    out = os.path.join("out", "peer")
    run_ours(shape, out, extra)
    logs = [json.loads(line) for line in open(os.path.join(ROOT, out, "log.jsonl")) if '"ms"' in line]
    timed = [r for r in logs if r["iter"] in (20, 30)]
    return sum(r["ms"] for r in timed) / len(timed), logs[-1]["peak_mem_gib"]


def bench_peer(nanogpt, shapes=tuple(PEER_SHAPES), variants=(), extra=(), peak_flops=989e12, tag="peer", clip=False):
    """train.py at TP=1 against nanoGPT's bench loop on the same shapes, one GPU, one invocation: per
    shape nanoGPT, ours, ours, nanoGPT (the noise shows; clip: nanoGPT with its train.py's clipping,
    which ours does, beside each of its runs), then each variant of ours once (train.py settings, e.g.
    grad_clip=0.0: what a difference costs). MFU for both from the same FLOPs per token (6N +
    attention, our count of the shape) against the H200's dense bf16 peak."""
    from model import GPTConfig

    folder = peer_folder(nanogpt)
    rows = []
    for name in shapes:
        shape = PEER_SHAPES[name]
        B, T = shape["batch_size"], shape["block_size"]
        mc = GPTConfig(**{k: v for k, v in shape.items() if k != "batch_size"}, bias=False)
        flops = (6 * mc.num_params() + 12 * mc.n_layer * mc.n_embd * T) * B * T
        ng, ngc, ours = (
            ("nanoGPT", lambda: _peer_nanogpt(folder, shape)),
            ("nanoGPT + clip", lambda: _peer_nanogpt(folder, shape, clip=True)),
            ("nanoTACO", lambda: _peer_ours(shape, extra)),
        )
        order = ([ng, ngc, ours, ours, ngc, ng] if clip else [ng, ours, ours, ng]) + [
            (f"nanoTACO {v}", lambda v=v: _peer_ours(shape, [*extra, *(f"--{kv}" for kv in v.split("/"))]))
            for v in variants
        ]
        for label, run in order:
            ms, peak = run()
            print(f"{name} {label}: {ms:.2f} ms/step, {peak:.2f} GiB", flush=True)
            rows.append(
                {
                    "shape": name,
                    "code": label,
                    "ms/step": round(ms, 2),
                    "tok/s": round(B * T / ms * 1e3),
                    "MFU %": round(flops / (ms / 1e3) / peak_flops * 100, 1),
                    "peak GiB": round(peak, 2),
                }
            )
        mean = lambda c, n=name: sum(r["ms/step"] for r in rows if r["shape"] == n and r["code"] == c) / 2
        for r in rows:
            if r["shape"] == name:
                r["vs nanoGPT"] = f"{mean('nanoGPT') / r['ms/step']:.3f}x"
                r["vs nanoGPT + clip"] = f"{mean('nanoGPT + clip') / r['ms/step']:.3f}x" if clip else "-"
    save(
        tag,
        rows,
        shapes={n: PEER_SHAPES[n] for n in shapes},
        peak_flops=peak_flops,
        extra=list(extra),
        note="one invocation, one GPU: nanoGPT's bench_peer.py (its bench.py, the shape as settings; random tokens, "
        "no clipping, loss.item() every step; + clip: with its train.py's clip_grad_norm_ at 1.0 before each "
        "step) and train.py at TP=1 (real batches, clipping at 1.0, logging); each timed twice, the order "
        "mirrored; vs X = the mean of X's two runs over this run's ms/step",
    )
    table(rows, ["shape", "code", "ms/step", "vs nanoGPT", "vs nanoGPT + clip", "tok/s", "MFU %", "peak GiB"])


def split_at_dashes(argv):
    """(our arguments, the train.py overrides after a lone --)."""
    return (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])


def main(argv):
    argv, train_args = split_at_dashes(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="GPU: the fused kernels vs copy bandwidth and the PyTorch reference")
    k.add_argument("--tag", default="kernels", help="results/<tag>.json")
    k.add_argument("--sizes", default="1,4,16,64,256", help="millions of elements")
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    k.add_argument("--codecs", default="hint8,taco,hint6")
    o = sub.add_parser("overlap", help="GPU: one all-reduce's codec kernels beside a weight-gradient matmul")
    o.add_argument("--codecs", default="hint8,hint6,taco")
    o.add_argument("--shapes", default=",".join(OVERLAP_SHAPES), help="of " + ", ".join(OVERLAP_SHAPES))
    h = sub.add_parser("host", help="GPU: host microseconds of one eager compressed all-reduce call (1-rank group)")
    h.add_argument("--tag", default="host", help="results/<tag>.json")
    c = sub.add_parser("collective", help="GPUs, under torchrun: taco.all_reduce vs NCCL and torch symm-mem")
    c.add_argument("tag", nargs="?", default="nvlink", help="results/collective_<tag>.json")
    e = sub.add_parser("e2e", help="train a config once per entry in one invocation; step time side by side")
    e.add_argument("config")
    e.add_argument(
        "entries", help="comma-separated TP codecs or KEY=VALUE[/KEY=VALUE] settings; the first is the baseline"
    )
    e.add_argument("--nproc", type=int, default=2)
    e.add_argument("--tag", default="e2e", help="results/e2e_<tag>.json; after a lone --: train.py overrides")
    f = sub.add_parser("hf", help="GPU: our model vs transformers' of the same family and shape, TP=1, compiled")
    f.add_argument("config")
    f.add_argument("--steps", type=int, default=20)
    f.add_argument("--batch", type=int, default=0, help="sequences per step (0: the config's batch_size)")
    f.add_argument("--tag", default="hf", help="results/hf_<tag>.json")
    pe = sub.add_parser("peer", help="GPU: train.py at TP=1 vs nanoGPT's bench loop, same shapes, one invocation")
    pe.add_argument("--nanogpt", required=True, help="a nanoGPT folder holding bench_peer.py, or the folder above it")
    pe.add_argument("--shapes", default=",".join(PEER_SHAPES), help="of " + ", ".join(PEER_SHAPES))
    pe.add_argument("--variants", default="", help="train.py settings to time once more each, e.g. grad_clip=0.0")
    pe.add_argument("--tag", default="peer", help="results/<tag>.json; after a lone --: train.py overrides")
    pe.add_argument("--clip", action="store_true", help="also nanoGPT with its train.py's clipping (as ours clips)")
    a = ap.parse_args(argv)
    if a.what == "peer":
        if not torch.cuda.is_available():
            raise SystemExit("bench.py peer needs a CUDA GPU (both codebases time a GPU step)")
        bench_peer(
            a.nanogpt,
            tuple(a.shapes.split(",")),
            tuple(v for v in a.variants.split(",") if v),
            train_args,
            tag=a.tag,
            clip=a.clip,
        )
    elif a.what == "kernels":
        bench_kernels(
            tag=a.tag,
            sizes_m=tuple(int(m) for m in a.sizes.split(",")),
            dtype=a.dtype,
            codecs=tuple(a.codecs.split(",")),
        )
    elif a.what == "overlap":
        if not torch.cuda.is_available():
            raise SystemExit("bench.py overlap needs a CUDA GPU")
        bench_overlap(tuple(a.codecs.split(",")), tuple(a.shapes.split(",")))
    elif a.what == "host":
        if not torch.cuda.is_available():
            raise SystemExit("bench.py host needs a CUDA GPU")
        bench_host(tag=a.tag)
    elif a.what == "collective":
        bench_collective(tag=a.tag)
    elif a.what == "hf":
        if not torch.cuda.is_available():
            raise SystemExit("bench.py hf needs a CUDA GPU (and transformers)")
        bench_hf(a.config, a.steps, batch=a.batch, tag=a.tag)
    else:
        bench_e2e(a.config, a.entries.split(","), a.nproc, train_args, a.tag)


if __name__ == "__main__":
    main(sys.argv[1:])
