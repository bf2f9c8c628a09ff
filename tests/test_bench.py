"""bench.py's CPU-side analysis: the cost model of the TP communication (from committed GPU results)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_interp_us_is_log_log_and_per_transport():
    rows = [{"MB": mb, "variant": "hint8", "chunks": 1, "transport": tr, "us": str(us)}
            for tr, scale in (("dist", 100), ("symm", 50)) for mb, us in ((1, scale), (4, 4 * scale), (16, 8 * scale))]
    assert bench.interp_us(rows, "hint8", 2) == pytest.approx(200)          # t ~ MB between 1 and 4
    assert bench.interp_us(rows, "hint8", 2, "symm") == pytest.approx(100)
    assert bench.interp_us(rows, "hint8", 8) == pytest.approx(400 * 2 ** 0.5)   # t ~ sqrt(MB) between 4 and 16


def test_costmodel_from_the_committed_gpu_results(tmp_path):
    for f in ("collective_nvlink.json", "collective_p2p_disabled.json", "e2e_gpt1b_nvlink.json",
              "e2e_gpt1b_p2p_disabled.json"):
        shutil.copy(os.path.join(ROOT, "results", f), tmp_path)
    os.makedirs(tmp_path / "gpu")
    shutil.copy(os.path.join(ROOT, "results", "gpu", "gpu_train.log"), tmp_path / "gpu")
    env = dict(os.environ, NANOTACO_RESULTS=str(tmp_path))
    p = subprocess.run([sys.executable, "bench.py", "costmodel"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.load(open(tmp_path / "costmodel.json"))["rows"]
    models = {(r["model"], r["link"], r["codec"], r["transport"]) for r in rows}
    assert ("gpt1b", "nvlink", "hint8", "symm") in models and ("gpt2s", "p2p_disabled", "hint8", "dist") in models
    for r in rows:                       # predicted = none - n t_nccl + n t_codec, as the docstring says
        n = 50 if r["model"] == "gpt2s" else 82
        assert r["predicted ms"] == pytest.approx(r["none ms"] + n * (r["t_codec us"] - r["t_nccl us"]) / 1e3, abs=0.2)


def test_trace_report_splits_hidden_and_exposed_time(tmp_path):
    """A hand-made timeline (ms): compute 0-10 and 20-30; an encode 5-15 (half of it beside compute),
    a decode 12-16 and an NCCL kernel 40-50 (alone); nothing runs 16-20 and 30-40."""
    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts * 1000, "dur": dur * 1000}
    ev = [k("gemm", 0, 10), k("gemm", 20, 10), k("void encode_kernel<1>", 5, 10), k("void decode_kernel<1>", 12, 4),
          k("ncclDevKernel_SendRecv", 40, 10)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    rows, calls = bench.trace_report(str(path), steps=1)
    by = {r["kind"]: r for r in rows}
    assert (by["step (first to last kernel)"]["kernel ms"], by["step (first to last kernel)"]["exposed"]) == ("50.0", "14.0 idle")
    assert (by["codec kernels"]["kernel ms"], by["codec kernels"]["busy ms"]) == ("14.0", "11.0")     # 5-16 busy
    assert (by["codec kernels"]["beside compute"], by["codec kernels"]["exposed"]) == ("5.0", "6.0")
    assert (by["comm: nccl"]["beside compute"], by["comm: nccl"]["exposed"]) == ("0.0", "10.0")
    assert by["compute"]["busy ms"] == "20.0"
    # per kernel: "beside compute" needs more than half of it under a compute kernel (the encode has half)
    assert {(c["kernel"], c["beside compute"], c["mean us"]) for c in calls} == {("encode", "no", "10000.0"),
                                                                                 ("decode", "no", "4000.0")}
    rows, calls = bench.trace_report(str(path), steps=2)                                      # per step
    assert {r["kind"]: r for r in rows}["compute"]["kernel ms"] == "10.0"
