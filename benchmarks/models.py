"""One GPU, TP=1: our model against transformers' of the same family and shape (hf), and train.py
against nanoGPT's bench loop (peer)."""

import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.common import ROOT, save, table

# -----------------------------------------------------------------------------
# one GPU, TP=1: our model against transformers' model of the same family and shape


def _hf_model(mc, dev):
    """transformers' model of our config's family and shape (Qwen2ForCausalLM / GPT2LMHeadModel), SDPA."""
    import transformers

    import hf

    cfg = hf.config_json(mc)
    conf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    return transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa").to(dev)


def bench_hf(config, steps=20, warmup=5, batch=0, tag="hf"):
    """Our model, built from `config`'s settings at TP=1, against transformers' model of the same family
    and shape, on one GPU in one invocation, with the same loop: fp32 weights under bf16 autocast,
    torch.compile, fused AdamW, gradient clipping at 1.0, the same random batch. Both stay resident;
    each is timed twice in the order ours, theirs, theirs, ours, so the noise shows. Peak memory is a
    block's peak less the other model's resident weights and optimizer state."""
    import config as settings
    from model import GPT

    cfg = settings.parse([config] + ([f"--batch_size={batch}"] if batch else []))
    mc, dev = cfg.model_config(), torch.device("cuda")
    B, T = cfg.batch_size, cfg.block_size
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
                "MFU %": round(flops / (ms / 1e3) / cfg.peak_flops * 100, 1),
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
        "--qkv_bias=False",
        "--linear_bias=False",
        "--norm_bias=False",
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
        no_bias = dict(qkv_bias=False, linear_bias=False, norm_bias=False)
        mc = GPTConfig(**{k: v for k, v in shape.items() if k != "batch_size"}, **no_bias)
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
