"""
The optimizer step alone, at a config's shape (fp32 parameters, random gradients; one GPU): what clipping
costs each way a step can take it, timed side by side in one process with CUDA events.

    clip + ClipAdamW        train.py on a GPU with compile on: the norm, then one compiled pass per group
    clip + fused AdamW      train.py otherwise: the norm, then fused AdamW with grad_scale (it writes the
                            divided gradients back)
    nanoGPT's clip + fused  torch.nn.utils.clip_grad_norm_ (the norm, then every gradient scaled in place)
    fused AdamW, no clip    the floor: no norm, nothing scaled

    python -m lab.optimizer configs/gpt1b.py [--steps 20] [--tag gpt1b] [-- --tp=1]     # GPU

results/optimizer_<tag>.json: ms per step of each, and against the floor.
"""

import argparse
import sys

import torch

import config as settings
import model as book
import optim
import train
from benchmarks.common import save, split_at_dashes, table


def variants(params, cfg):
    """{name: step()}: each with its own optimizer state over the same parameters and gradients."""
    grid = train.parallel.Grid(tp=1, pp=1, dp=1)
    groups = lambda: optim.param_groups(params, cfg.weight_decay)
    kw = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
    ours = optim.ClipAdamW(groups(), **kw)
    fused = optim.AdamW(groups(), fused=True, **kw)
    theirs = torch.optim.AdamW(groups(), fused=True, **kw)
    floor = torch.optim.AdamW(groups(), fused=True, **kw)

    def clip_ours():
        ours.step(train.clip_grad_norm(params, cfg.grad_clip, grid)[1])

    def clip_fused():
        fused.step(train.clip_grad_norm(params, cfg.grad_clip, grid)[1])

    def clip_nanogpt():
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        theirs.step()

    return {"clip + ClipAdamW": clip_ours, "clip + fused AdamW": clip_fused,
            "nanoGPT's clip + fused AdamW": clip_nanogpt, "fused AdamW, no clip": floor.step}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tag", default="")
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, extra = split_at_dashes(argv)
    a = ap.parse_args(ours)
    cfg = settings.parse([a.config, *extra])
    mc, dev = cfg.model_config(), torch.device("cuda")
    params = list(book.GPT(mc, seed=0).to(dev).parameters())
    grads = [torch.randn_like(p) * 1e-3 for p in params]  # a norm over 1: every variant clips
    steps = variants(params, cfg)
    ms = {name: [] for name in steps}
    for i in range(3 + a.steps):  # 3 warm-up rounds (ClipAdamW compiles in the first); the order rotates
        names = list(steps)[i % 4 :] + list(steps)[: i % 4]
        for name in names:
            for p, g in zip(params, grads):  # fused AdamW's grad_scale writes the gradients back: fresh ones
                p.grad = g.clone() if p.grad is None else p.grad.copy_(g)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            steps[name]()
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                ms[name].append(start.elapsed_time(end))
    floor = sum(ms["fused AdamW, no clip"]) / a.steps
    rows = [{"step": name, "ms": round(sum(t) / a.steps, 3), "min ms": round(min(t), 3),
             "above the floor ms": round(sum(t) / a.steps - floor, 3)} for name, t in ms.items()]  # fmt: skip
    n = sum(p.numel() for p in params)
    save(f"optimizer_{a.tag or mc.family}", rows, config=a.config, extra=extra, params=n, steps=a.steps)
    print(f"{n / 1e9:.3f} B parameters (fp32)")
    table(rows, ["step", "ms", "min ms", "above the floor ms"])


if __name__ == "__main__":
    main()
