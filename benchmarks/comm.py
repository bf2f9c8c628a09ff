"""The collectives under torchrun against NCCL and PyTorch's symmetric memory (collective), and whole
trainings side by side (e2e)."""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import taco
import taco_ext
from benchmarks.common import cuda_time, host_time, kernel_ms_by_kind, save, table

# -----------------------------------------------------------------------------
# the collective, against NCCL and PyTorch's symmetric-memory all-reduce


def _collective_variants(peers):
    """(label, codec, transport, chunks): NCCL's bf16 all-reduce first (the baseline)."""
    v = [
        ("nccl bf16", "none", "dist", 1),
        ("hint8", "hint8", "dist", 1),
        ("hint8", "hint8", "dist", 2),
        ("taco", "taco", "dist", 1),
        ("hint6", "hint6", "dist", 1),
    ]
    if peers:
        v = (
            v[:1]
            + [("symm bf16 two-shot", "none", "torch-symm", 1)]
            + v[1:]
            + [
                ("hint8", "hint8", "symm", 1),
                ("taco", "taco", "symm", 1),
                ("hint6", "hint6", "symm", 1),
                ("hint8", "hint8", "symm-graph", 1),
                ("hint6", "hint6", "symm-graph", 1),
            ]
        )
    return v


def _collective_runner(codec, transport, chunks, x, n):
    """(the tensor the all-reduce works on, a function running it once)."""
    if transport == "torch-symm":  # the input must live in symmetric memory
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        target = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(target, name)
        return target, lambda: torch.ops.symm_mem.two_shot_all_reduce_(target, "sum", name)
    if codec == "none":
        return x, lambda: dist.all_reduce(x)
    return x, lambda: taco.all_reduce(x, codec=codec, chunks=chunks, transport=transport.replace("-graph", ""))


def _time_collective(label, codec, transport, chunks, src, exact, world):
    """One row: correctness (every rank the same bits, error vs the exact sum), then the time."""
    target, run = _collective_runner(codec, transport, chunks, torch.empty_like(src), src.numel())
    target.copy_(src)
    run()
    if transport == "symm-graph":  # captured once (after the warm-up call above)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
        target.copy_(src)
        run()
    h = torch.stack(
        [target.view(torch.int16).long().sum(), (target.view(torch.int16).long() * 31).remainder(65521).sum()]
    )
    hs = [torch.empty_like(h) for _ in range(world)]
    dist.all_gather(hs, h)
    err = ((target.float() - exact).norm() / exact.norm()).item()
    dist.barrier()
    t = torch.tensor(cuda_time(run, iters=20, warmup=3, before=lambda: target.copy_(src)), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median
    return {
        "variant": label,
        "transport": transport,
        "chunks": chunks,
        "us": f"{t.item():.0f}",
        "host us": f"{host_time(run):.0f}",
        "t": t.item(),
        "algbw GB/s": f"{2 * src.numel() / t.item() / 1e3:.0f}",
        "rel err": f"{err:.1e}",
        "identical": "yes" if all(torch.equal(hs[0], o) for o in hs) else "NO",
    }


def bench_collective(sizes_mb=(1, 4, 16, 64, 256), tag="nvlink"):
    """taco.all_reduce vs torch.distributed.all_reduce (NCCL, bf16) and, when the GPUs are peers
    (no NCCL_P2P_DISABLE), vs PyTorch's symmetric-memory bf16 two-shot, same run, under torchrun.
    Ours on both transports ("dist": NCCL all-to-all + all-gather; "symm": peer reads), symm also
    replayed from a CUDA graph (no host overhead); NCCL's all-to-all and all-gather of hint8's
    bytes alone. algbw on LOGICAL bytes (the bf16 tensor), nccl-tests convention."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    taco_ext.load()
    peers = os.environ.get("NCCL_P2P_DISABLE", "0") in ("", "0")
    rows = []
    for mb in sizes_mb:
        n = mb * 2**20 // 2
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(rank))
        exact = src.float()
        dist.all_reduce(exact)
        these = [_time_collective(*v, src, exact, world) for v in _collective_variants(peers)]
        cd = taco.get_codec("hint8")
        S = cd.nbytes(cd.padded(-(-n // world)))
        send, recv = (torch.zeros(world * S, dtype=torch.uint8, device="cuda") for _ in range(2))
        for label, fn in (
            ("nccl all_to_all u8", lambda: dist.all_to_all_single(recv, send)),
            ("nccl all_gather u8", lambda: taco._all_gather_flat(recv, send[:S])),
        ):
            these.append(
                {
                    "variant": label,
                    "transport": "dist",
                    "chunks": 1,
                    "us": f"{cuda_time(fn):.0f}",
                    "host us": f"{host_time(fn):.0f}",
                }
            )
        base = {r["variant"]: r["t"] for r in these if "t" in r}
        for r in these:  # speedups against this size's two baselines
            r["MB"] = mb
            if "t" in r:
                t = r.pop("t")
                r["vs nccl"] = f"{base['nccl bf16'] / t:.2f}x"
                r["vs symm bf16"] = f"{base['symm bf16 two-shot'] / t:.2f}x" if peers else "-"
        rows += these
        torch.cuda.synchronize()
    if rank == 0:
        save(
            f"collective_{tag}",
            rows,
            world=world,
            tag=tag,
            env_vars={
                k: os.environ.get(k)
                for k in (
                    "NCCL_P2P_DISABLE",
                    "NCCL_SHM_DISABLE",
                    "NCCL_NVLS_ENABLE",
                    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                )
            },
        )
        print(f"\ncompressed all-reduce vs NCCL bf16 and symmetric-memory bf16, {world} GPUs, {tag}:")
        table(
            rows,
            [
                "MB",
                "variant",
                "transport",
                "chunks",
                "us",
                "host us",
                "algbw GB/s",
                "vs nccl",
                "vs symm bf16",
                "rel err",
                "identical",
            ],
        )
    dist.destroy_process_group()


# -----------------------------------------------------------------------------
# end-to-end training throughput: the same config with each codec, one invocation


def _e2e_row(entry, out):
    """The row of one trained entry: mean step time over the log lines after the first (the profiled
    steps excluded), tokens/s and MFU of that mean step, GPU kernel time per step by kind."""
    logs = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if '"ms"' in line]
    prof_path = os.path.join(out, "profile.json")
    prof = json.load(open(prof_path)) if os.path.exists(prof_path) else None
    if prof:
        logs = [r for r in logs if r["iter"] <= logs[-1]["iter"] - prof["steps"]]
    logs = logs[1:]
    if not logs:
        raise SystemExit(f"{entry}: too few steps to time; raise --max_iters or lower --log_interval")
    ms, last = sum(r["ms"] for r in logs) / len(logs), logs[-1]
    k = kernel_ms_by_kind(os.path.join(out, "trace_rank0.json.gz"), prof["steps"]) if prof else {}
    mfu = last["mfu"] * last["ms"] / ms if last.get("mfu") is not None else None
    return {
        "codec": entry,
        "ms/step": round(ms, 2),
        "tok/s": round(last["tok_s"] * last["ms"] / ms),
        "MFU %": round(mfu, 1) if mfu is not None else "-",
        "compute ms": round(k.get("compute", 0), 1) if prof else "-",
        "comm ms": round(sum(v for n, v in k.items() if n.startswith("comm")), 1) if prof else "-",
        "codec ms": round(k.get("codec kernels", 0), 1) if prof else "-",
        "tp wire MiB/step": round(last["tp_wire_bytes"] / 2**20, 2),
        "loss": round(last["loss"], 4),
        "peak GiB": round(last["peak_mem_gib"], 2) if last.get("peak_mem_gib") is not None else "-",
        "profile": {"kernel_ms_per_step": k, **(prof or {})},
    }


def bench_e2e(config, entries, nproc, extra, tag="e2e", profile_steps=5):
    """Train `config` once per entry (torchrun, nproc ranks), in this one invocation, and compare step
    time, tokens/s and MFU with the first entry (should be none). An entry is a TP codec, or
    KEY=VALUE[/KEY=VALUE...] train.py settings, or sol:fwd | sol:bwd | sol:all, the speed of light
    (lab/speed_of_light.py: those TP all-reduces skipped; timing only, the results are wrong). The
    peak GPU memory is the largest of any rank. On a GPU the last `profile_steps` steps are profiled
    (their kernel timeline gives the compute / comm / codec columns) and left out of the timing."""
    rows = []
    for entry in entries:
        out = os.path.join("out", f"{tag}_{entry.replace('=', '-').replace('/', '_')}")
        if entry.startswith("sol:"):  # the speed of light: lab.speed_of_light, TP all-reduces skipped
            entry_point, settings = ["-m", "lab.speed_of_light", entry[4:]], ["--tp_codec=none"]
        else:
            entry_point = ["train.py"]
            settings = [f"--{kv}" for kv in entry.split("/")] if "=" in entry else [f"--tp_codec={entry}"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            *entry_point,
            config,
            *settings,
            "--eval_interval=0",
            "--sample_tokens=0",
            "--progress=False",
            "--ckpt_interval=-1",
            f"--profile_steps={profile_steps if torch.cuda.is_available() else 0}",
            *extra,
            f"--out_dir={out}",
        ]
        print(" ".join(cmd), flush=True)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "output.txt"), "w") as f:  # everything train.py printed
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, timeout=int(os.environ.get("E2E_TIMEOUT", 900))
                ).returncode
            except subprocess.TimeoutExpired:  # e.g. a hung collective
                rc = "timeout"
        if rc != 0:  # say so with the first traceback, go on with the next entry
            lines = open(os.path.join(out, "output.txt")).read().splitlines()
            first = next((i for i, line in enumerate(lines) if "Traceback" in line), max(0, len(lines) - 40))
            print(f"{entry}: train.py FAILED ({rc}); {out}/output.txt:\n" + "\n".join(lines[first : first + 40]))
        rows.append(_e2e_row(entry, out) if rc == 0 else {"codec": entry, "ms/step": None, "failed": True})
    base = rows[0]["ms/step"]
    for r in rows:
        r["speedup"] = f"{base / r['ms/step']:.2f}x" if base and r["ms/step"] else "FAILED"
    save(
        f"e2e_{tag}",
        rows,
        config=config,
        nproc=nproc,
        extra=extra,
        note="mean step time over the log lines after the first (profiled steps excluded); speedup = first "
        "entry's ms / this entry's ms; compute/comm/codec ms = GPU kernel time per step by kind in the "
        "profiled steps (streams overlap, so they need not add up to the step)",
    )
    table(
        rows,
        [
            "codec",
            "ms/step",
            "speedup",
            "tok/s",
            "MFU %",
            "compute ms",
            "comm ms",
            "codec ms",
            "tp wire MiB/step",
            "peak GiB",
            "loss",
        ],
    )
