"""The codec kernels on one GPU: against the copy bandwidth (kernels), beside a weight-gradient matmul
(overlap), and the host time of one eager compressed all-reduce (host)."""

import contextlib
import os

import torch
import torch.distributed as dist

import taco
import taco_ext
from benchmarks.common import cuda_time, device_time, host_time, save, table

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
    symmetric memory (taco_symm.Workspace.all_reduce: one binding call that queues encode, barrier,
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
        ws.all_reduce(x, cd, None, False)  # the plan and the buffer
        plan, ext = ws.plans[(x.numel(), cd)], taco_ext.load()
        for label, fn in (
            ("hint8 symm all-reduce, eager", lambda: ws.all_reduce(x, cd, None, False)),
            ("  its binding call alone (a graph)", lambda: ext.two_shot(x, plan)),
            ("  the binding call, five launches", lambda: ext.two_shot(x, plan, replay=False)),
            ("  onto its stream and back, nothing run", lambda: taco_symm.on_side(ws.side, True, lambda: None)),
            ("  one barrier launch", lambda: taco_symm.barrier(ws.pads, 0, 0)),
            ("hint8 symm all-reduce, async + wait", lambda: ws.all_reduce(x, cd, None, True).wait()),
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
