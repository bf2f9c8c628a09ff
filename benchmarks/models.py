"""One GPU, TP=1: our model against transformers' of the same family and shape (hf), and train.py
against nanoGPT's bench loop (peer)."""

import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.common import ROOT, peer_versions, save, table

# -----------------------------------------------------------------------------
# one GPU, TP=1: our model against transformers' model of the same family and shape


def _hf_model(mc, dev):
    """transformers' model of our config's family and shape (its class from hf.py's layout), SDPA."""
    import transformers

    import hf

    cfg = hf.config_json(mc)
    conf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    return transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa").to(dev)


def _trainer(model, loss_of, compile=True, opt=None):
    """One training step of the loop every row shares: bf16 autocast over fp32 weights, (compiled)
    forward and backward, clipping at 1.0, fused AdamW (opt: an AdamW already made for the model)."""
    run = torch.compile(model) if compile else model
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(run)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step.opt = opt
    return step


def _loss_of(ours, x, y):
    """The loop's loss: ours, the next-token loss on T positions (y: x shifted); transformers shifts x itself: T - 1."""
    return (lambda m: m(x, y)[1]) if ours else (lambda m: m(input_ids=x, labels=x).loss)


def _batch(mc, B, T, dev):
    x = torch.randint(0, mc.vocab_size, (B, T + 1), device=dev, generator=torch.Generator(dev).manual_seed(0))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _timed(step, steps):
    """(ms per step, the loss, the peak GiB since the last reset) of `steps` steps."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3, loss.item(), torch.cuda.max_memory_allocated() / 2**30


def _resident(model, opt):
    """Bytes a trainer holds between steps: its weights, buffers and optimizer state (the gradients are
    set to None)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())


def _as_alone(peak, start, resident):
    """A block's peak (GiB) as if its model were alone on the GPU: less what the others held when it
    began (bytes allocated at the start less the model's own resident bytes)."""
    return round(peak - (start - resident) / 2**30, 2)


def _peak_at(step, warmup):
    """The peak GiB of a few steps of a trainer (compiled for this shape on its first step)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def liger_rows(config, batch, steps, warmup, compile, fit):
    """transformers with Liger Kernel's patches (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE) of our
    config's family, in this process alone (the patch replaces transformers' classes for the process):
    its row, or why there is none. fit (GiB): also its peak at half the batch."""
    import config as settings

    cfg = settings.parse([config] + ([f"--batch_size={batch}"] if batch else []))
    mc, dev, label = (
        cfg.model_config(),
        torch.device("cuda"),
        "transformers + Liger" + (" (compiled)" if compile else ""),
    )
    try:
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{hf_family(mc)}")()
        versions = peer_versions()
    except (ImportError, AttributeError) as e:
        return [{"model": label, "note": f"not run: {type(e).__name__}: {e}"}]
    try:
        model = _hf_model(mc, dev)
        B, T = cfg.batch_size, cfg.block_size
        x, _ = _batch(mc, B, T, dev)
        step = _trainer(model, _loss_of(False, x, x), compile)
        for _ in range(warmup):
            step()
        rows = []
        for _ in range(2):
            torch.cuda.reset_peak_memory_stats()
            ms, loss, peak = _timed(step, steps)
            rows.append({"model": label, "ms/step": round(ms, 2), "tok/s": round(B * T / ms * 1e3),
                         "peak GiB": round(peak, 2), "loss": round(loss, 4), "versions": versions})  # fmt: skip
        if fit:
            x2, _ = _batch(mc, B // 2, T, dev)
            step2 = _trainer(model, _loss_of(False, x2, x2), compile, step.opt)
            rows[0]["peak GiB at half the batch"] = round(_peak_at(step2, 2), 2)
        return rows
    except Exception as e:  # a crash is a result too: say what failed
        return [{"model": label, "note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}]


def hf_family(mc):
    """Liger's name of the family: the Hugging Face model_type (hf.py)."""
    import hf

    return hf.MODEL_TYPE[mc.family]


# the Hugging Face model types Liger Kernel patches (its apply_liger_kernel_to_<model type>); GPT-2 is not one
LIGER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _liger_in_a_process(config, batch, steps, warmup, compile, fit):
    cmd = [sys.executable, "-m", "benchmarks.models", "liger", config, str(batch), str(steps), str(warmup),
           str(int(compile)), str(fit)]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    rows = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
    return rows or [{"model": "transformers + Liger", "note": f"process failed (rc {p.returncode}): {tail[0][:200]}"}]


def bench_hf(config, steps=20, warmup=5, batch=0, tag="hf", liger=True, fit=0.0, extra=(), variants=()):
    """Our model, built from `config`'s settings at TP=1, against transformers' model of the same family
    and shape, on one GPU in one invocation, with the same loop: fp32 weights under bf16 autocast,
    torch.compile, fused AdamW, gradient clipping at 1.0, the same random batch. All stay resident;
    each is timed twice in the order ours, theirs, theirs, ours, so the noise shows. Peak memory is a
    block's peak above what was allocated before it, plus the model's own weights, buffers and
    optimizer state: its peak as if alone. variants ("k=v/k=v": our settings): more rows of ours,
    resident beside the others, timed in the same mirrored order (ours, each variant, theirs, theirs,
    each variant backwards, ours). Then transformers with Liger Kernel's patches, eager and compiled,
    each in a process of its own (timed twice there), where liger-kernel is importable. fit (GiB, e.g.
    80: an H100): every trainer's peak also at half the batch, and the largest batch whose peak the two
    points put under fit GiB (a straight line: an estimate, not a run at that batch)."""
    import config as settings
    from model import GPT

    cfg = settings.parse([config, *extra] + ([f"--batch_size={batch}"] if batch else []))  # extra: ours only
    mc, dev = cfg.model_config(), torch.device("cuda")
    B, T = cfg.batch_size, cfg.block_size
    x, y = _batch(mc, B, T, dev)
    ours = {"ours": mc} | {
        f"ours {v}": settings.parse([config, *extra, *(f"--{kv}" for kv in v.split("/"))]).model_config()
        for v in variants
    }
    models = {n: GPT(c, seed=0).to(dev) for n, c in ours.items()} | {"transformers": _hf_model(mc, dev)}
    runs = {}
    for name, model in models.items():
        step = _trainer(model, _loss_of(name != "transformers", x, y))
        for _ in range(warmup):  # compiles, and fills AdamW's state
            step()
        torch.cuda.synchronize()
        runs[name] = {
            "step": step,
            "resident": _resident(model, step.opt),
            "params": sum(p.numel() for p in model.parameters()),
        }
    flops = (6 * mc.num_params() + 12 * mc.n_layer * mc.n_embd * T) * B * T
    rows = []
    for name in [*ours, "transformers", "transformers", *reversed(ours)]:
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        ms, loss, peak = _timed(runs[name]["step"], steps)
        rows.append(
            {
                "model": name,
                "ms/step": round(ms, 2),
                "tok/s": round(B * T / ms * 1e3),
                "MFU %": round(flops / (ms / 1e3) / cfg.peak_flops * 100, 1),
                "peak GiB": _as_alone(peak, start, runs[name]["resident"]),
                "params": runs[name]["params"],
                "loss": round(loss, 4),
            }
        )
    if fit:  # the same trainers at half the batch (compiled again for the shape; twice it may not fit beside others)
        x2, y2 = _batch(mc, B // 2, T, dev)
        for name, model in models.items():
            row = next(r for r in rows if r["model"] == name)
            try:
                start = torch.cuda.memory_allocated()
                peak2 = _peak_at(
                    _trainer(model, _loss_of(name != "transformers", x2, y2), opt=runs[name]["step"].opt), 2
                )
                row["peak GiB at half the batch"] = _as_alone(peak2, start, runs[name]["resident"])
            except torch.OutOfMemoryError:  # no line
                row["note"] = "out of memory at half the batch"
                torch.cuda.empty_cache()
    del models, runs
    torch.cuda.empty_cache()
    if liger and hf_family(mc) in LIGER_MODEL_TYPES:
        for compile in (False, True):
            rows += _liger_in_a_process(config, B, steps, warmup, compile, fit)
    mean = lambda n: sum(r["ms/step"] for r in rows if r["model"] == n) / 2
    for r in rows:
        if "ms/step" in r:
            r["vs transformers"] = f"{mean('transformers') / r['ms/step']:.3f}x"
            r.setdefault("MFU %", round(flops / (r["ms/step"] / 1e3) / cfg.peak_flops * 100, 1))
        if fit and "peak GiB at half the batch" in r:  # peak = fixed + per sequence * batch
            per = (r["peak GiB"] - r["peak GiB at half the batch"]) / (B - B // 2)
            r[f"batch in {fit:g} GiB"] = int((fit - (r["peak GiB"] - per * B)) // per) if per > 0 else "-"
    save(
        f"hf_{tag}",
        rows,
        config=config,
        extra=list(extra),
        variants=list(variants),
        batch=B,
        seq=T,
        steps=steps,
        warmup=warmup,
        loss_chunk=mc.loss_chunk,
        note="the same loop for every row (bf16 autocast over fp32 weights, fused AdamW, clipping; compiled "
        "unless said); ours and transformers in this process, timed ours, theirs, theirs, ours; each Liger row "
        "in a process of its own, timed twice there; MFU from our model's 6N + attention FLOPs per token "
        "against peak_flops; peak GiB: the block's peak above what was allocated before it, plus the model's "
        "own weights, buffers and AdamW state (as if alone on the GPU); vs "
        "transformers: the mean of transformers' two blocks over this block's ms; batch in N GiB: the "
        "straight line through the peaks at half the batch and at the batch (an estimate)",
    )
    cols = ["model", "ms/step", "vs transformers", "tok/s", "MFU %", "peak GiB", "loss"]
    table(rows, cols + ([f"batch in {fit:g} GiB"] if fit else []) + ["note"])


def trains_within(config, trainer, batch, gib, extra=()):
    """Whether `trainer` (ours, transformers, liger: transformers with Liger's patches, eager) trains at `batch`
    sequences in gib GiB of this GPU (the allocator capped there): two steps of the bench_hf loop, in this
    process alone. (True, peak GiB) or (False, None) on running out of memory."""
    import config as settings
    from model import GPT

    dev = torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, gib * 2**30 / torch.cuda.get_device_properties(dev).total_memory)
    )
    cfg = settings.parse([config, *(extra if trainer == "ours" else ()), f"--batch_size={batch}"])
    mc = cfg.model_config()
    if trainer == "liger":
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{hf_family(mc)}")()
    x, y = _batch(mc, batch, cfg.block_size, dev)
    model = GPT(mc, seed=0).to(dev) if trainer == "ours" else _hf_model(mc, dev)
    try:
        return True, round(_peak_at(_trainer(model, _loss_of(trainer == "ours", x, y), trainer != "liger"), 1), 2)
    except torch.OutOfMemoryError:
        return False, None


def largest_batch(runs, start, probes=4):
    """The largest batch b for which runs(b) holds, searched one batch at a time from start (an estimate): up
    while it runs, down while it does not, at most `probes` calls. (the largest that ran, the smallest that did
    not); either is None where the probes ran out before finding it."""
    ran, failed, b = None, None, start
    for _ in range(probes):
        if b < 1:
            break
        if runs(b):
            ran = b
            if failed is not None:
                break
            b += 1
        else:
            failed = b
            if ran is not None:
                break
            b -= 1
    return ran, failed


def bench_fit(config, gib, starts, tag="fit", extra=()):
    """For each trainer:estimate in starts, the largest batch that trains in gib GiB (largest_batch over
    trains_within, each probe a process of its own): a run at each batch, not a line through two peaks."""
    rows, peaks = [], {}

    def trains(trainer, batch):
        cmd = [sys.executable, "-m", "benchmarks.models", "trains_within", config, trainer, str(batch), str(gib),
               *extra]  # fmt: skip
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        out = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
        if not out:  # neither ran nor ran out of memory: say why, and stop
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"{trainer} at batch {batch}: rc {p.returncode}: {tail[0][:300]}")
        print(f"{trainer} at batch {batch}: " + (f"ran, peak {out[0][1]} GiB" if out[0][0] else "out of memory"))
        peaks[(trainer, batch)] = out[0][1]
        return out[0][0]

    for trainer, start in (s.split(":") for s in starts):
        ran, failed = largest_batch(lambda b: trains(trainer, b), int(start))
        rows.append({"model": trainer, "estimate": int(start), "largest batch that ran": ran,
                     "peak GiB there": peaks.get((trainer, ran)), "smallest that did not": failed})  # fmt: skip
    # the peers' versions: those installed here, which the probes' processes load (this one does not)
    save(f"fit_{tag}", rows, config=config, gib=gib, extra=list(extra), versions=peer_versions(),
         note="each trainer alone in a process per batch, the allocator capped at gib GiB (the whole card where "
         "it has less), two steps of bench_hf's loop (compiled; Liger eager); searched one batch at a time from "
         "the estimate")  # fmt: skip
    table(rows, ["model", "estimate", "largest batch that ran", "peak GiB there", "smallest that did not"])


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


if __name__ == "__main__" and sys.argv[1:2] == ["liger"]:  # bench_hf's Liger rows, each in a process of its own
    config, batch, steps, warmup, compile, fit = sys.argv[2:8]
    for row in liger_rows(config, int(batch), int(steps), int(warmup), bool(int(compile)), float(fit)):
        print("ROW " + json.dumps(row), flush=True)
elif __name__ == "__main__" and sys.argv[1:2] == ["trains_within"]:  # bench_fit's probes, each a process of its own
    config, trainer, batch, gib = sys.argv[2:6]
    print("ROW " + json.dumps(trains_within(config, trainer, int(batch), float(gib), sys.argv[6:])), flush=True)
