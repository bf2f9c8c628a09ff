"""The lab's tools and bench.py's plumbing, on CPU: the study runner, real TP next to emulated, the
end-to-end benchmark, the kernel timeline's analysis, the cost model, the run plots."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import benchmarks.common as bench
from lab import analysis, costmodel
from launcher import launch
from test_train import ROOT, TINY

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def sh(cmd, check=True, **env):
    """`python cmd` (a script or -m module: in the rank pool; -c code: a subprocess)."""
    if cmd[0] == "-c":
        p = subprocess.run(
            [sys.executable, *cmd], cwd=ROOT, env=dict(ENV, **env), capture_output=True, text=True, timeout=600
        )
    else:
        p = launch(cmd[1], cmd[2:], env=env) if cmd[0] == "-m" else launch(cmd[0], cmd[1:], env=env)
    assert p.returncode == 0 or not check, p.stdout[-2000:] + p.stderr[-2000:]
    return p


def test_interp_us_is_log_log_and_per_transport():
    rows = [
        {"MB": mb, "variant": "hint8", "chunks": 1, "transport": tr, "us": str(us)}
        for tr, scale in (("dist", 100), ("symm", 50))
        for mb, us in ((1, scale), (4, 4 * scale), (16, 8 * scale))
    ]
    assert costmodel.interp_us(rows, "hint8", 2) == pytest.approx(200)  # t ~ MB between 1 and 4
    assert costmodel.interp_us(rows, "hint8", 2, "symm") == pytest.approx(100)
    assert costmodel.interp_us(rows, "hint8", 8) == pytest.approx(400 * 2**0.5)  # t ~ sqrt(MB) between 4 and 16


def test_costmodel_from_the_committed_gpu_results(tmp_path):
    """lab.costmodel on the recorded 2-GPU results: the rows that fit gamma come out exact, the
    W=2 fits go through their two measured points, W scales the bytes by 2(W-1)/W, and each
    prediction's range holds its central value."""
    for f in os.listdir(os.path.join(ROOT, "results")):
        if f.startswith(("collective_", "e2e_gpt1b", "kernels.json")):
            shutil.copy(os.path.join(ROOT, "results", f), tmp_path)
    sh(["-m", "lab.costmodel"], NANOTACO_RESULTS=str(tmp_path))
    out = json.load(open(tmp_path / "costmodel.json"))
    fits = [r for r in out["checks"] if r["role"] != "check"]
    assert len(fits) == 2 and all(r["error"] in ("+0.0%", "-0.0%") for r in fits)
    assert len([r for r in out["checks"] if r["role"] == "check"]) >= 6
    coll = json.load(open(tmp_path / "collective_p2p_disabled.json"))["rows"]
    fit = costmodel.fit_link(coll, "nccl bf16", "dist")
    for mb in (64, 256):
        assert costmodel.t_at(fit, mb, 2, 1.0) == pytest.approx(costmodel.interp_us(coll, "nccl bf16", mb))
    a = fit[0]
    assert costmodel.t_at(fit, 64, 8, 1.0) - a == pytest.approx((costmodel.t_at(fit, 64, 2, 1.0) - a) * 7 / 4)
    assert {(r["TP"], r["link"]) for r in out["rows"]} == {
        (4, "nvlink"),
        (8, "nvlink"),
        (4, "p2p_disabled"),
        (8, "p2p_disabled"),
    }
    for r in out["rows"]:
        lo, hi = (float(x) for x in r["range"].rstrip("x").split("-"))
        assert lo <= float(r["speedup"].rstrip("x")) <= hi


def timeline(tmp_path):
    """A hand-made timeline (ms): compute 0-10 and 20-30; an encode 5-15 (half of it beside compute),
    a decode 12-16 and an NCCL kernel 40-50 (alone); nothing runs 16-20 and 30-40."""
    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts * 1000, "dur": dur * 1000}
    ev = [
        k("gemm", 0, 10),
        k("gemm", 20, 10),
        k("void encode_kernel<1>", 5, 10),
        k("void decode_kernel<1>", 12, 4),
        k("ncclDevKernel_SendRecv", 40, 10),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return str(path)


def test_trace_report_splits_hidden_and_exposed_time(tmp_path):
    path = timeline(tmp_path)
    rows, calls = analysis.trace_report(path, steps=1)
    by = {r["kind"]: r for r in rows}
    assert (by["step (first to last kernel)"]["kernel ms"], by["step (first to last kernel)"]["exposed"]) == (
        "50.0",
        "14.0 idle",
    )
    assert (by["codec kernels"]["kernel ms"], by["codec kernels"]["busy ms"]) == ("14.0", "11.0")  # 5-16 busy
    assert (by["codec kernels"]["beside compute"], by["codec kernels"]["exposed"]) == ("5.0", "6.0")
    assert (by["comm: nccl"]["beside compute"], by["comm: nccl"]["exposed"]) == ("0.0", "10.0")
    assert by["compute"]["busy ms"] == "20.0"
    # per kernel: "beside compute" needs more than half of it under a compute kernel (the encode has half)
    assert {(c["kernel"], c["beside compute"], c["mean us"]) for c in calls} == {
        ("encode", "no", "10000.0"),
        ("decode", "no", "4000.0"),
    }
    rows, calls = analysis.trace_report(path, steps=2)  # per step
    assert {r["kind"]: r for r in rows}["compute"]["kernel ms"] == "10.0"


def test_kernel_time_by_kind_from_a_trace(tmp_path):
    """bench.py e2e's compute / comm / codec columns: GPU time per step by kernel kind."""
    assert bench.kernel_ms_by_kind(timeline(tmp_path), steps=2) == pytest.approx(
        {"compute": 10.0, "codec kernels": 7.0, "comm: nccl": 5.0}
    )
    names = [
        "sm90_xmma_gemm_bf16bf16_bf16f32",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
        "void (anonymous namespace)::reduce_encode_kernel(TacoMsgs, int)",
        "void c10d::symmetric_memory::barrier_kernel(unsigned int**)",
        "void c10d::symmetric_memory::two_shot_all_reduce_kernel<c10::BFloat16, 2>(...)",
        "Memcpy DtoD (Device -> Device)",
    ]
    assert [bench.kernel_kind(n) for n in names] == [
        "compute",
        "comm: nccl",
        "codec kernels",
        "comm: symm barrier",
        "comm: symm two-shot",
        "memcpy/memset",
    ]


def test_overlap_bound_takes_each_kernels_cheapest_sm_time():
    """Matmul 100 us on 132 SMs (13,200 SM-us) or 110 us on 122 (13,420); codec 50 us on 132 (6,600)
    or 400 us on 10 (4,000): at least (13,200 + 4,000) / 132 us on split SMs."""
    row = lambda variant, us: {
        "shape": "s",
        "codec": "c",
        "matmul alone us": "100.0",
        "codec alone us": "50.0",
        "variant": variant,
        "pair us": str(us),
    }
    rows = [
        row("one after the other", 150),
        row("codec first", 140),
        row("matmul first", 145),
        row("alone: codec on 10 SMs (green context)", 400),
        row("alone: matmul, all but 10 SMs (cuBLASLt)", 110),
    ]
    (r,) = analysis.overlap_bound(rows)
    assert r["bound us"] == f"{(13200 + 4000) / 132:.1f}" and r["bound vs matmul"] == "1.30x"
    assert (r["best pair us"], r["best vs matmul"]) == ("140.0", "1.40x")


@pytest.mark.slow
def test_study_runner_is_cumulative(tmp_path):
    """lab.study run: one emulated-TP run per codec, two at a time, appended to the study file; a
    second invocation finds them all done and only reports."""
    tiny = [
        "--dataset=small",
        "--max_iters=2",
        "--n_layer=1",
        "--n_head=4",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=2",
        "--eval_interval=2",
        "--eval_iters=1",
        "--warmup_iters=1",
        "--lr_decay_iters=2",
        "--log_interval=1",
        f"--out_dir={tmp_path}/runs",
    ]
    cmd = ["-m", "lab.study", "run", "fig13", "--seeds=1", "--jobs=2", "--", *tiny]
    sh(cmd, NANOTACO_STUDY_FILE=str(tmp_path / "study.json"))
    runs = json.load(open(tmp_path / "study.json"))
    assert sorted(r["codec"] for r in runs.values()) == ["hadamard", "none", "taco"]
    assert all(r["tp"] == 4 and len(r["curve"]) == 2 for r in runs.values())
    second = sh(cmd, NANOTACO_STUDY_FILE=str(tmp_path / "study.json"))
    assert "lab.emulate" not in second.stdout and "vs none" in second.stdout


@pytest.mark.slow
def test_graph_runs_are_keyed_apart_from_eager_ones(tmp_path):
    """lab.study run --graph does not count the eager runs as done (replay is not bit-identical to
    eager), and report shows eager runs unless asked for the graph ones."""
    from lab.study import study_key

    rec = lambda codec, val, extra: {
        "codec": codec,
        "block": 256,
        "tp": 4,
        "seed": 0,
        "extra": extra,
        "config": "configs/study.py",
        "final_val": val,
        "curve": [],
        "val": [],
    }
    runs = {
        study_key("none", 256, 4, 0, "configs/study.py", ()): rec("none", 5.0, []),
        study_key("taco", 256, 4, 0, "configs/study.py", ()): rec("taco", 5.05, []),
        study_key("none", 256, 4, 0, "configs/study.py", ["--graph"]): rec("none", 6.0, ["--graph"]),
        study_key("taco", 256, 4, 0, "configs/study.py", ["--graph"]): rec("taco", 6.3, ["--graph"]),
    }
    path = tmp_path / "study.json"
    path.write_text(json.dumps(runs))
    eager, graph = (
        sh(["-m", "lab.study", "report", *flag], NANOTACO_STUDY_FILE=str(path)).stdout for flag in ((), ("--graph",))
    )
    assert "+1.00%" in eager and "+5.00%" not in eager
    assert "+5.00%" in graph and "+1.00%" not in graph
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "lab.study",
            "run",
            "fig13",
            "--seeds=1",
            "--graph",
            "--",
            "--dataset=small",
            f"--out_dir={tmp_path}/runs",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(ENV, NANOTACO_STUDY_FILE=str(path)),
    )
    assert "3 runs to do" in p.stdout and p.returncode != 0  # on CPU the graph runs are refused


@pytest.mark.slow
def test_study_variants_compress_part_of_the_all_reduces(tmp_path):
    """lab.study's attribution labels: "codec@fwd|bwd|SITES" become lab.emulate's arguments, and
    runs of a group with another config are keyed apart from the first study's."""
    from lab.study import STUDY, confidence_interval, study_key, variant_args

    assert confidence_interval([1.0, 2.0, 3.0]) == pytest.approx((2 - 4.303 / 3**0.5, 2 + 4.303 / 3**0.5))
    assert variant_args("hint8") == ["--tp_codec=hint8"]
    assert variant_args("hint8@fwd") == ["--tp_codec=hint8", "--tp_codec_bwd=none"]
    assert variant_args("taco@bwd") == ["--tp_codec=none", "--tp_codec_bwd=taco"]
    assert variant_args("hint6@noembed") == ["--tp_codec=hint6", "--tp_codec_embed=none"]
    assert variant_args("hint8@attn=hint6,mlp") == ["--sites=attn=hint6,mlp", "--tp_codec=hint8"]
    assert study_key("none", 256, 8, 0, "configs/study.py", ()) == "none|B256|tp8|seed0|"
    assert study_key("none", 256, 8, 0, "configs/study_long.py", ()) == "none|B256|tp8|seed0||study_long.py"
    assert all(os.path.exists(os.path.join(ROOT, cfg)) for _, _, cfg in STUDY.values())
    tiny = [
        "--dataset=small",
        "--max_iters=2",
        "--n_layer=1",
        "--n_head=8",
        "--n_embd=64",
        "--block_size=32",
        "--batch_size=2",
        "--eval_interval=2",
        "--eval_iters=1",
        "--warmup_iters=1",
        "--lr_decay_iters=2",
        f"--out_dir={tmp_path}/runs",
    ]
    out = sh(
        ["-m", "lab.study", "run", "attrib", "--seeds=1", "--", *tiny], NANOTACO_STUDY_FILE=str(tmp_path / "s.json")
    )
    runs = json.load(open(tmp_path / "s.json"))
    assert len(runs) == 9 and all(r["config"] == "configs/study_long.py" for r in runs.values())
    assert "--sites=mlp configs/study_long.py --tp_codec=taco" in out.stdout
    final = {r["codec"]: r["final_val"] for r in runs.values()}
    assert final["hint8@fwd"] != final["hint8@bwd"] != final["none"]


@pytest.mark.slow
def test_forks_continue_the_base_run_exactly(tmp_path):
    """lab.study fork: a "none" fork at TP=1 from step 4 ends where the base run trained straight to
    step 7 ends, bit for bit (same batches, schedule, optimizer state); a codec's fork differs, and
    is the same after another fork in the process as alone; a second invocation finds every fork done."""
    tiny = [
        "--dataset=small",
        "--device=cpu",
        "--n_layer=1",
        "--n_head=4",
        "--n_embd=64",
        "--block_size=32",
        "--batch_size=2",
        "--eval_iters=2",
        "--warmup_iters=1",
        "--lr_decay_iters=12",
    ]
    env = dict(NANOTACO_FORK_FILE=str(tmp_path / "fork.json"))
    cmd = ["-m", "lab.study", "fork", "hint8", "--starts=4", "--steps=3", "--tp=1", f"--out={tmp_path}/f", "--", *tiny]
    sh(cmd, **env)
    sh(
        [
            "train.py",
            "configs/study_long.py",
            *tiny,
            "--max_iters=7",
            "--eval_interval=7",
            "--tp_codec=none",
            f"--out_dir={tmp_path}/straight",
        ]
    )
    straight = [r for r in map(json.loads, open(tmp_path / "straight" / "log.jsonl")) if "val_loss" in r][-1]
    forks = {r["label"]: r for r in json.load(open(tmp_path / "fork.json")).values()}
    assert forks["none"]["val"] == straight["val_loss"] and forks["none"]["train"] == straight["train_loss"]
    assert forks["hint8"]["val"] != forks["none"]["val"] and forks["hint8"]["start"] == 4
    again = sh(cmd, **env)
    assert "in one process" not in again.stdout and "hint8 |      1 | " in again.stdout
    # a fork is the same run whether it follows others in the process or runs alone
    runs = json.load(open(tmp_path / "fork.json"))
    (tmp_path / "fork.json").write_text(json.dumps({k: r for k, r in runs.items() if r["label"] == "none"}))
    sh(cmd, **env)
    alone = {r["label"]: r for r in json.load(open(tmp_path / "fork.json")).values()}["hint8"]
    assert (alone["val"], alone["train"]) == (forks["hint8"]["val"], forks["hint8"]["train"])


@pytest.mark.slow
def test_site_errors_split_the_gradient_error(tmp_path):
    """lab.analysis sites, briefly: compressing only the backward cannot change the loss; the
    forward/backward and the attention/MLP/embedding+head splits each account for roughly the
    whole error (errors add in squares when independent)."""
    sh(
        ["-c", "from lab.analysis import site_errors; site_errors(('hint8',), steps=2, batches=1)"],
        NANOTACO_RESULTS=str(tmp_path),
    )
    rows = {r["compressed"]: r for r in json.load(open(tmp_path / "sites.json"))["rows"]}
    share = lambda *parts: sum(float(rows[p]["share"]) for p in parts)
    assert rows["all"]["share"] == "1.00" and rows["all"]["all-reduces"] == 18
    assert rows["all but the embedding"]["all-reduces"] == 17
    assert float(rows["backward"]["loss change"]) == 0 and float(rows["LM head (bwd)"]["loss change"]) == 0
    assert 0.6 < share("forward", "backward") < 1.6 and 0.6 < share("attention", "MLP", "embedding + head") < 1.6
    assert all(float(r["grad rel err"]) > 0 for r in rows.values())


def test_emulation_refuses_what_it_cannot_emulate():
    p = sh(["-m", "lab.emulate", "2", "--taco_chunks=2", *TINY], check=False)
    assert p.returncode != 0 and "tp=1, pp=1, taco_chunks=1" in p.stdout + p.stderr
    p = sh(["-m", "lab.emulate", "2", "--graph", *TINY], check=False)
    assert p.returncode != 0 and "--graph needs a CUDA GPU" in p.stdout + p.stderr
    if not torch.cuda.is_available():
        for what in ("overlap", "host"):
            p = sh(["bench.py", what], check=False)
            assert p.returncode != 0 and "needs a CUDA GPU" in p.stderr


@pytest.mark.slow
def test_tp_real_runs_real_tp_next_to_the_study(tmp_path):
    """lab.study tp-real, at TP=2 on CPU with a tiny model: one run per codec, the paired change vs
    the uncompressed run of the same seed."""
    sh(
        [
            "-m",
            "lab.study",
            "tp-real",
            "2",
            "none,hint8",
            "--",
            "--dataset=small",
            "--device=cpu",
            "--max_iters=4",
            "--eval_interval=4",
            "--warmup_iters=1",
            "--lr_decay_iters=4",
            *TINY,
            f"--out_dir={tmp_path}/runs",
        ],
        NANOTACO_RESULTS=str(tmp_path),
    )
    rows = json.load(open(tmp_path / "tp2_real.json"))["rows"]
    assert [(r["codec"], r["seed"]) for r in rows] == [("none", 0), ("hint8", 0)]
    assert rows[0]["real vs none"] == "+0.00%" and rows[1]["real vs none"] != "-"
    assert all(r["emulated val"] == "-" for r in rows)  # extra arguments: no study run to compare with
    assert abs(rows[1]["real val"] / rows[0]["real val"] - 1) < 0.05


def test_curves_plot_train_and_validation_loss_into_the_runs_out_dir(tmp_path):
    """The README's curves command: a run's out_dir in, out_dir/curves.png out, with the train loss
    at every log line and the validation loss at every evaluation."""
    out = tmp_path / "run"
    sh(["train.py", *TINY, "--max_iters=6", "--eval_interval=3", f"--out_dir={out}"])
    sh(["-m", "lab.analysis", "curves", str(out)])
    assert os.path.getsize(out / "curves.png") > 10000
    assert analysis.curves([str(out)], str(tmp_path / "again.png")) == [("run train", 6), ("run val", 2)]


@pytest.mark.slow
def test_e2e_benchmark_runs_every_entry_in_one_invocation(tmp_path):
    """bench.py e2e: one training per entry, same invocation, a table with the speedup column (on CPU
    the times mean nothing: the GPU results are in results/e2e_*.json); then lab.analysis curves
    plots their logs."""
    sh(
        [
            "bench.py",
            "e2e",
            "configs/demo.py",
            "none,hint8,tp_codec=taco/tp_transport=dist,sol:all",
            "--nproc=2",
            "--tag=cputest",
            "--",
            "--max_iters=4",
            "--log_interval=1",
            "--pp=1",
            "--gradient_accumulation_steps=1",
            "--n_layer=1",
            "--n_embd=32",
            "--n_head=2",
            "--block_size=32",
            "--batch_size=2",
        ],
        NANOTACO_RESULTS=str(tmp_path),
    )
    res = json.load(open(tmp_path / "e2e_cputest.json"))
    assert [r["codec"] for r in res["rows"]] == ["none", "hint8", "tp_codec=taco/tp_transport=dist", "sol:all"]
    assert res["rows"][0]["speedup"] == "1.00x"
    for r in res["rows"][1:3]:
        assert r["tp wire MiB/step"] < res["rows"][0]["tp wire MiB/step"] / 3.5  # fp32 -> ~1 byte
    assert res["rows"][3]["tp wire MiB/step"] == 0 and res["rows"][3]["peak GiB"] == "-"  # skipped; no GPU
    assert res["rows"][1]["loss"] != res["rows"][2]["loss"]  # hint8 vs taco: both ran
    logs = [os.path.join(ROOT, "out", f"cputest_{e}", "log.jsonl") for e in ("none", "hint8")]
    sh(["-m", "lab.analysis", "curves", *logs, f"--out={tmp_path}/curves.png"])
    assert os.path.getsize(tmp_path / "curves.png") > 10000


@pytest.mark.slow
def test_speed_of_light_skips_the_tp_all_reduces(tmp_path):
    """lab.speed_of_light: with `all` no TP all-reduce puts a byte on the wire (the losses are
    wrong: each rank trains on its partial sums); with `fwd` only the backward ones remain; the
    all-reduces of a block part with its own codec (tp_codec_attn) are skipped too."""
    from test_train import TINY, losses, run

    common = TINY + ["--tp=2", "--max_iters=2", "--eval_interval=0"]
    wire = {}
    for name, which, extra in (
        ("all", "all", []),
        ("fwd", "fwd", []),
        ("sites", "all", ["--tp_codec=hint8", "--tp_codec_attn=hint6"]),
    ):
        p = run([which, *common, *extra, f"--out_dir={tmp_path / name}"], nproc=2, module="lab.speed_of_light")
        assert "SPEED OF LIGHT" in p.stdout
        with open(tmp_path / name / "log.jsonl") as f:
            wire[name] = [r["tp_wire_bytes"] for r in map(json.loads, f) if "loss" in r]
    run(common + [f"--out_dir={tmp_path / 'real'}"], nproc=2)
    assert wire["all"] == wire["sites"] == [0, 0] and all(w > 0 for w in wire["fwd"])
    assert losses(str(tmp_path / "all"))[0][1] != losses(str(tmp_path / "real"))[0][1]


def test_peer_profile_sums_kernels_by_kind_and_name(tmp_path):
    """lab.peer_profile: per profiled step, by kind and by name (template arguments and Triton's
    running number dropped, so two compiles' kernels match); busy time counts overlap once."""
    from lab import peer_profile

    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts * 1000, "dur": dur * 1000}
    ev = [
        k("sm90_xmma_gemm_bf16", 0, 10),
        k("triton_red_fused__log_softmax_3", 5, 10),
        k("triton_red_fused__log_softmax_7", 30, 5),
        k("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", 40, 10),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    kinds, names, busy, span = peer_profile.per_step(str(path))
    S = peer_profile.STEPS
    assert kinds == pytest.approx({"matmul": 10 / S, "loss": 15 / S, "optimizer": 10 / S})
    assert names["triton_red_fused__log_softmax"] == pytest.approx(15 / S)
    assert names["void multi_tensor_apply_kernel"] == pytest.approx(10 / S)
    assert (busy, span) == pytest.approx((30 / S, 50 / S))  # 0-15, 30-35, 40-50 busy
    assert peer_profile.kind("void at::native::lpnorm_cleanup<float>") == "norm, clip (foreach)"


@pytest.mark.parametrize(
    "start,limit,found,tried",
    [
        (18, 20, (20, 21), [18, 19, 20, 21]),  # up from an estimate that runs, to the first that does not
        (34, 33, (33, 34), [34, 33]),  # down from one that does not, to the first that runs
        (34, 31, (31, 32), [34, 33, 32, 31]),
        (10, 30, (13, None), [10, 11, 12, 13]),  # the probes ran out: no failure seen
        (10, 2, (None, 7), [10, 9, 8, 7]),
        (1, 0, (None, 1), [1]),  # never below one sequence
    ],
)
def test_fit_search_finds_the_largest_batch_that_runs_one_batch_at_a_time(start, limit, found, tried):
    """bench.py fit's search, each probe a stand-in for a process that trains (batch <= limit) or runs out of
    memory: (the largest batch that ran, the smallest that did not), None where four probes did not reach it."""
    from benchmarks.models import largest_batch

    calls = []
    assert largest_batch(lambda b: calls.append(b) or b <= limit, start) == found
    assert calls == tried


def test_fit_records_each_trainers_largest_batch_and_stops_on_a_probe_that_neither_ran_nor_ran_out(
    tmp_path, monkeypatch
):
    """bench_fit over stand-in probe processes: each prints the ROW line trains_within prints (ran or out of
    memory at batch <= 5); the file holds each trainer's row; a probe that crashed is an error naming it."""
    import benchmarks.models as bm

    def probe(cmd, **kw):
        trainer, batch = cmd[5], int(cmd[6])
        if trainer == "broken":
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback\nImportError: no liger_kernel")
        row = [True, 10.0 + batch] if batch <= 5 else [False, None]
        return subprocess.CompletedProcess(cmd, 0, "compiling\nROW " + json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench, "RESULTS", str(tmp_path))
    monkeypatch.setattr(bm.subprocess, "run", probe)
    bm.bench_fit("configs/qwen2_5_0_5b.py", 80, ["ours:6", "transformers:3"], tag="t")
    saved = json.load(open(tmp_path / "fit_t.json"))
    assert [(r["model"], r["largest batch that ran"], r["peak GiB there"], r["smallest that did not"])
            for r in saved["rows"]] == [("ours", 5, 15.0, 6), ("transformers", 5, 15.0, 6)]  # fmt: skip
    assert saved["gib"] == 80 and "versions" in saved
    with pytest.raises(RuntimeError, match="broken at batch 2: rc 1: ImportError: no liger_kernel"):
        bm.bench_fit("configs/qwen2_5_0_5b.py", 80, ["broken:2"])


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_recompute_keeps_less_for_the_backward(family):
    """What a forward keeps for the backward, counted two ways: autograd's saved tensors alone (a hook
    here) and lab.memory's count (also the inputs each checkpoint keeps); both fall with recompute=pointwise,
    with mlp and again with block (that the results are the same: tests/test_parallel.py)."""
    import dataclasses

    from lab import memory
    from model import GPT, RECOMPUTE, GPTConfig

    mc = GPTConfig(family=family, vocab_size=96, n_layer=2, n_head=2, n_embd=16, block_size=16)
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    saved = {}
    for r in RECOMPUTE:
        model, sizes = GPT(dataclasses.replace(mc, recompute=r), seed=0), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            model(x, x)[1].backward()
        saved[r] = sum(sizes)
    assert saved[""] > saved["pointwise"] and saved[""] > saved["mlp"] > saved["block"], saved
    counted = dict(zip(RECOMPUTE, (memory.kept_for_backward(mc, r, 2, 16) for r in RECOMPUTE)))
    assert counted[""] > counted["pointwise"] and counted[""] > counted["mlp"] > counted["block"] > 0, counted


def test_live_at_peak_replays_an_allocator_trace_to_its_peak_and_sums_by_book_line():
    """lab.memory's replay of a CUDA allocator trace: the peak is where the bytes allocated are most (a
    free of a block from before the trace lowers them), the blocks live there summed by the innermost
    frame in a book file, largest first; blocks freed before the peak are not in it."""
    from lab.memory import live_at_peak

    def frames(*where):
        return [{"filename": f"/x/{f}", "line": n, "name": fn} for f, n, fn in where]

    head = frames(("_ops.py", 1, "call"), ("model.py", 274, "loss"), ("train.py", 9, "step"))
    block = frames(("model.py", 170, "forward"), ("model.py", 500, "forward"))
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": block},
        {"action": "alloc", "addr": 2, "size": 100, "frames": block},
        {"action": "alloc", "addr": 3, "size": 50, "frames": frames(("site.py", 3, "x"))},
        {"action": "free_completed", "addr": 3, "size": 50},
        {"action": "free_completed", "addr": 99, "size": 80},  # allocated before the trace
        {"action": "alloc", "addr": 4, "size": 300, "frames": head},
        {"action": "alloc", "addr": 5, "size": 7, "frames": frames(("site.py", 3, "x"))},
        {"action": "free_completed", "addr": 4, "size": 300},
        {"action": "alloc", "addr": 6, "size": 200, "frames": head},
    ]
    peak, lines = live_at_peak(trace, root="/x")
    assert peak == 100 + 100 - 80 + 300 + 7
    assert lines == [("model.py:274 loss", (1, 300)), ("model.py:170 forward", (2, 200)), ("elsewhere", (1, 7))]


@pytest.mark.parametrize("family, linears", [pytest.param("gpt2", 4, marks=pytest.mark.slow), ("qwen2", 5)])
def test_compiled_backward_makes_the_weights_bf16_copies_again(monkeypatch, family, linears):
    """Under bf16 autocast, compiled with min-cut partitioning (as inductor partitions), the forward keeps no bf16
    copy of a block's weight for the backward (recompute.autocast_weight), SwiGLU's two halves of one weight included;
    without the mark it keeps one per matmul."""
    import model
    import recompute

    def copies_kept():
        mc = model.GPTConfig(family=family, vocab_size=96, n_layer=2, n_head=2, n_embd=64, block_size=32)
        m = model.GPT(mc, seed=0)
        shapes = {tuple(p.shape) for name, p in m.named_parameters() if name.startswith("h.") and p.dim() == 2}
        shapes |= {(mc.intermediate_size, mc.n_embd)}  # SwiGLU's gate and up: halves of fc's weight
        x, kept = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0)), []
        step = torch.compile(m, backend="aot_eager_decomp_partition")
        keep = lambda t: kept.append(t) or t
        with torch.autocast("cpu", torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = step(x, x)[1]
        loss.backward()
        return [t.shape for t in kept if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes]

    assert copies_kept() == []
    monkeypatch.setattr(recompute, "autocast_weight", lambda w: w)
    assert len(copies_kept()) == 2 * linears  # qkv, attention proj, fc (SwiGLU: gate, up), mlp proj; 2 layers


def test_ab_records_the_diff_from_before_to_the_working_trees_model(tmp_path):
    from lab import ab

    src = open(os.path.join(ROOT, "model.py")).read()
    before = tmp_path / "before.py"
    before.write_text(src.replace("import math\n", "import math  # before\n", 1))
    diff = ab.model_diff(str(before))
    assert "-import math  # before\n+import math\n" in diff and diff.startswith("--- before/model.py")
    before.write_text(src)
    assert ab.model_diff(str(before)) == ""
