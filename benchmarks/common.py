"""What every benchmark shares: the results files (with date, machine, versions, the command), the
printed table, CUDA and host timing, and a kernel timeline read by kind."""

import gzip
import importlib.metadata
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
RESULTS = os.environ.get("NANOTACO_RESULTS", os.path.join(ROOT, "results"))


def peer_versions(loaded_only=False):
    """{distribution: version} of the peers bench.py times against that are installed here (loaded_only: of
    those this process imported)."""
    out = {}
    for pkg in ("transformers", "liger-kernel"):
        if loaded_only and pkg.replace("-", "_") not in sys.modules:
            continue
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


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
    env.update({pkg.replace("-", "_"): v for pkg, v in peer_versions(loaded_only=True).items()})
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


def split_at_dashes(argv):
    """(our arguments, the train.py overrides after a lone --)."""
    return (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
