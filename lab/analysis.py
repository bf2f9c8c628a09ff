"""
Analyses of what the TP all-reduces carry and of recorded runs (CPU unless said otherwise):

    python -m lab.analysis codecs                 # every codec's error on real TP all-reduce inputs (results/codecs.json)
    python -m lab.analysis histograms             # the paper's Figs. 4/8 on our TP tensors (results/histograms.png)
    python -m lab.analysis sites                  # which all-reduces' compression moves the gradient (results/sites.json)
    python -m lab.analysis trace-report STEPS TRACE...   # where a step's GPU time goes (train.py --profile_steps)
    python -m lab.analysis curves LOG.jsonl... [--out PNG]   # loss and tokens/s against step of any runs
    python -m lab.analysis overlap-bound          # the codec-beside-matmul pair's SM-time bound (results/overlap_bound.json)
"""

import argparse
import json
import os
import re
import sys

import torch
import torch.distributed as dist

import parallel
import taco
from benchmarks.common import RESULTS, ROOT, kernel_kind, save, table, trace_kernels
from lab.emulate import emulate_tp, emulated_all_reduce, parse_sites  # (and with it the codec `tahquant`)
from lab.ranks import run_ranks

# -----------------------------------------------------------------------------
# what the TP all-reduces carry: every codec's error on them, their histograms


def _capture_worker(rank, world, steps):
    """Train the demo model at TP=world for `steps` steps, then return every TP all-reduce input
    (forward partial sums and backward partial gradients) of one more step: (direction, tensor)."""
    from data.loader import Batches
    from model import GPT, GPTConfig

    comm = parallel.TPComm(group=dist.group.WORLD, size=world, rank=rank)
    model = GPT(GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128), comm, seed=1337)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    batches = Batches("small", 64, 8, 1337, 0, "cpu")
    captured = []

    def capturing(real):  # wraps THE TP all-reduce of one TPComm
        def all_reduce(x, direction, async_op=False):
            captured.append((direction, x.detach().clone()))
            return real(x, direction, async_op)

        return all_reduce

    for it in range(steps + 1):
        if it == steps:  # the last step's all-reduce inputs, of every TPComm the layers hold (TPComm.at)
            for c in {id(m.comm): m.comm for m in model.modules() if hasattr(m, "comm")}.values():
                c.all_reduce = capturing(c.all_reduce)
        x, y = batches.get("train", it)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return captured


def capture_tp_tensors(world=4, steps=100):
    """[(direction, [rank r's contribution to all-reduce i for r in ranks])] of one training step."""
    caps = run_ranks(_capture_worker, world, steps)
    return [(caps[0][i][0], [caps[r][i][1] for r in range(world)]) for i in range(len(caps[0]))]


def codec_errors(world=4, steps=100):
    print(f"capturing TP={world} all-reduce inputs of the demo model after {steps} training steps (CPU, gloo)...")
    calls = capture_tp_tensors(world, steps)
    rows = []
    for name in taco.codec_names():
        err = {"fwd": [], "bwd": []}
        snr = []
        for direction, partials in calls:
            exact = torch.stack([p.double() for p in partials]).sum(0)
            got = emulated_all_reduce(partials, codec=name).double()
            e = ((got - exact).norm() / exact.norm()).item()
            err[direction].append(e)
            snr.append(-20 * torch.log10(torch.tensor(max(e, 1e-30))).item())
        cd = taco.get_codec(name)
        bpe = 4.0 if cd is taco.IDENTITY else cd.nbytes(256 * 1024) / (256 * 1024)
        mean = lambda v: sum(v) / len(v)
        rows.append(
            {
                "codec": name,
                "bytes/elem": f"{bpe:.4f}",
                "fwd rel err": f"{mean(err['fwd']):.2e}",
                "bwd rel err": f"{mean(err['bwd']):.2e}",
                "worst rel err": f"{max(err['fwd'] + err['bwd']):.2e}",
                "SNR dB": f"{mean(snr):.1f}",
            }
        )
    save(
        "codecs",
        rows,
        world=world,
        steps=steps,
        allreduces=len(calls),
        note="relative L2 error of the two-shot compressed all-reduce (emulated, same arithmetic as "
        "taco.all_reduce) vs the exact fp64 sum of the TP ranks' fp32 partial sums",
    )
    print(f"\n{len(calls)} TP all-reduces (fwd activations + bwd activation gradients), TP={world}, demo model:")
    table(rows, ["codec", "bytes/elem", "fwd rel err", "bwd rel err", "worst rel err", "SNR dB"])


PARTS = {  # what is compressed: (forward all-reduces, backward ones, sites, the embedding's), and how many
    "all": (True, True, None, True, lambda L: 4 * L + 2),
    "all but the embedding": (True, True, None, False, lambda L: 4 * L + 1),  # tp_codec_embed=none
    "forward": (True, False, None, True, lambda L: 2 * L + 1),
    "backward": (False, True, None, True, lambda L: 2 * L + 1),
    "attention": (True, True, "attn", True, lambda L: 2 * L),
    "MLP": (True, True, "mlp", True, lambda L: 2 * L),
    "embedding + head": (True, True, "ends", True, lambda L: 2),
    "embedding (fwd)": (True, False, "ends", True, lambda L: 1),
    "LM head (bwd)": (False, True, "ends", True, lambda L: 1),
}


def site_errors(
    codecs=("hint8", "taco", "hint6"), t=8, steps=100, batches=4, n_layer=4, n_embd=128, dataset="small", tag="sites"
):
    """Where a codec's error enters, measured on the gradient (CPU, no training with compression):
    a GPT (n_layer x n_embd, 8 heads) trained `steps` steps uncompressed on `dataset`, then
    at TP=t emulated one step's full gradient with the codec on all, the forward, the backward, the
    attention, the MLP or the embedding/head all-reduces only (or on all but the embedding's),
    against the uncompressed emulation's (same weights and batches; mean over `batches` batches).
    "share" = that part's squared error
    over the whole's: independent errors add in squares, so the shares of a split sum to about 1.
    A first, cheap answer; training with the codec on part of the all-reduces (lab.study attrib) is
    the one that counts."""
    from data.loader import Batches
    from model import GPT, GPTConfig

    cfg = GPTConfig(block_size=64, n_layer=n_layer, n_head=8, n_embd=n_embd)
    data = Batches(os.path.join(ROOT, "data", dataset), 64, 8, 1337, 0, "cpu")
    model = GPT(cfg, seed=1337)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    for it in range(steps):
        model(*data.get("train", it))[1].backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()

    def gradients(fwd, bwd, sites, embed=True):
        comm = parallel.TPComm(fwd_codec=fwd, bwd_codec=bwd, embed_codec="" if embed else "none")
        emu = emulate_tp(GPT(cfg, comm, seed=1337), t, comm, None if sites is None else parse_sites(sites))
        emu.load_state_dict(state)
        out = []
        for b in range(batches):
            emu.zero_grad()
            loss = emu(*data.get("val", b))[1]
            loss.backward()
            out.append((loss.item(), torch.cat([p.grad.flatten() for p in emu.parameters()]).double()))
        return out

    exact = gradients("none", "none", None)
    rows = []
    for codec in codecs:
        err2 = {}
        for part, (fwd, bwd, sites, embed, count) in PARTS.items():
            got = gradients(codec if fwd else "none", codec if bwd else "none", sites, embed)
            err2[part] = sum(((g - e).norm() / e.norm()).item() ** 2 for (_, g), (_, e) in zip(got, exact)) / batches
            dloss = sum(lg - le for (lg, _), (le, _) in zip(got, exact)) / batches
            rows.append(
                {
                    "codec": codec,
                    "compressed": part,
                    "all-reduces": count(cfg.n_layer),
                    "grad rel err": f"{err2[part] ** 0.5:.2e}",
                    "share": f"{err2[part] / err2['all']:.2f}",
                    "loss change": f"{dloss:+.1e}",
                }
            )
    save(
        tag,
        rows,
        tp=t,
        steps=steps,
        batches=batches,
        n_layer=n_layer,
        n_embd=n_embd,
        dataset=dataset,
        note=site_errors.__doc__,
    )
    print(f"\nTP={t} emulated, a {n_layer} x {n_embd} GPT after {steps} steps on {dataset}, {batches} batches:")
    table(rows, ["codec", "compressed", "all-reduces", "grad rel err", "share", "loss change"])
    return rows


def histograms(world=4, steps=100, path=os.path.join(RESULTS, "histograms.png")):
    """The paper's Figs. 4 and 8 on our tensors: what enters a TP all-reduce (rank 0's partial sum of
    the first MLP's forward, and of the first column-parallel layer's input gradient), raw, after a
    standard block Hadamard, and after ASH (alpha, then Hadamard). Prints the statistics that
    decide how well 8 bits fit: per-block max/rms and the kurtosis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = capture_tp_tensors(world, steps)
    # calls in order: embedding, then (attention, MLP) per layer forward; LM head, then per layer backward
    picks = {
        "forward (MLP out, layer 0)": calls[2][1],
        "backward (MLP input grad, last layer)": [d_p for d_p in calls if d_p[0] == "bwd"][1][1],
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = []
    for ax, (name, partials) in zip(axes, picks.items()):
        x = partials[0].float().reshape(-1)
        n = x.numel() // 256 * 256
        g = x[:n].view(-1, 256)
        rms = g.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-30)
        variants = {"raw": g, "Hadamard": taco.fwht(g) / 16, "ASH (alpha, Hadamard)": taco.fwht(g / rms) / 16}
        for label, v in variants.items():
            r = v.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-30)
            kurt = ((v / r).pow(4).mean()).item()
            ratio = (v.abs().amax(1, keepdim=True) / r).mean().item()
            rows.append(
                {
                    "tensor": name,
                    "variant": label,
                    "mean block max/rms": f"{ratio:.2f}",
                    "kurtosis": f"{kurt:.2f}",
                    "std": f"{v.std().item():.3e}",
                }
            )
            ax.hist(v.reshape(-1).numpy(), bins=200, histtype="step", log=True, label=label, density=True)
        ax.set(title=name, xlabel="value", ylabel="density (log)")
        ax.legend(fontsize=8)
    fig.suptitle(f"TP={world} all-reduce inputs of the demo model after {steps} steps (rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    save(
        "histograms",
        rows,
        world=world,
        steps=steps,
        note="a Gaussian has kurtosis 3 and, over 256 samples, mean max/rms about 2.9",
    )
    table(rows, ["tensor", "variant", "mean block max/rms", "kurtosis", "std"])
    print(f"wrote {path}")


# -----------------------------------------------------------------------------
# where a step's GPU time goes, and what a cost model predicts from the recorded collectives


def _merge(iv):
    """Sorted, non-overlapping union of [a, b) intervals."""
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(iv):
    return sum(b - a for a, b in iv)


def _intersect(x, y):
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append([a, b])
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def trace_report(path, steps):
    """From one rank's chrome trace of `steps` profiled steps: per kernel kind, the GPU time, how
    much of it ran while a compute kernel ran (hidden behind the matmuls) and how much did not
    (exposed: on the step's critical path unless another rank waits anyway); per codec kernel, its
    mean duration alone and beside compute."""
    ks = trace_kernels(path)
    span = max(b for _, b, _ in ks) - min(a for a, _, _ in ks)
    by_kind = {}
    for a, b, name in ks:
        by_kind.setdefault(kernel_kind(name), []).append((a, b, name))
    compute = _merge([(a, b) for a, b, _ in by_kind.get("compute", [])])
    everything = _merge([(a, b) for a, b, _ in ks])
    ms = lambda us: us / 1000 / steps
    rows = [
        {
            "kind": "step (first to last kernel)",
            "kernel ms": f"{ms(span):.1f}",
            "busy ms": f"{ms(_length(everything)):.1f}",
            "beside compute": "-",
            "exposed": f"{ms(span - _length(everything)):.1f} idle",
        }
    ]
    for kind, kv in sorted(by_kind.items()):
        busy = _merge([(a, b) for a, b, _ in kv])
        hidden = _length(_intersect(busy, compute)) if kind != "compute" else 0
        rows.append(
            {
                "kind": kind,
                "kernel ms": f"{ms(sum(b - a for a, b, _ in kv)):.1f}",
                "busy ms": f"{ms(_length(busy)):.1f}",
                "beside compute": "-" if kind == "compute" else f"{ms(hidden):.1f}",
                "exposed": "-" if kind == "compute" else f"{ms(_length(busy) - hidden):.1f}",
            }
        )
    # codec kernels: alone vs beside a matmul (> half their time under a compute kernel)
    per = {}
    for a, b, name in by_kind.get("codec kernels", []):
        op = "reduce_encode" if "reduce_encode" in name else "encode" if "encode" in name else "decode"
        beside = _length(_intersect([[a, b]], compute)) > (b - a) / 2
        per.setdefault((op, beside), []).append(b - a)
    calls = [
        {
            "kernel": op,
            "beside compute": "yes" if beside else "no",
            "calls/step": len(v) // steps,
            "mean us": f"{sum(v) / len(v):.1f}",
        }
        for (op, beside), v in sorted(per.items())
    ]
    return rows, calls


def overlap_bound(rows, sms=132):
    """From bench.py overlap's rows: per (shape, codec), the least time the pair can take if the SMs
    are split between the two kernels. Each one's cheapest measured SM-time (SMs x us: the codec alone
    on all SMs or on a green context of k; the matmul on all or told to leave k free), summed and
    spread over all SMs. Kernels sharing an SM can beat it only by using one SM's resources better
    together than apart."""
    by = {}
    for r in rows:
        by.setdefault((r["shape"], r["codec"]), {})[r["variant"]] = float(r["pair us"])
    out = []
    for (shape, codec), v in by.items():
        r0 = next(r for r in rows if (r["shape"], r["codec"]) == (shape, codec))
        mm, cc = float(r0["matmul alone us"]), float(r0["codec alone us"])
        codec_sm = min(
            [sms * cc] + [int(m[1]) * t for n, t in v.items() if (m := re.fullmatch(r"alone: codec on (\d+) SMs.*", n))]
        )
        mm_sm = min(
            [sms * mm]
            + [
                (sms - int(m[1])) * t
                for n, t in v.items()
                if (m := re.fullmatch(r"alone: matmul, all but (\d+) SMs.*", n))
            ]
        )
        bound = (codec_sm + mm_sm) / sms
        best = min(t for n, t in v.items() if not n.startswith("alone") and n != "one after the other")
        out.append(
            {
                "shape": shape,
                "codec": codec,
                "matmul us": f"{mm:.1f}",
                "codec us": f"{cc:.1f}",
                "bound us": f"{bound:.1f}",
                "bound vs matmul": f"{bound / mm:.2f}x",
                "best pair us": f"{best:.1f}",
                "best vs matmul": f"{best / mm:.2f}x",
            }
        )
    return out


def curves(paths, out=None):
    """Train loss (every log line), validation loss (every evaluation) and tokens/s against step of
    any set of runs (their out_dir or its log.jsonl), into `out` (default: the first run's
    out_dir/curves.png). Returns the loss panel's curves as (label, points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [os.path.join(p, "log.jsonl") if os.path.isdir(p) else p for p in paths]
    out = out or os.path.join(os.path.dirname(os.path.abspath(paths[0])), "curves.png")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        rows = [json.loads(line) for line in open(path)]
        steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]
        label = os.path.basename(os.path.dirname(os.path.abspath(path)))
        (line,) = axes[0].plot([r["iter"] for r in steps], [r["loss"] for r in steps], label=f"{label} train")
        if evals:
            axes[0].plot(
                [r["iter"] for r in evals],
                [r["val_loss"] for r in evals],
                "o--",
                color=line.get_color(),
                label=f"{label} val",
            )
        axes[1].plot([r["iter"] for r in steps], [r["tok_s"] for r in steps], label=label)
    axes[0].set(xlabel="step", ylabel="loss (log scale)", yscale="log")  # the late curve's changes stay visible
    axes[1].set(xlabel="step", ylabel="tokens/s")
    save_figure(fig, axes, out)
    return [(ln.get_label(), len(ln.get_xdata())) for ln in axes[0].lines]


def save_figure(fig, axes, path):
    """Legends and grids on every panel, then the PNG."""
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("codecs", help="every codec's error on the demo model's TP=4 all-reduce inputs")
    sub.add_parser("histograms", help="what the all-reduces carry, raw / Hadamard / ASH")
    si = sub.add_parser("sites", help="which all-reduces' compression moves the gradient most (TP=8 emulated)")
    si.add_argument("--n_layer", type=int, default=4)
    si.add_argument("--n_embd", type=int, default=128)
    si.add_argument("--steps", type=int, default=100, help="uncompressed training steps before the measurement")
    si.add_argument("--dataset", default="small", help="data/<dataset> (python data/prepare.py small|large)")
    si.add_argument("--tag", default="sites", help="results/<tag>.json")
    t = sub.add_parser("trace-report", help="per kernel kind: GPU time beside compute vs exposed")
    t.add_argument("steps", type=int, help="how many steps the traces hold (train.py --profile_steps)")
    t.add_argument("traces", nargs="+")
    c = sub.add_parser("curves", help="plot the train and validation loss and tokens/s of runs (out_dirs or log.jsonl)")
    c.add_argument("logs", nargs="+")
    c.add_argument("--out", default=None, help="the PNG (default: the first run's out_dir/curves.png)")
    sub.add_parser("overlap-bound", help="the least time of the codec-beside-matmul pair on split SMs")
    a = ap.parse_args(argv)
    if a.what == "codecs":
        codec_errors()
    elif a.what == "histograms":
        histograms()
    elif a.what == "sites":
        site_errors(n_layer=a.n_layer, n_embd=a.n_embd, steps=a.steps, dataset=a.dataset, tag=a.tag)
    elif a.what == "trace-report":
        for path in a.traces:
            rows, calls = trace_report(path, a.steps)
            print(f"\n{path} (ms per step; streams overlap):")
            table(rows, ["kind", "kernel ms", "busy ms", "beside compute", "exposed"])
            if calls:
                table(calls, ["kernel", "beside compute", "calls/step", "mean us"])
    elif a.what == "overlap-bound":
        src = json.load(open(os.path.join(RESULTS, "overlap.json")))
        rows = overlap_bound(src["rows"])
        table(rows, list(rows[0]))
        save(
            "overlap_bound",
            rows,
            note=f"From results/overlap.json ({src['env']['date']}): " + " ".join(overlap_bound.__doc__.split()),
        )
    else:
        curves(a.logs, a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
