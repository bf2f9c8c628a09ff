"""
Where one GPU's step goes, train.py at TP=1 against nanoGPT's bench loop on the same shape: both
run under torch.profiler (nanoGPT: its own bench_peer.py --profile=True, 5 profiled steps after
10; ours: train.py --profile_steps=5 at the end of 30), and their kernels are summed per step by
kind (matmuls, attention, the optimizer, the loss, the norms, Triton's fused rest, copies) and by
name. What one side spends that the other does not is the first place to look.

    python -m lab.peer_profile --nanogpt=../shared/anchors --shape=gpt2-small    # GPU
"""

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile

from benchmarks.common import save, table, trace_kernels
from benchmarks.models import PEER_SHAPES, peer_folder, run_nanogpt, run_ours
from lab.analysis import _length, _merge

STEPS = 5
KINDS = (
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("optimizer", ("adam",)),
    ("layer norm", ("layer_norm", "rms_norm")),
    ("norm, clip (foreach)", ("multi_tensor", "foreach", "lpnorm")),
    ("loss", ("softmax", "nll", "cross_entropy")),
    ("embedding", ("embedding",)),
    ("copy, memset", ("memcpy", "memset")),
    ("triton, fused rest", ("triton",)),
)


def kind(name):
    low = name.lower()
    return next((k for k, words in KINDS if any(w in low for w in words)), "other")


def short(name):
    """A kernel's name without template arguments and Triton's running number, so that both runs' compiles match."""
    return re.sub(r"_\d+$", "", re.sub(r"<.*", "", name))[:80]


def per_step(path):
    """{kind: ms}, {short name: ms}, busy ms, span ms: per profiled step."""
    ks = trace_kernels(path)
    kinds, names = {}, {}
    for a, b, name in ks:
        kinds[kind(name)] = kinds.get(kind(name), 0.0) + (b - a) / 1e3 / STEPS
        names[short(name)] = names.get(short(name), 0.0) + (b - a) / 1e3 / STEPS
    span = max(b for _, b, _ in ks) - min(a for a, _, _ in ks)
    return kinds, names, _length(_merge([(a, b) for a, b, _ in ks])) / 1e3 / STEPS, span / 1e3 / STEPS


def profile_nanogpt(folder, shape, tmp):
    work = os.path.join(tmp, "nanogpt")  # its three files only: the profile lands in work/bench_log
    os.makedirs(work)
    for f in ("bench_peer.py", "model.py", "configurator.py"):
        shutil.copy(os.path.join(folder, f), work)
    out = run_nanogpt(work, shape, clip=True, extra=["--profile=True"])
    traces = glob.glob(os.path.join(work, "bench_log", "*.json*"))
    if not traces:
        raise SystemExit(f"nanoGPT's profile run wrote no trace:\n{out[-2000:]}")
    return traces[0]


def profile_ours(shape, tmp):
    out = os.path.join(tmp, "ours")
    run_ours(shape, out, [f"--profile_steps={STEPS}"])
    return os.path.join(out, "trace_rank0.json.gz")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", required=True, help="a nanoGPT folder holding bench_peer.py, or the folder above it")
    ap.add_argument("--shape", default="gpt2-small", choices=sorted(PEER_SHAPES))
    ap.add_argument("--top", type=int, default=15, help="kernel names with the largest difference to list")
    ap.add_argument("--tag", default="peer_profile", help="results/<tag>.json")
    a = ap.parse_args(argv)
    folder, shape = peer_folder(a.nanogpt), PEER_SHAPES[a.shape]
    with tempfile.TemporaryDirectory() as tmp:
        theirs, ours = per_step(profile_nanogpt(folder, shape, tmp)), per_step(profile_ours(shape, tmp))
    row = lambda what, t, o: {
        "what": what,
        "nanoGPT + clip ms": round(t, 3),
        "ours ms": round(o, 3),
        "ours - nanoGPT": round(o - t, 3),
    }
    rows = [
        row("GPU busy (kernels, overlap counted once)", theirs[2], ours[2]),
        row("first to last kernel", theirs[3], ours[3]),
    ]
    rows += [
        row(f"kind: {k}", theirs[0].get(k, 0.0), ours[0].get(k, 0.0)) for k in sorted(set(theirs[0]) | set(ours[0]))
    ]
    names = sorted(set(theirs[1]) | set(ours[1]), key=lambda n: -abs(ours[1].get(n, 0) - theirs[1].get(n, 0)))
    rows += [row(n, theirs[1].get(n, 0.0), ours[1].get(n, 0.0)) for n in names[: a.top]]
    save(
        a.tag,
        rows,
        shape={a.shape: shape},
        steps=STEPS,
        note="per profiled step; nanoGPT's bench_peer.py --profile=True with its train.py's clipping, train.py at "
        "TP=1 --profile_steps=5; kernel names without template arguments or Triton's running number",
    )
    table(rows, ["what", "nanoGPT + clip ms", "ours ms", "ours - nanoGPT"])


if __name__ == "__main__":
    main(sys.argv[1:])
