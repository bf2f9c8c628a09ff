"""
Where one GPU's training step goes, our model against transformers' of the same shape, in the loop of
`bench.py hf` (fp32 weights under bf16 autocast, compiled, fused AdamW, clipping), and what the LM
head with its loss costs on its own:

    python -m lab.step_profile configs/qwen2_5_0_5b.py [--steps 4] [-- --recompute=mlp]   # GPU

1. Both steps under torch.profiler, their kernels summed per step by kind (matmuls, attention, the
   optimizer, Triton's fused rest, ...) and by name: what one side spends that the other does not.
2. The head and loss alone, compiled, forward and backward, on the step's tokens: the three matmuls
   of the head by themselves (logits, grad of the hidden states, grad of the weight: its floor), the
   book's fused loss at several chunk sizes, and the unfused loss (whole logits, fp32 cross-entropy).
   Their share of the step, and the chunks' overhead over the matmuls.

results/step_profile_<tag>.json.
"""

import argparse
import dataclasses
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

import config as settings
from benchmarks.common import cuda_time, save, table, trace_kernels
from benchmarks.models import _batch, _hf_model, _loss_of, _trainer
from lab.analysis import _length, _merge
from lab.peer_profile import kind, short


def profiled(step, steps, path):
    """(ms per step by kind, by name, GPU-busy ms per step) of `steps` steps under torch.profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    kinds, names = {}, {}
    ks = trace_kernels(path)
    for a, b, name in ks:
        kinds[kind(name)] = kinds.get(kind(name), 0.0) + (b - a) / 1e3 / steps
        names[short(name)] = names.get(short(name), 0.0) + (b - a) / 1e3 / steps
    return kinds, names, _length(_merge([(a, b) for a, b, _ in ks])) / 1e3 / steps


def head_rows(mc, N, chunks, step_ms):
    """The LM head and its loss alone on N tokens: forward and backward, compiled (ms, share of the step)."""
    import parallel
    from loss import fused_linear_cross_entropy

    dev, V, C = torch.device("cuda"), mc.padded_vocab, mc.n_embd
    g = torch.Generator(dev).manual_seed(0)
    h = torch.randn(N, C, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(V, C, device=dev, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, mc.vocab_size, (N,), device=dev, generator=g)
    wb = w.detach().to(torch.bfloat16)
    dz = torch.randn(N, V, device=dev, generator=g, dtype=torch.bfloat16)

    def matmuls():  # the head's floor: z = h W^T, grad_h = dz W, grad_W = dz^T h
        return h.detach() @ wb.t(), dz @ wb, dz.t() @ h.detach()

    def fused(chunk):
        fn = torch.compile(
            lambda h, w: fused_linear_cross_entropy(h, w, t, parallel.TPComm(), mc.vocab_size, chunk, True)
        )
        return lambda: fn(h, w).backward()

    unfused_fn = torch.compile(lambda h, w: F.cross_entropy((h @ w.to(h.dtype).t())[:, : mc.vocab_size].float(), t))
    rows = [("head matmuls alone (3 GEMMs, bf16)", matmuls)]
    rows += [(f"fused loss, loss_chunk={c or N}", fused(c)) for c in chunks]
    rows += [("unfused: whole logits, fp32 cross-entropy", lambda: unfused_fn(h, w).backward())]
    out = []
    for what, fn in rows:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            ms = cuda_time(fn, iters=10, warmup=3) / 1e3
        except torch.OutOfMemoryError:
            out.append({"what": what, "note": "out of memory"})
            continue
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        h.grad = w.grad = None
        out.append({"what": what, "ms": round(ms, 2), "share of our step": f"{ms / step_ms:.1%}",
                    "peak GiB above inputs": round(peak, 2)})  # fmt: skip
    floor = out[0]["ms"]
    for r in out[1:]:
        if "ms" in r:
            r["over the matmuls ms"] = round(r["ms"] - floor, 2)
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=4, help="profiled steps of each trainer")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--chunks", default="2048,4096,8192,0", help="loss_chunk values of the head rows (0: all tokens)")
    ap.add_argument("--top", type=int, default=15, help="kernel names with the largest difference to list")
    ap.add_argument("--tag", default="")
    ap.add_argument("extra", nargs="*", help="--key=value settings of ours after --")
    a = ap.parse_args(argv)
    from model import GPT

    cfg = settings.parse([a.config, *a.extra])
    mc, dev = cfg.model_config(), torch.device("cuda")
    B, T = cfg.batch_size, cfg.block_size
    x, y = _batch(mc, B, T, dev)
    trainers = {
        "ours": (GPT(mc, seed=0), _loss_of(True, x, y)),
        "transformers": (_hf_model(mc, dev), _loss_of(False, x, y)),
    }
    seen = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, loss_of) in trainers.items():
            step = _trainer(model.to(dev), loss_of)
            for _ in range(a.warmup):
                step()
            seen[name] = profiled(step, a.steps, os.path.join(tmp, f"{name}.json"))
            del step
            model.cpu()
            torch.cuda.empty_cache()
    (ok, on, ob), (tk, tn, tb) = seen["ours"], seen["transformers"]
    row = lambda what, o, t: {"what": what, "ours ms": round(o, 2), "transformers ms": round(t, 2),
                              "ours - transformers": round(o - t, 2)}  # fmt: skip
    rows = [row("GPU busy per step (overlap counted once)", ob, tb)]
    rows += [row(f"kind: {k}", ok.get(k, 0.0), tk.get(k, 0.0)) for k in sorted(set(ok) | set(tk))]
    names = sorted(set(on) | set(tn), key=lambda n: -abs(on.get(n, 0) - tn.get(n, 0)))
    rows += [row(n, on.get(n, 0.0), tn.get(n, 0.0)) for n in names[: a.top]]
    table(rows, list(rows[0]))
    del trainers
    torch.cuda.empty_cache()
    head = head_rows(mc, B * T, [int(c) for c in a.chunks.split(",")], ob)
    table(head, ["what", "ms", "share of our step", "over the matmuls ms", "peak GiB above inputs", "note"])
    save(
        f"step_profile_{a.tag or os.path.splitext(os.path.basename(a.config))[0]}",
        rows,
        head=head,
        config=a.config,
        extra=a.extra,
        batch=B,
        seq=T,
        steps=a.steps,
        loss_chunk=mc.loss_chunk,
        model=dataclasses.asdict(mc),
        note="kernels per profiled step of the bench.py hf loop (ours: the book's GPT at TP=1; transformers: "
        "its model of the same shape, SDPA); kinds as lab.peer_profile; head rows: forward and backward of the "
        "LM head and loss alone on the step's tokens, compiled, median of 10 (CUDA events), share: of our "
        "step's GPU-busy ms",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
