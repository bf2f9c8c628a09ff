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
    python bench.py fit configs/qwen2_5_0_5b.py 80 ours:34 transformers:18   # GPU: the largest batch in 80 GiB
"""

import argparse
import sys

import taco_ext
from benchmarks.comm import bench_collective, bench_e2e
from benchmarks.common import split_at_dashes
from benchmarks.kernels import OVERLAP_SHAPES, bench_host, bench_kernels, bench_overlap
from benchmarks.models import PEER_SHAPES, bench_fit, bench_hf, bench_peer


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
    f.add_argument("--no_liger", action="store_true", help="leave out the transformers + Liger rows")
    f.add_argument("--variants", default="", help="comma-separated rows of ours more, each k=v[/k=v] settings")
    f.add_argument("--fit", type=float, default=0.0, help="GiB: the largest batch under it, from the peaks at 1/2x, 1x")
    fi = sub.add_parser("fit", help="GPU: the largest batch each trainer trains in N GiB, a run at each batch")
    fi.add_argument("config")
    fi.add_argument("gib", type=float, help="GiB to fit in (the allocator capped there), e.g. 80: an H100")
    fi.add_argument("starts", nargs="+", help="trainer:estimate, trainer one of ours, transformers, liger")
    fi.add_argument("--tag", default="fit", help="results/fit_<tag>.json; after a lone --: ours' train.py settings")
    pe = sub.add_parser("peer", help="GPU: train.py at TP=1 vs nanoGPT's bench loop, same shapes, one invocation")
    pe.add_argument("--nanogpt", required=True, help="a nanoGPT folder holding bench_peer.py, or the folder above it")
    pe.add_argument("--shapes", default=",".join(PEER_SHAPES), help="of " + ", ".join(PEER_SHAPES))
    pe.add_argument("--variants", default="", help="train.py settings to time once more each, e.g. grad_clip=0.0")
    pe.add_argument("--tag", default="peer", help="results/<tag>.json; after a lone --: train.py overrides")
    pe.add_argument("--clip", action="store_true", help="also nanoGPT with its train.py's clipping (as ours clips)")
    a = ap.parse_args(argv)
    if a.what in ("peer", "kernels", "overlap", "host", "collective", "hf", "fit"):
        taco_ext.require_gpu(f"bench.py {a.what}", build=a.what in ("kernels", "overlap", "host", "collective"))
    if a.what == "peer":
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
        bench_overlap(tuple(a.codecs.split(",")), tuple(a.shapes.split(",")))
    elif a.what == "host":
        bench_host(tag=a.tag)
    elif a.what == "collective":
        bench_collective(tag=a.tag)
    elif a.what == "hf":
        bench_hf(
            a.config,
            a.steps,
            batch=a.batch,
            tag=a.tag,
            liger=not a.no_liger,
            fit=a.fit,
            extra=train_args,
            variants=tuple(v for v in a.variants.split(",") if v),
        )
    elif a.what == "fit":
        bench_fit(a.config, a.gib, a.starts, a.tag, train_args)
    else:
        bench_e2e(a.config, a.entries.split(","), a.nproc, train_args, a.tag)


if __name__ == "__main__":
    main(sys.argv[1:])
