"""
Benchmarks and measurements. Each subcommand prints a short table last and writes its full results
(with date, machine, versions and the exact command) to results/<name>.json.

    python bench.py codecs                    # CPU: every codec's error on real TP all-reduce tensors
    python bench.py kernels                   # GPU: fused kernels vs copy bandwidth vs PyTorch reference
    torchrun --nproc_per_node=2 bench.py collective   # GPU: taco.all_reduce vs NCCL bf16, 1..256 MB
"""
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

import taco

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def environment():
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
           "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpus"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def save(name, rows, **extra):
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"env": environment(), **extra, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def table(rows, cols):
    widths = [max(len(c), *(len(f"{r[c]}") for r in rows)) for c in cols]
    print(" | ".join(c.rjust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(f"{r[c]}".rjust(w) for c, w in zip(cols, widths)))


# -----------------------------------------------------------------------------
# codecs: error on real TP all-reduce inputs (CPU is fine)

def _capture_worker(rank, world, steps, outdir):
    """Train the demo model at TP=world for `steps` steps, then capture every TP all-reduce input
    (forward partial sums and backward partial gradients) of one more step."""
    import parallel
    from model import GPT, GPTConfig
    from train import Batches
    comm = parallel.TPComm(group=dist.group.WORLD, size=world, rank=rank)
    model = GPT(GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128), comm, seed=1337)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    batches = Batches("small", 64, 8, 1337, 0, "cpu")
    for it in range(steps + 1):
        if it == steps:
            comm.capture = []
        x, y = batches.get("train", it)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    torch.save(comm.capture, os.path.join(outdir, f"capture{rank}.pt"))


def capture_tp_tensors(world=4, steps=100):
    import tempfile
    import torch.multiprocessing as mp
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
    from launcher import _entry, _free_port
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, _free_port(), _capture_worker, (steps, d), d), nprocs=world)
        caps = [torch.load(os.path.join(d, f"capture{r}.pt")) for r in range(world)]
    # caps[r][i] = (direction, rank r's contribution to all-reduce i)
    return [(caps[0][i][0], [caps[r][i][1] for r in range(world)]) for i in range(len(caps[0]))]


def bench_codecs(world=4, steps=100):
    print(f"capturing TP={world} all-reduce inputs of the demo model after {steps} training steps (CPU, gloo)...")
    calls = capture_tp_tensors(world, steps)
    rows = []
    for name in ["none"] + list(taco.CODECS):
        err = {"fwd": [], "bwd": []}
        snr = []
        for direction, partials in calls:
            exact = torch.stack([p.double() for p in partials]).sum(0)
            got = taco.emulated_all_reduce(partials, codec=name).double()
            e = ((got - exact).norm() / exact.norm()).item()
            err[direction].append(e)
            snr.append(-20 * torch.log10(torch.tensor(max(e, 1e-30))).item())
        cd = taco.get_codec(name)
        bpe = 4.0 if cd is None else cd.nbytes(256 * 1024) / (256 * 1024)
        mean = lambda v: sum(v) / len(v)
        rows.append({"codec": name, "bytes/elem": f"{bpe:.4f}",
                     "fwd rel err": f"{mean(err['fwd']):.2e}", "bwd rel err": f"{mean(err['bwd']):.2e}",
                     "worst rel err": f"{max(err['fwd'] + err['bwd']):.2e}", "SNR dB": f"{mean(snr):.1f}"})
    save("codecs", rows, world=world, steps=steps, allreduces=len(calls),
         note="relative L2 error of the two-shot compressed all-reduce (emulated, same arithmetic as "
              "taco.all_reduce) vs the exact fp64 sum of the TP ranks' fp32 partial sums")
    print(f"\n{len(calls)} TP all-reduces (fwd activations + bwd activation gradients), TP={world}, demo model:")
    table(rows, ["codec", "bytes/elem", "fwd rel err", "bwd rel err", "worst rel err", "SNR dB"])


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "codecs"
    if what == "codecs":
        bench_codecs()
    else:
        raise SystemExit(f"unknown benchmark {what!r}: codecs | kernels | collective")
