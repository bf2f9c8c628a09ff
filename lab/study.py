"""
The accuracy study: the TACO paper's convergence comparisons at small scale, with TP emulated on
one GPU (lab/emulate.py), several seeds, paired against the uncompressed run of the same seed.

    python -m lab.study run table1:3,fig11:1 [--jobs=2] [-- train.py overrides]   # resumable runs
    python -m lab.study report [--graph]  # the tables, from results/study.json (--graph: the run --graph runs)
    python -m lab.study plot              # results/study.png (study_long.png, study_fork.png)
    python -m lab.study tp-real 2 none,hint8 [--seeds=1] [--config=configs/study_long.py]  # real TP next to emulated
    python -m lab.study fork hint8 hint8@fwd hint8@attn [--starts=600,900,1100,1300 --steps=100]  # paired forks

Every finished run is appended to results/study.json (key: codec, block, TP, seed, extra
arguments); runs already there are skipped, so a study can span sessions.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.common import RESULTS, environment, save, split_at_dashes, table

STUDY = {  # group: (emulated TP degree, [(codec, block size)], config); "none" is the uncompressed baseline
    "table1": (8, [("none", 256), ("taco", 256), ("tahquant", 256), ("hint8", 256)], "configs/study.py"),
    "fig11": (4, [("none", 256), ("fp8", 256), ("ds", 256), ("ash", 256), ("taco", 256)], "configs/study.py"),
    "fig13": (4, [("none", 256), ("hadamard", 256), ("taco", 256)], "configs/study.py"),
    "fig14": (4, [("none", 256), ("taco", 256), ("taco-e5m2", 256), ("taco-int8", 256)], "configs/study.py"),
    "table2": (4, [("none", 256)] + [("taco", b) for b in (32, 64, 128, 256, 512)], "configs/study.py"),
    "ours": (8, [("none", 256), ("taco", 256), ("hint8", 256), ("hint6", 256)], "configs/study.py"),
    # trained ~5x longer, to validation loss ~4.4 (configs/study_long.py)
    "long": (8, [("none", 256), ("hint8", 256), ("taco", 256), ("hint6", 256)], "configs/study_long.py"),
    # the embedding's all-reduce left uncompressed (tp_codec_embed=none): where lab.analysis sites finds most of the error
    "embed": (
        8,
        [("none", 256)] + [(f"{c}@noembed", 256) for c in ("hint8", "taco", "hint6")],
        "configs/study_long.py",
    ),
    # TP=2 emulated, to stand beside real TP=2 runs (python -m lab.study tp-real 2 none,hint8 --config=...)
    "tp2": (2, [("none", 256), ("hint8", 256)], "configs/study_long.py"),
    # where the error comes from: one codec on part of the all-reduces only (see variant_args)
    "attrib": (
        8,
        [("none", 256)] + [(f"{c}@{part}", 256) for c in ("hint8", "taco") for part in ("fwd", "bwd", "attn", "mlp")],
        "configs/study_long.py",
    ),
}
STUDY_FILE = os.environ.get("NANOTACO_STUDY_FILE", os.path.join(RESULTS, "study.json"))


def study_runs(groups):
    """The distinct (codec, block, TP, seed, config) runs of groups {name: seeds}, seed 0 of every run first."""
    runs = []
    for seed in range(max(groups.values())):
        for group, seeds in groups.items():
            t, cases, config = STUDY[group]
            runs += [
                (codec, block, t, seed, config)
                for codec, block in cases
                if seed < seeds and (codec, block, t, seed, config) not in runs
            ]
    return runs


def variant_args(label):
    """A study label's arguments for lab.emulate: "hint8" compresses every TP all-reduce;
    "hint8@fwd" / "hint8@bwd" only the forward / backward ones; "hint8@noembed" all but the
    embedding's; "hint8@SITES" only those sites (lab.emulate --sites, e.g. "hint8@mlp",
    "hint8@attn=hint6,mlp,ends")."""
    codec, _, part = label.partition("@")
    if part == "noembed":
        return [f"--tp_codec={codec}", "--tp_codec_embed=none"]
    if part == "fwd":
        return [f"--tp_codec={codec}", "--tp_codec_bwd=none"]
    if part == "bwd":
        return ["--tp_codec=none", f"--tp_codec_bwd={codec}"]
    return ([f"--sites={part}"] if part else []) + [f"--tp_codec={codec}"]


def study_key(codec, block, t, seed, config, extra):
    """A run's key in the study file (runs of the first config have none of it in the key)."""
    key = f"{codec}|B{block}|tp{t}|seed{seed}|{' '.join(extra)}"
    return key if config == "configs/study.py" else f"{key}|{os.path.basename(config)}"


def run_folder(root, key):
    """The output folder of the run (or fork) with this key."""
    return os.path.join(root, key.replace("|", "_").replace(" ", "").replace("--", "")[:120])


def write_runs(path, runs):
    """The whole record of runs, replaced at once (an interrupted write leaves the previous one)."""
    with open(path + ".tmp", "w") as f:
        json.dump(runs, f, indent=1)
    os.replace(path + ".tmp", path)


def run_study(groups, extra, jobs=1, graph=False):
    """Train one run per (codec, block, seed) of the groups with their config (lab.emulate: TP emulated),
    `jobs` at a time (round-robin over the visible GPUs; on one H200 several runs at once were slower
    than one after another), appending each finished run's loss curve and final losses to
    results/study.json. Runs already in the file (same key, same extra arguments) are skipped, so
    a study can span sessions and an interrupted one resumes where it stopped. `graph` runs
    (lab.emulate --graph) are keyed apart: the replayed step rounds some gradient sums differently
    from the eager one, so they pair only with graph runs (`report --graph`)."""

    root = next((a.split("=", 1)[1] for a in extra if a.startswith("--out_dir=")), os.path.join("out", "study"))
    extra = [a for a in extra if not a.startswith("--out_dir=")]
    keyed = [*extra, "--graph"] if graph else extra  # the run's key and record
    done = json.load(open(STUDY_FILE)) if os.path.exists(STUDY_FILE) else {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # keep the caller's choice of GPUs
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    gpus = gpus if torch.cuda.device_count() else []
    todo = []
    for codec, block, t, seed, config in study_runs(groups):
        key = study_key(codec, block, t, seed, config, keyed)
        if key not in done:
            todo.append((key, codec, block, t, seed, config))
    print(
        f"study {','.join(groups)}: {len(todo)} runs to do, {jobs} at a time on {len(gpus) or 'no'} GPU(s)", flush=True
    )
    running, failed = [], []

    def finish(key, codec, block, t, seed, config, out, proc, t0, log):
        log.close()
        if proc.returncode != 0:
            tail = open(os.path.join(out, "stdout.txt")).read()[-2000:]
            print(f"FAILED ({proc.returncode}): {key}; {out}/stdout.txt ends:\n{tail}", flush=True)
            failed.append(key)
            return
        rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
        evals = [r for r in rows if "val_loss" in r]
        done[key] = {
            "codec": codec,
            "block": block,
            "tp": t,
            "seed": seed,
            "extra": keyed,
            "config": config,
            "seconds": round(time.time() - t0, 1),
            "env": environment(),
            "curve": [(r["iter"], r["loss"]) for r in rows if "loss" in r],
            "val": [(r["iter"], r["val_loss"]) for r in evals],
            "final_val": evals[-1]["val_loss"],
            "final_train": evals[-1]["train_loss"],
        }
        write_runs(STUDY_FILE, done)  # cumulative; written after every run
        print(f"done in {time.time() - t0:5.0f} s: {key} val {done[key]['final_val']:.4f}", flush=True)

    def reap(limit):
        """Record finished runs as they finish (in any order) until fewer than `limit` run."""
        while len(running) >= limit:
            time.sleep(1)
            for r in [r for r in running if r[7].poll() is not None]:
                running.remove(r)
                finish(*r)

    for i, (key, codec, block, t, seed, config) in enumerate(todo):
        reap(jobs)  # wait for a free slot
        out = run_folder(root, key)
        os.makedirs(out, exist_ok=True)
        sites, args = [a for a in variant_args(codec) if a.startswith("--sites=")], variant_args(codec)
        cmd = [
            sys.executable,
            "-m",
            "lab.emulate",
            str(t),
            *sites,
            *["--graph"] * graph,
            config,
            *[a for a in args if a not in sites],
            f"--codec_block={block}",
            f"--seed={seed}",
            *extra,
            f"--out_dir={out}",
            "--overwrite",
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        print(" ".join(cmd), flush=True)
        log = open(os.path.join(out, "stdout.txt"), "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        running.append((key, codec, block, t, seed, config, out, proc, time.time(), log))
    reap(1)  # the rest, in the order they finish
    for group in groups:
        study_report(group, keyed)
    if failed:
        raise SystemExit(f"{len(failed)} of {len(todo)} study runs failed (their output: above)")


def tp_real(tp, codecs, seeds, extra=(), config="configs/study.py"):
    """The study's TP runs trained for real (torchrun, `tp` ranks, one
    TP group) instead of emulated on one rank; final validation loss next to the emulated run of
    the same codec and seed from results/study.json (when no extra arguments change the run), and
    each codec's paired change vs the uncompressed run of the same seed, real and emulated. Real
    and emulated TP need not agree to the bit (a TP matmul sums in another order), only within the
    seed-to-seed spread."""

    done = json.load(open(STUDY_FILE)) if os.path.exists(STUDY_FILE) else {}
    rows = []
    for seed in range(seeds):
        for codec in codecs:
            out = os.path.join("out", f"tp{tp}_real", f"{codec}_seed{seed}")
            os.makedirs(out, exist_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={tp}",
                "train.py",
                config,
                f"--tp={tp}",
                f"--tp_codec={codec}",
                f"--seed={seed}",
                *extra,
                f"--out_dir={out}",
                "--overwrite",
            ]
            print(" ".join(cmd), flush=True)
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if p.returncode != 0:
                print(
                    f"{codec} seed {seed}: FAILED (exit {p.returncode}):\n{(p.stdout + p.stderr)[-2000:]}", flush=True
                )
                continue
            evals = [r for r in map(json.loads, open(os.path.join(out, "log.jsonl"))) if "val_loss" in r]
            emu = None if extra else done.get(study_key(codec, 256, tp, seed, config, ()))
            rows.append(
                {
                    "codec": codec,
                    "seed": seed,
                    "real val": round(evals[-1]["val_loss"], 4),
                    "emulated val": round(emu["final_val"], 4) if emu else "-",
                }
            )
    base = {(r["seed"], k): r[k] for r in rows if r["codec"] == "none" for k in ("real val", "emulated val")}
    for r in rows:
        for k, d in (("real val", "real vs none"), ("emulated val", "emulated vs none")):
            b = base.get((r["seed"], k))
            ok = isinstance(r[k], float) and isinstance(b, float)
            r[d] = f"{100 * (r[k] / b - 1):+.2f}%" if ok else "-"
    save(
        f"tp{tp}_real" + ("" if config == "configs/study.py" else "_" + os.path.basename(config)[:-3]),
        rows,
        extra=list(extra),
        config=config,
    )
    table(rows, ["codec", "seed", "real val", "emulated val", "real vs none", "emulated vs none"])


FORK_FILE = os.environ.get("NANOTACO_FORK_FILE", os.path.join(RESULTS, "study_fork.json"))


def fork_study(labels, starts, steps, t=8, config="configs/study_long.py", extra=(), root=os.path.join("out", "fork")):
    """Attribution by short paired forks, a lower-noise measure than final losses: one uncompressed
    training (train.py, TP=1) is checkpointed at every start; from each checkpoint every label
    (variant_args: "hint8", "hint8@fwd", ...) and "none" train `steps` more steps with TP=t emulated,
    on the same batches (they depend only on the step), and are evaluated once at the end. A
    label's effect at a start is its validation loss minus the "none" fork's from the same start:
    the forks share their whole past, so only `steps` steps of divergence add noise, where two full
    runs decorrelate like two seeds. The forks run in this process (no start-up per fork); each is
    appended to results/study_fork.json as it finishes, so a study resumes where it stopped."""
    import shutil

    import checkpoint
    from lab import emulate

    base = os.path.join(root, "base")
    for s in sorted(starts):  # the base, continued from start to start
        saved = os.path.join(root, "starts", f"iter_{s:08d}")
        if os.path.exists(os.path.join(saved, "COMPLETE")):
            continue
        have = checkpoint.sets(base)
        cmd = [
            sys.executable,
            "train.py",
            config,
            "--tp_codec=none",
            f"--max_iters={s}",
            "--eval_interval=0",
            "--ckpt_interval=0",
            "--log_interval=100",
            *extra,
            f"--out_dir={base}",
            "--resume" if have and int(have[-1][-8:]) <= s else "--overwrite",
        ]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        shutil.copytree(checkpoint.sets(base)[-1], saved, dirs_exist_ok=True)
    done = json.load(open(FORK_FILE)) if os.path.exists(FORK_FILE) else {}
    for label in ["none", *[x for x in labels if x != "none"]]:  # a label at every start, then the next
        for s in starts:
            key = f"{label}|tp{t}|start{s}|steps{steps}|{os.path.basename(config)}|{' '.join(extra)}"
            if key in done:
                continue
            out = run_folder(root, key)
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(os.path.join(out, "ckpt"))  # the start's set, linked (not copied) in
            os.symlink(
                os.path.abspath(os.path.join(root, "starts", f"iter_{s:08d}")),
                os.path.join(out, "ckpt", f"iter_{s:08d}"),
            )
            args = variant_args(label)
            sites = [a for a in args if a.startswith("--sites=")]
            t0 = time.time()
            emulate.main(
                [
                    str(t),
                    *sites,
                    config,
                    *[a for a in args if a not in sites],
                    f"--max_iters={s + steps}",
                    f"--eval_interval={s + steps}",
                    "--ckpt_interval=-1",
                    "--log_interval=50",
                    *extra,
                    f"--out_dir={out}",
                    "--resume",
                    f"--resume_from={os.path.join(out, 'ckpt', f'iter_{s:08d}')}",  # the base run's set, on purpose
                ]
            )
            ev = [r for r in map(json.loads, open(os.path.join(out, "log.jsonl"))) if "val_loss" in r][-1]
            done[key] = {
                "label": label,
                "tp": t,
                "start": s,
                "steps": steps,
                "config": config,
                "extra": list(extra),
                "val": ev["val_loss"],
                "train": ev["train_loss"],
                "seconds": round(time.time() - t0, 1),
                "env": environment(),
            }
            write_runs(FORK_FILE, done)
            print(f"fork {key}: val {ev['val_loss']:.4f} ({time.time() - t0:.0f} s)", flush=True)
    return fork_report(steps, t, config, extra)


def fork_report(steps, t=8, config="configs/study_long.py", extra=()):
    """Each label's change in validation loss against the "none" fork of the same start: the
    per-start values, their mean and its 95% confidence interval over the starts."""
    done = json.load(open(FORK_FILE)) if os.path.exists(FORK_FILE) else {}
    runs = [
        r for r in done.values() if (r["tp"], r["steps"], r["config"], r["extra"]) == (t, steps, config, list(extra))
    ]
    base = {r["start"]: r["val"] for r in runs if r["label"] == "none"}
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs if r["label"] != "none"):
        d = {
            r["start"]: 100 * (r["val"] / base[r["start"]] - 1)
            for r in runs
            if r["label"] == label and r["start"] in base
        }
        if not d:
            continue
        mean = sum(d.values()) / len(d)
        ci = confidence_interval(list(d.values())) if len(d) > 1 else None
        rows.append(
            {
                "label": label,
                "starts": len(d),
                "vs none": f"{mean:+.3f}%",
                "95% CI": "[{:+.3f}, {:+.3f}]%".format(*ci) if ci else "-",
                "per start": " ".join(f"{s}:{v:+.3f}" for s, v in sorted(d.items())),
                "mean": mean,
                "ci": ci,
                "effects": d,
            }
        )
    print(f"\nforks of {steps} steps, TP={t} emulated, {config}, {os.path.relpath(FORK_FILE)}:")
    table(rows, ["label", "starts", "vs none", "95% CI", "per start"])
    return rows


def plot_forks(path=os.path.join(RESULTS, "study_fork.png")):
    """Every label's change vs the none fork: one dot per start, the mean with its 95% CI, per horizon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lab.analysis import save_figure

    horizons = sorted({r["steps"] for r in json.load(open(FORK_FILE)).values()})
    fig, ax = plt.subplots(figsize=(8, 6.5))
    names = []
    for i, steps in enumerate(horizons):
        for row in fork_report(steps):
            y = len(names)
            names.append(f"{row['label']}  ({steps} steps)")
            pts = list(row["effects"].values())
            ax.scatter(pts, [y] * len(pts), s=12, color=f"C{i}", alpha=0.6, label="one start" if y == 0 else None)
            if row["ci"]:
                lo, hi = row["ci"]
                ax.errorbar(
                    [row["mean"]],
                    [y],
                    xerr=[[row["mean"] - lo], [hi - row["mean"]]],
                    fmt="o",
                    color="k",
                    ms=4,
                    capsize=3,
                    label="mean, 95% CI" if y == 0 else None,
                )
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set(
        xlabel="validation loss vs the uncompressed fork from the same checkpoint (%)",
        title="Short paired forks, TP=8 emulated (configs/study_long.py)",
    )
    save_figure(fig, [ax], path)


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def confidence_interval(xs):
    """95% confidence interval of the mean of xs (Student's t, len(xs) - 1 degrees of freedom)."""
    n = len(xs)
    mean = sum(xs) / n
    sd = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5
    half = T975.get(n - 1, 1.96) * sd / n**0.5
    return mean - half, mean + half


def study_report(group, extra=()):
    """Final validation loss per codec: mean and spread over seeds, and the change vs the
    uncompressed baseline, both from the means and PAIRED (same seed: same initialisation and
    batches, so the seed-to-seed noise cancels; mean and range of the per-seed differences)."""
    t, runs, config = STUDY[group]
    done = json.load(open(STUDY_FILE)) if os.path.exists(STUDY_FILE) else {}
    by = {}
    for r in done.values():
        if r["tp"] == t and r["extra"] == list(extra) and r.get("config", "configs/study.py") == config:
            by.setdefault((r["codec"], r["block"]), {})[r["seed"]] = r["final_val"]
    base = by.get(("none", 256), {})
    rows = []
    for codec, block in runs:
        v = by.get((codec, block))
        if not v:
            continue
        vals = list(v.values())
        mean = sum(vals) / len(vals)
        row = {
            "codec": codec,
            "B": block,
            "seeds": len(vals),
            "val loss": f"{mean:.4f}",
            "seed spread": f"{max(vals) - min(vals):.4f}" if len(vals) > 1 else "-",
            "vs none (means)": f"{100 * (mean / (sum(base.values()) / len(base)) - 1):+.2f}%" if base else "-",
        }
        paired = [100 * (v[s] / base[s] - 1) for s in v if s in base]
        row["paired"] = row["paired 95% CI"] = "-"
        if paired and codec != "none":
            row["paired"] = (
                f"{sum(paired) / len(paired):+.2f}% [{min(paired):+.2f}, {max(paired):+.2f}]"
                if len(paired) > 1
                else f"{paired[0]:+.2f}%"
            )
            if len(paired) > 1:
                lo, hi = confidence_interval(paired)
                row["paired 95% CI"] = f"[{lo:+.2f}, {hi:+.2f}]%"
        rows.append(row)
    print(f"\nstudy {group} (TP={t} emulated, {config}), {os.path.relpath(STUDY_FILE)}:")
    table(rows, ["codec", "B", "seeds", "val loss", "seed spread", "vs none (means)", "paired", "paired 95% CI"])
    return rows


def plot_study(config="configs/study.py", path=os.path.join(RESULTS, "study.png")):
    """The runs of one study config. Left: every run's final validation loss minus the baseline's
    of the same seed and TP, per codec (one dot per seed). Right: train-loss curves of the TP=8 runs
    minus the baseline's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lab.analysis import save_figure

    done = {
        k: r
        for k, r in json.load(open(STUDY_FILE)).items()
        if r.get("config", "configs/study.py") == config and not r["extra"]
    }  # eager, default settings
    base = {(r["tp"], r["seed"]): r["final_val"] for r in done.values() if r["codec"] == "none"}
    labels = []
    for group, (t, runs, cfg) in STUDY.items():
        labels += [(t, c, b) for c, b in runs if c != "none" and (t, c, b) not in labels and cfg == config]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.4, 1]})
    ax = axes[0]
    pts = {
        (t, c, b): [
            100 * (r["final_val"] / base[(t, r["seed"])] - 1)
            for r in done.values()
            if (r["tp"], r["codec"], r["block"]) == (t, c, b) and (t, r["seed"]) in base
        ]
        for t, c, b in labels
    }
    labels = [key for key in labels if pts[key]]  # the runs done so far
    for i, key in enumerate(labels):
        ax.scatter([i] * len(pts[key]), pts[key], color="C0" if key[0] == 8 else "C1", s=18)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(
        range(len(labels)),
        [f"{c}{'' if b == 256 else f' B{b}'} TP{t}" for t, c, b in labels],
        rotation=60,
        ha="right",
        fontsize=8,
    )
    ax.set(ylabel="final val loss vs none, same seed (%)", title="Study: codec effect on final validation loss")
    if max((abs(p) for key in labels for p in pts[key]), default=0) > 2:
        ax.set_yscale("symlog", linthresh=1, linscale=3)  # raw fp8's +13% beside effects of 0.1%
    ax.grid(alpha=0.3)
    ax = axes[1]
    ref = {(r["seed"]): dict(r["curve"]) for r in done.values() if r["tp"] == 8 and r["codec"] == "none"}
    for r in sorted(done.values(), key=lambda r: r["codec"]):
        if r["tp"] == 8 and r["codec"] != "none" and r["curve"] and r["seed"] in ref:
            pts = [(i, loss - ref[r["seed"]][i]) for i, loss in r["curve"] if i in ref[r["seed"]]]
            variant = "@" in r["codec"]  # a part compressed: dash-dot, thicker
            ax.plot(
                *zip(*pts),
                label=f"{r['codec']} seed {r['seed']}",
                lw=1.8 if variant else 1,
                color={"taco": "C3", "hint8": "C1", "hint6": "C2"}.get(r["codec"].split("@")[0], "C4"),
                ls="-." if variant else ["-", "--", ":"][r["seed"] % 3],
            )
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xlabel="step", ylabel="train loss minus none (same seed)", title="TP=8 emulated: the gap during training")
    save_figure(fig, [ax], path)


def main(argv):
    argv, train_args = split_at_dashes(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="train the missing runs of GROUP[:SEEDS],... (groups: " + ", ".join(STUDY) + ")")
    r.add_argument("groups")
    r.add_argument("--seeds", type=int, default=3, help="seeds of a group given without :SEEDS")
    r.add_argument("--jobs", type=int, default=1, help="runs at a time (round-robin over the GPUs)")
    r.add_argument(
        "--graph",
        action="store_true",
        help="lab.emulate --graph: steps replayed as CUDA graphs "
        "(~1.25x faster; keyed apart from eager runs: not bit-identical to them)",
    )
    rp = sub.add_parser("report", help="the study's tables from results/study.json")
    rp.add_argument("--graph", action="store_true", help="the runs made with run --graph")
    sub.add_parser("plot", help="results/study.png (and study_long.png)")
    t = sub.add_parser("tp-real", help="the study's runs at real TP=T (torchrun), next to the emulated ones")
    t.add_argument("tp", type=int)
    t.add_argument("codecs")
    t.add_argument("--seeds", type=int, default=1)
    t.add_argument(
        "--config", default="configs/study.py", help="the study config (configs/study_long.py: the long runs)"
    )
    f = sub.add_parser("fork", help="attribution by short paired forks of one uncompressed run (see fork_study)")
    f.add_argument("labels", nargs="*", help='e.g. hint8 hint8@fwd hint8@attn=hint6,mlp ("none" is always run)')
    f.add_argument("--starts", default="600,900,1100,1300", help="steps of the uncompressed run to fork from")
    f.add_argument("--steps", type=int, default=100, help="steps each fork trains")
    f.add_argument("--tp", type=int, default=8, help="emulated TP degree of the forks")
    f.add_argument("--config", default="configs/study_long.py")
    f.add_argument("--out", default=os.path.join("out", "fork"), help="the base run, its checkpoints, the forks")
    f.add_argument("--report", action="store_true", help="only the table, from results/study_fork.json")
    a = ap.parse_args(argv)
    if a.what == "run":
        groups = {g.split(":")[0]: int(g.split(":")[1]) if ":" in g else a.seeds for g in a.groups.split(",")}
        unknown = [g for g in groups if g not in STUDY]
        if unknown:
            raise SystemExit(f"unknown study group {unknown[0]!r}: {', '.join(STUDY)}")
        run_study(groups, train_args, a.jobs, a.graph)
    elif a.what == "report":
        for group in STUDY:
            study_report(group, ["--graph"] if a.graph else ())
    elif a.what == "plot":
        plot_study()
        if any(r.get("config") == "configs/study_long.py" for r in json.load(open(STUDY_FILE)).values()):
            plot_study("configs/study_long.py", os.path.join(RESULTS, "study_long.png"))
        if os.path.exists(FORK_FILE):
            plot_forks()
    elif a.what == "fork":
        if a.report:
            fork_report(a.steps, a.tp, a.config, train_args)
        elif not a.labels:
            raise SystemExit("lab.study fork: name the variants to fork (e.g. hint8 taco hint8@fwd), or --report")
        else:
            fork_study(a.labels, [int(s) for s in a.starts.split(",")], a.steps, a.tp, a.config, train_args, a.out)
    else:
        tp_real(a.tp, a.codecs.split(","), a.seeds, train_args, a.config)


if __name__ == "__main__":
    main(sys.argv[1:])
