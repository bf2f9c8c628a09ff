"""
Benchmarks and measurements. Each subcommand prints a short table last and writes its full results
(with date, machine, versions and the exact command) to results/<name>.json.

    python bench.py codecs                    # CPU: every codec's error on real TP all-reduce tensors
    python bench.py plot                      # results/loss_curves.png, results/study.png from recorded runs
    python bench.py study-report              # the study's tables from results/study.json
    python bench.py histograms                # CPU: the paper's Figs. 4/8 on our TP tensors
    python bench.py study fig11 3             # GPU: the paper's Fig. 11 ablation, 3 seeds, TP=4 emulated
    python bench.py study table1,fig11:1 3 8  # GPU: table1 with 3 seeds, fig11 with 1, 8 runs at a time
    python bench.py kernels                   # GPU: fused kernels vs copy bandwidth vs PyTorch reference
    torchrun --nproc_per_node=2 bench.py collective   # GPU: taco.all_reduce vs NCCL bf16, 1..256 MB
    python bench.py e2e configs/gpt2s.py none,hint8,taco 2 nvlink --max_iters=60   # training, per codec
    python bench.py costmodel                 # CPU: predicted TP share and speedup from the measured collectives
    python bench.py tp-real 8 none,hint8 1    # GPUs: the study's TP=8 runs for real vs emulated (issue 8)
"""
import json
import math
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

import taco

RESULTS = os.environ.get("NANOTACO_RESULTS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))


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
    widths = [max(len(c), *(len(f"{r.get(c, '-')}") for r in rows)) for c in cols]
    print(" | ".join(c.rjust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(f"{r.get(c, '-')}".rjust(w) for c, w in zip(cols, widths)))


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
    for name in taco.codec_names():
        err = {"fwd": [], "bwd": []}
        snr = []
        for direction, partials in calls:
            exact = torch.stack([p.double() for p in partials]).sum(0)
            got = taco.emulated_all_reduce(partials, codec=name).double()
            e = ((got - exact).norm() / exact.norm()).item()
            err[direction].append(e)
            snr.append(-20 * torch.log10(torch.tensor(max(e, 1e-30))).item())
        cd = taco.get_codec(name)
        bpe = 4.0 if cd is taco.IDENTITY else cd.nbytes(256 * 1024) / (256 * 1024)
        mean = lambda v: sum(v) / len(v)
        rows.append({"codec": name, "bytes/elem": f"{bpe:.4f}",
                     "fwd rel err": f"{mean(err['fwd']):.2e}", "bwd rel err": f"{mean(err['bwd']):.2e}",
                     "worst rel err": f"{max(err['fwd'] + err['bwd']):.2e}", "SNR dB": f"{mean(snr):.1f}"})
    save("codecs", rows, world=world, steps=steps, allreduces=len(calls),
         note="relative L2 error of the two-shot compressed all-reduce (emulated, same arithmetic as "
              "taco.all_reduce) vs the exact fp64 sum of the TP ranks' fp32 partial sums")
    print(f"\n{len(calls)} TP all-reduces (fwd activations + bwd activation gradients), TP={world}, demo model:")
    table(rows, ["codec", "bytes/elem", "fwd rel err", "bwd rel err", "worst rel err", "SNR dB"])


def bench_histograms(world=4, steps=100, path=os.path.join(RESULTS, "histograms.png")):
    """The paper's Figs. 4 and 8 on our tensors: what enters a TP all-reduce (rank 0's partial sum of
    the first MLP's forward, and of the first column-parallel layer's input gradient), raw, after a
    standard block Hadamard, and after ASH (alpha, then Hadamard). Prints the statistics that
    decide how well 8 bits fit: per-block max/rms and the kurtosis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    calls = capture_tp_tensors(world, steps)
    # calls in order: embedding, then (attention, MLP) per layer forward; LM head, then per layer backward
    picks = {"forward (MLP out, layer 0)": calls[2][1],
             "backward (MLP input grad, last layer)": [d_p for d_p in calls if d_p[0] == "bwd"][1][1]}
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
            rows.append({"tensor": name, "variant": label, "mean block max/rms": f"{ratio:.2f}",
                         "kurtosis": f"{kurt:.2f}", "std": f"{v.std().item():.3e}"})
            ax.hist(v.reshape(-1).numpy(), bins=200, histtype="step", log=True, label=label, density=True)
        ax.set(title=name, xlabel="value", ylabel="density (log)")
        ax.legend(fontsize=8)
    fig.suptitle(f"TP={world} all-reduce inputs of the demo model after {steps} steps (rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    save("histograms", rows, world=world, steps=steps,
         note="a Gaussian has kurtosis 3 and, over 256 samples, mean max/rms about 2.9")
    table(rows, ["tensor", "variant", "mean block max/rms", "kurtosis", "std"])
    print(f"wrote {path}")


# -----------------------------------------------------------------------------
# GPU timing

def cuda_time(fn, iters=20, warmup=3, before=None):
    """Median time in microseconds of fn() over `iters` runs, each bracketed by CUDA events
    (`before`, e.g. restoring an in-place input, runs outside the events)."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(iters):
        if before:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) * 1000 for a, b in times)
    return ts[len(ts) // 2]


def device_time(fn, iters=50, warmup=3):
    """Mean GPU microseconds per fn() when the runs go back to back: a sleep kernel holds the GPU
    while the host queues all of them, so launch and Python overhead do not count (kernel speed;
    cuda_time measures what a caller sees)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)                                  # ~25 ms at 2 GHz
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def host_time(fn, before=None, iters=20):
    """Median host-side microseconds to issue fn() (no device synchronisation inside): when this
    approaches the GPU time, the operation is bound by Python / launch overhead."""
    import time as _t
    ts = []
    for _ in range(iters):
        if before:
            before()
        torch.cuda.synchronize()
        t0 = _t.perf_counter()
        fn()
        ts.append((_t.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(ts)[len(ts) // 2]


def bench_kernels(codecs=("hint8", "taco", "hint6"), sizes_m=(1, 4, 16, 64, 256), tag="kernels"):
    """Fused compress / decompress / reduce-compress GB/s (bytes read + written) on bf16 input,
    next to a device-to-device copy (the ceiling) and the unfused PyTorch reference, same run."""
    taco.load_kernels()
    rows = []
    for m in sizes_m:
        n = m * 2 ** 20
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        t_copy = device_time(lambda: y.copy_(x))
        copy_gbs = 4 * n / t_copy / 1e3
        rows.append({"elements": f"{m}M", "op": "copy (ceiling)", "codec": "-", "us": f"{t_copy:.1f}",
                     "GB/s": f"{copy_gbs:.0f}", "% of copy": "100"})
        for name in codecs:
            cd = taco.get_codec(name)
            S = cd.nbytes(n)
            buf = cd.encode(x, 1, n)
            half = cd.encode(x, 2, n // 2)
            ops = [("compress", lambda: cd.encode(x, 1, n), 2 * n + S),
                   ("decompress", lambda: cd.decode(buf, n, n, torch.bfloat16, out=y), S + 2 * n),
                   ("reduce-compress P=2", lambda: cd.reduce_encode(half, n // 2), 3 * cd.nbytes(n // 2))]
            if m <= 64:
                ops.append(("compress, unfused torch", lambda: cd._encode_ref(x, 1, n), 2 * n + S))
            for op, fn, nbytes in ops:
                t = cuda_time(fn, iters=5) if "unfused" in op else device_time(fn)
                gbs = nbytes / t / 1e3
                rows.append({"elements": f"{m}M", "op": op, "codec": name, "us": f"{t:.1f}", "GB/s": f"{gbs:.0f}",
                             "% of copy": f"{100 * gbs / copy_gbs:.0f}"})
        del x, y
        torch.cuda.empty_cache()
    save(tag, rows, nvcc_flags=os.environ.get("TACO_NVCC_FLAGS", ""), note="GB/s = (bytes read + bytes written) / time; input bf16; time = mean GPU time of "
         "50 back-to-back runs (launch overhead hidden), the unfused reference: median of 5 single runs")
    table(rows, ["elements", "op", "codec", "us", "GB/s", "% of copy"])


def bench_collective(sizes_mb=(1, 4, 16, 64, 256), tag="nvlink"):
    """taco.all_reduce vs torch.distributed.all_reduce (NCCL, bf16) and, when the GPUs are peers
    (no NCCL_P2P_DISABLE), vs PyTorch's symmetric-memory bf16 two-shot, same run. Run under
    torchrun. Our all-reduce on both transports: "dist" (NCCL all_to_all + all_gather) and "symm"
    (peer reads from symmetric memory), the latter also replayed from a CUDA graph (no host
    overhead). algbw on LOGICAL bytes (the bf16 tensor), nccl-tests convention."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    taco.load_kernels()
    peers = os.environ.get("NCCL_P2P_DISABLE", "0") in ("", "0")
    group_name = dist.group.WORLD.group_name
    variants = [("nccl bf16", "none", "dist", 1), ("hint8", "hint8", "dist", 1), ("hint8", "hint8", "dist", 2),
                ("taco", "taco", "dist", 1), ("hint6", "hint6", "dist", 1)]
    if peers:
        variants = variants[:1] + [("symm bf16 two-shot", "none", "torch-symm", 1)] + variants[1:] + [
            ("hint8", "hint8", "symm", 1), ("taco", "taco", "symm", 1), ("hint6", "hint6", "symm", 1),
            ("hint8", "hint8", "symm-graph", 1), ("hint6", "hint6", "symm-graph", 1)]
    rows = []
    for mb in sizes_mb:
        n = mb * 2 ** 20 // 2
        gen = torch.Generator(device="cuda").manual_seed(rank)
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = torch.empty_like(src)
        exact = src.float()
        dist.all_reduce(exact)
        t_ref = {}
        for label, codec, transport, chunks in variants:
            target = x
            if transport == "torch-symm":                    # the input must live in symmetric memory
                import torch.distributed._symmetric_memory as symm_mem
                target = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
                symm_mem.rendezvous(target, group_name)
                run = lambda: torch.ops.symm_mem.two_shot_all_reduce_(target, "sum", group_name)
            elif codec == "none":
                run = lambda: dist.all_reduce(x)
            else:
                run = (lambda: taco.all_reduce(x, codec=codec, chunks=chunks,
                                               transport=transport.replace("-graph", "")))
            target.copy_(src)
            run()
            if transport == "symm-graph":                    # captured once (after the warm-up call above)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                run = graph.replay
                target.copy_(src)
                run()
            # every rank must hold the same bits, and the result must be close to the exact sum
            h = torch.stack([target.view(torch.int16).long().sum(),
                             (target.view(torch.int16).long() * 31).remainder(65521).sum()])
            hs = [torch.empty_like(h) for _ in range(world)]
            dist.all_gather(hs, h)
            identical = all(torch.equal(hs[0], o) for o in hs)
            err = ((target.float() - exact).norm() / exact.norm()).item()
            dist.barrier()
            t = cuda_time(run, iters=20, warmup=3, before=lambda: target.copy_(src))
            t = torch.tensor(t, device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)             # the slowest rank's median
            t = t.item()
            t_ref.setdefault(label, t)
            rows.append({"MB": mb, "variant": label, "transport": transport, "chunks": chunks, "us": f"{t:.0f}",
                         "host us": f"{host_time(run, lambda: target.copy_(src)):.0f}",
                         "algbw GB/s": f"{2 * n / t / 1e3:.0f}", "t": t,
                         "rel err": f"{err:.1e}", "identical": "yes" if identical else "NO"})
            del target
        # the two NCCL primitives the compressed all-reduce is made of, on hint8's byte counts
        S = taco.get_codec("hint8").nbytes(taco.get_codec("hint8").padded(-(-n // world)))
        send, recv = torch.zeros(world * S, dtype=torch.uint8, device="cuda"), torch.empty(world * S, dtype=torch.uint8, device="cuda")
        for label, fn in (("nccl all_to_all u8", lambda: dist.all_to_all_single(recv, send)),
                          ("nccl all_gather u8", lambda: taco._all_gather_flat(recv, send[:S]))):
            t = cuda_time(fn, iters=20, warmup=3)
            rows.append({"MB": mb, "variant": label, "transport": "dist", "chunks": 1, "us": f"{t:.0f}",
                         "host us": f"{host_time(fn):.0f}", "algbw GB/s": "-", "t": t, "rel err": "-",
                         "identical": "-"})
        for r in rows:                                       # speedups against this size's two baselines
            if r["MB"] == mb and "t" in r:
                t = r.pop("t")
                r["vs nccl"] = f"{t_ref['nccl bf16'] / t:.2f}x"
                r["vs symm bf16"] = f"{t_ref['symm bf16 two-shot'] / t:.2f}x" if peers and "u8" not in r["variant"] else "-"
        torch.cuda.synchronize()
    if rank == 0:
        save(f"collective_{tag}", rows, world=world, tag=tag,
             env_vars={k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE",
                                                      "TORCH_SYMM_MEM_DISABLE_MULTICAST")})
        print(f"\ncompressed all-reduce vs NCCL bf16 and symmetric-memory bf16, {world} GPUs, {tag}:")
        table(rows, ["MB", "variant", "transport", "chunks", "us", "host us", "algbw GB/s", "vs nccl", "vs symm bf16",
                     "rel err", "identical"])
    dist.destroy_process_group()


# -----------------------------------------------------------------------------
# end-to-end training throughput: the same config with each codec, one invocation

def bench_e2e(config, codecs, nproc, extra, tag="e2e", profile_steps=5):
    """Train `config` for a few steps once per TP codec (torchrun, nproc ranks), in this one
    invocation, and compare step time, tokens/s and MFU with the uncompressed run (the first codec
    should be none). An entry KEY=VALUE sets another train.py knob instead (e.g. pp_codec=hint8);
    KEY=VALUE/KEY=VALUE sets several. Steps before the second log line (warm-up, JIT, compile)
    are not timed: the figures are the mean of the later log lines' per-step times. On a GPU the
    last `profile_steps` steps are profiled (train.py --profile_steps: kernel time per step by
    kind) and left out of the timing."""
    import subprocess
    rows = []
    for codec in codecs:
        out = os.path.join("out", f"{tag}_{codec.replace('=', '-').replace('/', '_')}")
        settings = ([f"--{kv}" for kv in codec.split("/")] if "=" in codec else [f"--tp_codec={codec}"])
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "train.py", config,
               *settings, "--eval_interval=0", "--sample_tokens=0", "--progress=False",
               "--ckpt_interval=-1", f"--profile_steps={profile_steps}", *extra, f"--out_dir={out}"]
        print(" ".join(cmd), flush=True)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=int(os.environ.get("E2E_TIMEOUT", 900)))
        except subprocess.TimeoutExpired as e:                   # e.g. a hung collective: say so, go on
            p = subprocess.CompletedProcess(cmd, 124, (e.stdout or b"").decode(errors="replace"),
                                            (e.stderr or b"").decode(errors="replace") + "\nTIMEOUT")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "output.txt"), "w") as f:
            f.write(p.stdout + "\n" + p.stderr)
        if p.returncode != 0:                    # report the first rank's traceback, go on with the next entry
            lines = (p.stdout + "\n" + p.stderr).splitlines()
            first = next((i for i, l in enumerate(lines) if "Traceback" in l), max(0, len(lines) - 40))
            print(f"{codec}: train.py FAILED (exit {p.returncode}); {out}/output.txt has everything:\n"
                  + "\n".join(lines[first:first + 40]), flush=True)
            rows.append({"codec": codec, "ms/step": None, "failed": True})
            continue
        logs = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if '"ms"' in line]
        prof_path = os.path.join(out, "profile.json")
        prof = json.load(open(prof_path)) if os.path.exists(prof_path) else None
        if prof:                                             # the profiled steps are not timed
            logs = [r for r in logs if r["iter"] <= logs[-1]["iter"] - prof["steps"]]
        logs = logs[1:]
        if not logs:
            raise SystemExit(f"{codec}: too few steps to time; raise --max_iters or lower --log_interval")
        ms = sum(r["ms"] for r in logs) / len(logs)
        # tokens/s and MFU of the mean step (each log line's tok_s * ms is the step's tokens, its
        # mfu * ms the step's work: both constant), so that all three columns tell the same story
        last = logs[-1]
        mfu = last["mfu"] * last["ms"] / ms if last.get("mfu") is not None else None
        k = prof["kernel_ms_per_step"] if prof else {}
        rows.append({"codec": codec, "ms/step": round(ms, 2), "tok/s": round(last["tok_s"] * last["ms"] / ms),
                     "MFU %": round(mfu, 1) if mfu is not None else "-",
                     "compute ms": round(k.get("compute", 0), 1) if prof else "-",
                     "comm ms": round(sum(v for n, v in k.items() if n.startswith("comm")), 1) if prof else "-",
                     "codec ms": round(k.get("codec kernels", 0), 1) if prof else "-",
                     "tp wire MiB/step": round(logs[-1]["tp_wire_bytes"] / 2 ** 20, 2),
                     "loss": round(logs[-1]["loss"], 4), "profile": prof})
    base = rows[0]["ms/step"]
    for r in rows:
        r["speedup"] = f"{base / r['ms/step']:.2f}x" if base and r["ms/step"] else "FAILED"
    save(f"e2e_{tag}", rows, config=config, nproc=nproc, extra=extra,
         note="mean step time over the log lines after the first (profiled steps excluded); speedup = first "
              "entry's ms / this entry's ms; compute/comm/codec ms = GPU kernel time per step by kind in the "
              "profiled steps (streams overlap, so they need not add up to the step)")
    table(rows, ["codec", "ms/step", "speedup", "tok/s", "MFU %", "compute ms", "comm ms", "codec ms",
                 "tp wire MiB/step", "loss"])


# --- where a step's time goes: a kernel timeline (train.py --profile_trace=True) ----------------------

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
    import gzip
    from train import kernel_kind
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        ev = json.load(f)
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    ks = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    span = max(b for _, b, _ in ks) - min(a for a, _, _ in ks)
    by_kind = {}
    for a, b, name in ks:
        by_kind.setdefault(kernel_kind(name), []).append((a, b, name))
    compute = _merge([(a, b) for a, b, _ in by_kind.get("compute", [])])
    everything = _merge([(a, b) for a, b, _ in ks])
    ms = lambda us: us / 1000 / steps
    rows = [{"kind": "step (first to last kernel)", "kernel ms": f"{ms(span):.1f}", "busy ms": f"{ms(_length(everything)):.1f}",
             "beside compute": "-", "exposed": f"{ms(span - _length(everything)):.1f} idle"}]
    for kind, kv in sorted(by_kind.items()):
        busy = _merge([(a, b) for a, b, _ in kv])
        hidden = _length(_intersect(busy, compute)) if kind != "compute" else 0
        rows.append({"kind": kind, "kernel ms": f"{ms(sum(b - a for a, b, _ in kv)):.1f}",
                     "busy ms": f"{ms(_length(busy)):.1f}",
                     "beside compute": "-" if kind == "compute" else f"{ms(hidden):.1f}",
                     "exposed": "-" if kind == "compute" else f"{ms(_length(busy) - hidden):.1f}"})
    # codec kernels: alone vs beside a matmul (> half their time under a compute kernel)
    per = {}
    for a, b, name in by_kind.get("codec kernels", []):
        op = "reduce_encode" if "reduce_encode" in name else "encode" if "encode" in name else "decode"
        beside = _length(_intersect([[a, b]], compute)) > (b - a) / 2
        per.setdefault((op, beside), []).append(b - a)
    calls = [{"kernel": op, "beside compute": "yes" if beside else "no", "calls/step": len(v) // steps,
              "mean us": f"{sum(v) / len(v):.1f}"} for (op, beside), v in sorted(per.items())]
    return rows, calls


def bench_trace_report(paths, steps=2):
    for path in paths:
        rows, calls = trace_report(path, steps)
        print(f"\n{path} (ms per step; streams overlap):")
        table(rows, ["kind", "kernel ms", "busy ms", "beside compute", "exposed"])
        if calls:
            table(calls, ["kernel", "beside compute", "calls/step", "mean us"])


# -----------------------------------------------------------------------------
# a cost model of the TP communication in a training step, from the measured collectives

def interp_us(rows, variant, mb, transport="dist"):
    """All-reduce time (us) of `variant` (chunks=1, on `transport`) at `mb` MiB: log-log
    interpolation between the two measured sizes around it (results/collective_*.json)."""
    pts = sorted((r["MB"], float(r["us"])) for r in rows
                 if r["variant"] == variant and r["chunks"] == 1 and r.get("transport", "dist") == transport)
    (m0, t0), (m1, t1) = next(((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= mb <= b[0]), pts[-2:])
    return t0 * (t1 / t0) ** (math.log(mb / m0) / math.log(m1 / m0))


def bench_costmodel():
    """Predicted step time with a codec = measured uncompressed step - n x t_nccl(size) +
    n x t_codec(size), with n TP all-reduces per step of `size` MiB and the all-reduce times
    interpolated from the collective benchmark (results/collective_*.json), against the measured
    step. gpt2s (configs/gpt2s.py, eager): 50 all-reduces (4 per block x 12 + embedding + head)
    of 16 x 1024 x 768 bf16 = 24 MiB, steps from results/gpu/gpu_train.log. gpt1b
    (configs/gpt1b.py, compiled): 82 (4 x 20 + 2) of 8 x 2048 x 2048 bf16 = 64 MiB, steps from
    results/e2e_gpt1b_*.json (bench.py e2e)."""
    import re
    steps, key = {}, None                # (model, link, codec, transport) -> measured ms/step
    for line in open(os.path.join(RESULTS, "gpu", "gpu_train.log")):
        m = re.match(r"=== train gpt2s TP=2 tp_codec=(\S+) \((NVLink|NCCL_P2P_DISABLE=1)\)", line)
        if m:
            key = ("gpt2s", "nvlink" if m.group(2) == "NVLink" else "p2p_disabled", m.group(1), "dist")
        m = re.match(r"step\s+\d+ \| loss .*\|\s+([\d.]+) ms", line)
        if m and key:
            steps[key] = float(m.group(1))                   # the last timed log line of the run
    for link in ("nvlink", "p2p_disabled"):
        path = os.path.join(RESULTS, f"e2e_gpt1b_{link}.json")
        for r in json.load(open(path))["rows"] if os.path.exists(path) else []:
            codec, transport = r["codec"], "dist" if link == "p2p_disabled" else "symm"   # auto's choice
            if "tp_transport=dist" in codec:
                codec, transport = codec.split("/")[0].split("=")[1], "dist"
            if r.get("ms/step"):
                steps[("gpt1b", link, codec, transport if codec != "none" else "dist")] = r["ms/step"]
    rows = []
    for model, n_ar, mb in (("gpt2s", 50, 24), ("gpt1b", 82, 64)):
        for link in ("nvlink", "p2p_disabled"):
            base = steps.get((model, link, "none", "dist"))
            if base is None:
                continue
            coll = json.load(open(os.path.join(RESULTS, f"collective_{link}.json")))["rows"]
            t_nccl = interp_us(coll, "nccl bf16", mb)
            for (m, l, codec, transport), meas in sorted(steps.items()):
                if (m, l) != (model, link) or codec == "none":
                    continue
                t = interp_us(coll, codec, mb, transport)
                pred = base - n_ar * t_nccl / 1e3 + n_ar * t / 1e3
                rows.append({"model": model, "link": link, "codec": codec, "transport": transport,
                             "TP share (none)": f"{100 * n_ar * t_nccl / 1e3 / base:.0f}%",
                             "t_nccl us": round(t_nccl), "t_codec us": round(t), "none ms": base,
                             "predicted ms": round(pred, 1), "predicted speedup": f"{base / pred:.2f}x",
                             "measured ms": meas, "measured speedup": f"{base / meas:.2f}x"})
    save("costmodel", rows, note=bench_costmodel.__doc__)
    table(rows, ["model", "link", "codec", "transport", "TP share (none)", "t_nccl us", "t_codec us", "none ms",
                 "predicted ms", "predicted speedup", "measured ms", "measured speedup"])


# -----------------------------------------------------------------------------
# accuracy study: the paper's convergence comparisons at small scale, TP emulated on one GPU

STUDY = {   # group: (emulated TP degree, [(codec, block size)]); "none" is the uncompressed baseline
    "table1": (8, [("none", 256), ("taco", 256), ("tahquant", 256), ("hint8", 256)]),
    "fig11": (4, [("none", 256), ("fp8", 256), ("ds", 256), ("ash", 256), ("taco", 256)]),
    "fig13": (4, [("none", 256), ("hadamard", 256), ("taco", 256)]),
    "fig14": (4, [("none", 256), ("taco", 256), ("taco-e5m2", 256), ("taco-int8", 256)]),
    "table2": (4, [("none", 256)] + [("taco", b) for b in (32, 64, 128, 256, 512)]),
    "ours": (8, [("none", 256), ("taco", 256), ("hint8", 256), ("hint6", 256)]),
}
STUDY_FILE = os.environ.get("NANOTACO_STUDY_FILE", os.path.join(RESULTS, "study.json"))


def study_runs(groups):
    """The distinct (codec, block, TP, seed) runs of groups {name: seeds}, seed 0 of every run first."""
    runs = []
    for seed in range(max(groups.values())):
        for group, seeds in groups.items():
            t, cases = STUDY[group]
            runs += [(codec, block, t, seed) for codec, block in cases
                     if seed < seeds and (codec, block, t, seed) not in runs]
    return runs


def bench_study(groups, extra, jobs=1):
    """Train one run per (codec, block, seed) of the groups with train.py and configs/study.py,
    `jobs` at a time (round-robin over the visible GPUs: the study's model is small, so several
    runs share a GPU well), appending each finished run's loss curve and final losses to
    results/study.json. Runs already in the file (same key, same extra arguments) are skipped, so
    a study can span sessions and an interrupted one resumes where it stopped."""
    import subprocess
    root = next((a.split("=", 1)[1] for a in extra if a.startswith("--out_dir=")), os.path.join("out", "study"))
    extra = [a for a in extra if not a.startswith("--out_dir=")]
    done = json.load(open(STUDY_FILE)) if os.path.exists(STUDY_FILE) else {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")              # keep the caller's choice of GPUs
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    gpus = gpus if torch.cuda.device_count() else []
    todo = []
    for codec, block, t, seed in study_runs(groups):
        key = f"{codec}|B{block}|tp{t}|seed{seed}|{' '.join(extra)}"
        if key not in done:
            todo.append((key, codec, block, t, seed))
    print(f"study {','.join(groups)}: {len(todo)} runs to do, {jobs} at a time on "
          f"{len(gpus) or 'no'} GPU(s)", flush=True)
    running = []

    def finish(key, codec, block, t, seed, out, proc, t0, log):
        log.close()
        if proc.returncode != 0:
            tail = open(os.path.join(out, "stdout.txt")).read()[-2000:]
            print(f"FAILED ({proc.returncode}): {key}; {out}/stdout.txt ends:\n{tail}", flush=True)
            return
        rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
        evals = [r for r in rows if "val_loss" in r]
        done[key] = {"codec": codec, "block": block, "tp": t, "seed": seed, "extra": extra,
                     "seconds": round(time.time() - t0, 1), "env": environment(),
                     "curve": [(r["iter"], r["loss"]) for r in rows if "loss" in r],
                     "val": [(r["iter"], r["val_loss"]) for r in evals],
                     "final_val": evals[-1]["val_loss"], "final_train": evals[-1]["train_loss"]}
        with open(STUDY_FILE + ".tmp", "w") as f:           # cumulative; written after every run
            json.dump(done, f, indent=1)
        os.replace(STUDY_FILE + ".tmp", STUDY_FILE)
        print(f"done in {time.time() - t0:5.0f} s: {key} val {done[key]['final_val']:.4f}", flush=True)

    def reap(limit):
        """Record finished runs as they finish (in any order) until fewer than `limit` run."""
        while len(running) >= limit:
            time.sleep(1)
            for r in [r for r in running if r[6].poll() is not None]:
                running.remove(r)
                finish(*r)

    for i, (key, codec, block, t, seed) in enumerate(todo):
        reap(jobs)                                          # wait for a free slot
        out = os.path.join(root, key.replace("|", "_").replace(" ", "").replace("--", "")[:120])
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, "train.py", "configs/study.py", f"--tp_codec={codec}", f"--codec_block={block}",
               f"--tp_emulate={t}", f"--seed={seed}", *extra, f"--out_dir={out}"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        print(" ".join(cmd), flush=True)
        log = open(os.path.join(out, "stdout.txt"), "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        running.append((key, codec, block, t, seed, out, proc, time.time(), log))
    reap(1)                                                 # the rest, in the order they finish
    for group in groups:
        study_report(group, extra)


def bench_tp_real(tp, codecs, seeds, extra=()):
    """Issue 8's convergence check: the study's TP runs trained for real (torchrun, `tp` ranks, one
    TP group) instead of emulated on one rank; final validation loss next to the emulated run of
    the same codec and seed from results/study.json (when no extra arguments change the run), and
    each codec's paired change vs the uncompressed run of the same seed, real and emulated. Real
    and emulated TP need not agree to the bit (a TP matmul sums in another order), only within the
    seed-to-seed spread."""
    import subprocess
    done = json.load(open(STUDY_FILE)) if os.path.exists(STUDY_FILE) else {}
    rows = []
    for seed in range(seeds):
        for codec in codecs:
            out = os.path.join("out", f"tp{tp}_real", f"{codec}_seed{seed}")
            os.makedirs(out, exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}", "train.py",
                   "configs/study.py", f"--tp={tp}", f"--tp_codec={codec}", f"--seed={seed}", *extra,
                   f"--out_dir={out}"]
            print(" ".join(cmd), flush=True)
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if p.returncode != 0:
                print(f"{codec} seed {seed}: FAILED (exit {p.returncode}):\n{(p.stdout + p.stderr)[-2000:]}", flush=True)
                continue
            evals = [r for r in map(json.loads, open(os.path.join(out, "log.jsonl"))) if "val_loss" in r]
            emu = None if extra else done.get(f"{codec}|B256|tp{tp}|seed{seed}|")
            rows.append({"codec": codec, "seed": seed, "real val": round(evals[-1]["val_loss"], 4),
                         "emulated val": round(emu["final_val"], 4) if emu else "-"})
    base = {(r["seed"], k): r[k] for r in rows if r["codec"] == "none" for k in ("real val", "emulated val")}
    for r in rows:
        for k, d in (("real val", "real vs none"), ("emulated val", "emulated vs none")):
            b = base.get((r["seed"], k))
            ok = isinstance(r[k], float) and isinstance(b, float)
            r[d] = f"{100 * (r[k] / b - 1):+.2f}%" if ok else "-"
    save(f"tp{tp}_real", rows, extra=list(extra))
    table(rows, ["codec", "seed", "real val", "emulated val", "real vs none", "emulated vs none"])


def study_report(group, extra=()):
    """Final validation loss per codec: mean and spread over seeds, and the change vs the
    uncompressed baseline, both from the means and PAIRED (same seed: same initialisation and
    batches, so the seed-to-seed noise cancels; mean and range of the per-seed differences)."""
    t, runs = STUDY[group]
    done = json.load(open(STUDY_FILE))
    by = {}
    for r in done.values():
        if r["tp"] == t and r["extra"] == list(extra):
            by.setdefault((r["codec"], r["block"]), {})[r["seed"]] = r["final_val"]
    base = by.get(("none", 256), {})
    rows = []
    for codec, block in runs:
        v = by.get((codec, block))
        if not v:
            continue
        vals = list(v.values())
        mean = sum(vals) / len(vals)
        row = {"codec": codec, "B": block, "seeds": len(vals), "val loss": f"{mean:.4f}",
               "seed spread": f"{max(vals) - min(vals):.4f}" if len(vals) > 1 else "-",
               "vs none (means)": f"{100 * (mean / (sum(base.values()) / len(base)) - 1):+.2f}%" if base else "-"}
        paired = [100 * (v[s] / base[s] - 1) for s in v if s in base]
        row["paired"] = "-"
        if paired and codec != "none":
            row["paired"] = (f"{sum(paired) / len(paired):+.2f}% [{min(paired):+.2f}, {max(paired):+.2f}]"
                             if len(paired) > 1 else f"{paired[0]:+.2f}%")
        rows.append(row)
    print(f"\nstudy {group} (TP={t} emulated), {os.path.relpath(STUDY_FILE)}:")
    table(rows, ["codec", "B", "seeds", "val loss", "seed spread", "vs none (means)", "paired"])
    return rows


def plot_study(path=os.path.join(RESULTS, "study.png")):
    """Left: every run's final validation loss minus the baseline's of the same seed and TP, per
    codec (one dot per seed). Right: train-loss curves of the TP=8 runs, seed 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = json.load(open(STUDY_FILE))
    base = {(r["tp"], r["seed"]): r["final_val"] for r in done.values() if r["codec"] == "none"}
    labels = []
    for group, (t, runs) in STUDY.items():
        labels += [(t, c, b) for c, b in runs if c != "none" and (t, c, b) not in labels]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.4, 1]})
    ax = axes[0]
    for i, (t, c, b) in enumerate(labels):
        pts = [100 * (r["final_val"] / base[(t, r["seed"])] - 1) for r in done.values()
               if (r["tp"], r["codec"], r["block"]) == (t, c, b) and (t, r["seed"]) in base]
        ax.scatter([i] * len(pts), pts, color="C0" if t == 8 else "C1", s=18)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(labels)), [f"{c}{'' if b == 256 else f' B{b}'} TP{t}" for t, c, b in labels],
                  rotation=60, ha="right", fontsize=8)
    ax.set(ylabel="final val loss vs none, same seed (%)", title="Study: codec effect on final validation loss")
    ax.set_yscale("symlog", linthresh=1, linscale=3)
    ax.grid(alpha=0.3)
    ax = axes[1]
    ref = {(r["seed"]): dict(r["curve"]) for r in done.values() if r["tp"] == 8 and r["codec"] == "none"}
    for r in sorted(done.values(), key=lambda r: r["codec"]):
        if r["tp"] == 8 and r["codec"] != "none" and r["curve"] and r["seed"] in ref:
            pts = [(i, loss - ref[r["seed"]][i]) for i, loss in r["curve"] if i in ref[r["seed"]]]
            ax.plot(*zip(*pts), label=f"{r['codec']} seed {r['seed']}", lw=1,
                    color={"taco": "C3", "hint8": "C1", "hint6": "C2"}.get(r["codec"], "C4"),
                    ls=["-", "--", ":"][r["seed"] % 3])
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xlabel="step", ylabel="train loss minus none (same seed)", title="TP=8 emulated: the gap during training")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# -----------------------------------------------------------------------------
# plots

def plot_curves(path=os.path.join(RESULTS, "loss_curves.png")):
    """Loss curves: the CPU demo per codec (results/demo_<codec>.jsonl, copied from
    out/demo_<codec>/log.jsonl) and the GPU GPT-2-small runs (parsed from results/gpu/gpu_train.log)."""
    import re
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for codec in ("none", "hint8", "taco"):
        f = os.path.join(RESULTS, f"demo_{codec}.jsonl")
        if os.path.exists(f):
            rows = [json.loads(line) for line in open(f)]
            pts = [(r["iter"], r["loss"]) for r in rows if "loss" in r]
            axes[0].plot(*zip(*pts), label=f"tp_codec={codec}")
    axes[0].set(title="CPU demo: 7M GPT-2, TP=2 (gloo), Shakespeare", xlabel="step", ylabel="train loss")
    log = os.path.join(RESULTS, "gpu", "gpu_train.log")
    if os.path.exists(log):
        label, runs = None, {}
        for line in open(log):
            m = re.match(r"=== train gpt2s TP=2 (.*) \(\d", line)
            if m:
                label = m.group(1)
            m = re.match(r"step\s+(\d+) \| loss\s+([\d.]+)", line)
            if m and label:
                runs.setdefault(label, []).append((int(m.group(1)), float(m.group(2))))
        for label, pts in runs.items():
            axes[1].plot(*zip(*pts), marker=".", label=label)
    axes[1].set(title="GPT-2 small, TP=2 on 2xH200, bf16", xlabel="step", ylabel="train loss")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "codecs"
    if what == "codecs":
        bench_codecs()
    elif what == "kernels":
        # bench.py kernels [TAG [SIZES]]: e.g. kernels_k2 16,64,256 (millions of elements)
        sizes = tuple(int(m) for m in sys.argv[3].split(",")) if len(sys.argv) > 3 else (1, 4, 16, 64, 256)
        bench_kernels(tag=sys.argv[2] if len(sys.argv) > 2 else "kernels", sizes_m=sizes)
    elif what == "plot":
        plot_curves()
        plot_study()
    elif what == "histograms":
        bench_histograms()
    elif what == "study-report":
        for group in STUDY:
            study_report(group)
    elif what == "study":
        # python bench.py study GROUP[:SEEDS][,GROUP[:SEEDS]...] [SEEDS [JOBS]] [--train.py overrides ...]
        nums = [int(a) for a in sys.argv[3:] if not a.startswith("--")]
        seeds, jobs = (nums[0] if nums else 3), (nums[1] if len(nums) > 1 else 1)
        groups = {g.split(":")[0]: int(g.split(":")[1]) if ":" in g else seeds for g in sys.argv[2].split(",")}
        for group in groups:
            if group not in STUDY:
                raise SystemExit(f"unknown study group {group!r}: {', '.join(STUDY)}")
        bench_study(groups, [a for a in sys.argv[3:] if a.startswith("--")], jobs)
    elif what == "costmodel":
        bench_costmodel()
    elif what == "e2e":
        # python bench.py e2e CONFIG CODEC[,CODEC...] [NPROC] [TAG] [--train.py overrides ...]
        pos = [a for a in sys.argv[2:] if not a.startswith("--")]
        bench_e2e(pos[0], pos[1].split(","), int(pos[2]) if len(pos) > 2 else 2,
                  [a for a in sys.argv[2:] if a.startswith("--")], pos[3] if len(pos) > 3 else "e2e")
    elif what == "tp-real":          # bench.py tp-real TP CODECS SEEDS [--key=value ...]
        pos = [a for a in sys.argv[2:] if not a.startswith("--")]
        bench_tp_real(int(pos[0]), pos[1].split(","), int(pos[2]) if len(pos) > 2 else 1,
                      [a for a in sys.argv[2:] if a.startswith("--")])
    elif what == "collective":
        bench_collective(tag=sys.argv[2] if len(sys.argv) > 2 else "nvlink")
    elif what == "trace-report":     # bench.py trace-report STEPS TRACE [TRACE ...]  (train.py --profile_trace=True)
        bench_trace_report(sys.argv[3:], int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown benchmark {what!r}: codecs | kernels | collective | e2e | costmodel | plot | histograms | "
                         "study | study-report | tp-real | trace-report")
