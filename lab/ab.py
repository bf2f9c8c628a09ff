"""
A change to the book's model, before against after, on one GPU in one process: a model.py of before
(e.g. `git show REV:model.py > /tmp/before.py`) is loaded beside the working tree's, and both are timed
in the loop of `bench.py hf` (fp32 weights under bf16 autocast, compiled, fused AdamW, clipping) in the
order before, after, after, before, before, after, so that drift shows; then the LM head with its loss
alone, compiled, forward and backward, on the step's tokens, each version twice.

    git show HEAD~1:model.py > /tmp/before.py
    python -m lab.ab /tmp/before.py configs/qwen2_5_0_5b.py [--steps 10] [-- --key=value]      # GPU

Peak GiB: a block's peak less the other model's resident memory (weights, AdamW state).
results/ab_<tag>.json, with `variant_diff`: the unified diff of the two model.py files (before -> after).
"""

import argparse
import difflib
import importlib.util
import os
import sys

import torch

import config as settings
import model as after
import parallel
from benchmarks.common import cuda_time, save, split_at_dashes, table
from benchmarks.models import _batch, _timed, _trainer


def load(path):
    spec = importlib.util.spec_from_file_location("model_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # torch.compile looks the module's globals up by its name
    spec.loader.exec_module(mod)
    return mod


def model_diff(before_path):
    """The unified diff from a model.py of before to the working tree's, as the result file records it."""
    with open(before_path) as f, open(after.__file__) as g:
        lines = difflib.unified_diff(f.readlines(), g.readlines(), "before/model.py", "after/model.py")
    return "".join(lines)


def loss_alone(versions, mc, N):
    """ms, peak GiB above the inputs, the loss: the head and loss of each version, forward and backward."""
    dev, g = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    h = torch.randn(N, mc.n_embd, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(mc.padded_vocab, mc.n_embd, device=dev, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, mc.vocab_size, (N,), device=dev, generator=g)
    rows = []
    for name in ("before", "after", "after", "before"):
        # its loss: fused_linear_cross_entropy, or in an older model.py the Function FusedLinearCrossEntropy
        mod = versions[name]
        fused = getattr(mod, "fused_linear_cross_entropy", None) or mod.FusedLinearCrossEntropy.apply
        fn = torch.compile(lambda h, w, f=fused: f(h, w, t, parallel.TPComm(), mc.vocab_size, mc.loss_chunk, True))

        def run():
            h.grad = w.grad = None
            loss = fn(h, w)
            loss.backward()
            return loss

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = cuda_time(run, iters=10, warmup=3) / 1e3
        rows.append({"what": "head and loss alone", "model": name, "ms": round(ms, 2),
                     "peak GiB": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
                     "loss": round(run().item(), 5)})  # fmt: skip
    return rows


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="a model.py of before")
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--tag", default="")
    ours, extra = split_at_dashes(argv)
    a = ap.parse_args(ours)
    a.extra = extra
    cfg = settings.parse([a.config, *a.extra])
    mc, dev = cfg.model_config(), torch.device("cuda")
    B, T = cfg.batch_size, cfg.block_size
    versions = {"before": load(a.before), "after": after}
    x, y = _batch(mc, B, T, dev)
    steps, resident = {}, {}
    for name, mod in versions.items():
        step = _trainer(mod.GPT(mc, seed=0).to(dev), lambda m: m(x, y)[1])
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        steps[name], resident[name] = step, torch.cuda.memory_allocated() - sum(resident.values())
    rows = []
    for name in ("before", "after", "after", "before", "before", "after"):
        other = sum(r for n, r in resident.items() if n != name)
        torch.cuda.reset_peak_memory_stats()
        ms, loss, peak = _timed(steps[name], a.steps)
        rows.append({"what": "step", "model": name, "ms": round(ms, 2), "peak GiB": round(peak - other / 2**30, 2),
                     "loss": round(loss, 4)})  # fmt: skip
    del steps
    torch.cuda.empty_cache()
    rows += loss_alone(versions, mc, B * T)
    for what in ("step", "head and loss alone"):
        ms = {n: [r["ms"] for r in rows if r["what"] == what and r["model"] == n] for n in versions}
        print(f"{what}: " + ", ".join(f"{n} {sum(v) / len(v):.2f} ms" for n, v in ms.items()))
    save(
        f"ab_{a.tag or os.path.splitext(os.path.basename(a.config))[0]}",
        rows,
        config=a.config,
        extra=a.extra,
        batch=B,
        seq=T,
        steps=a.steps,
        variant_diff=model_diff(a.before),
        note="before: a model.py loaded beside the working tree's; step: bench.py hf's loop, peak less the other "
        "model's resident memory; head and loss alone: compiled, forward and backward, median of 10 (CUDA events)",
    )
    table(rows, ["what", "model", "ms", "peak GiB", "loss"])


if __name__ == "__main__":
    main(sys.argv[1:])
