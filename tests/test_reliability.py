"""What holds when things go wrong: a stalled rank, a kill during a checkpoint save, a damaged
file, a second run into the same out_dir, a run killed between checkpoints (docs/RELIABILITY.md)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
from test_train import ROOT, TINY, run

SHORT = TINY + ["--eval_interval=0", "--warmup_iters=2", "--lr_decay_iters=8"]


def _children(pid):
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env.get(b"RANK", b"-1"))


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads worker pids from /proc (Linux)")
def test_a_stalled_rank_stops_the_job_within_the_timeout(tmp_path):
    """Rank 1 is stopped (SIGSTOP: alive, silent) after a few steps; rank 0 waits in a collective
    for at most --timeout seconds, then the job ends with a message naming it."""
    timeout = 5
    log, outfile, stopped = tmp_path / "log.jsonl", tmp_path / "output.txt", None
    with open(outfile, "w") as sink:
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py",
                              *SHORT, "--tp=2", "--max_iters=100000", f"--timeout={timeout}", f"--out_dir={tmp_path}"],
                             cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=sink, stderr=subprocess.STDOUT)
    message = f"did not complete within timeout={timeout} s"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not log.exists() or log.read_text().count('"loss"') < 3):
            time.sleep(0.2)
        stopped = next(c for c in _children(p.pid) if _rank_of(c) == 1)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        while time.time() - t0 < timeout + 60 and message not in outfile.read_text():
            time.sleep(0.2)
        waited = time.time() - t0
    finally:
        if stopped:                                      # torchrun would wait 30 s for it to stop itself
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    out = outfile.read_text()
    assert p.returncode != 0 and message in out, out[-3000:]
    assert waited < timeout + 30, waited


def test_resume_takes_the_newest_complete_set_and_names_a_damaged_file(tmp_path):
    out = str(tmp_path)
    run(SHORT + ["--tp=2", "--max_iters=4", "--ckpt_interval=2", f"--out_dir={out}"], nproc=2)
    assert [os.path.basename(s) for s in checkpoint.sets(out)] == ["iter_00000004"]   # older sets deleted
    # a kill during the next save: one rank's file written, no COMPLETE
    partial = os.path.join(out, "ckpt", "iter_00000006")
    os.makedirs(partial)
    shutil.copy(os.path.join(out, "ckpt", "iter_00000004", "tp0_pp0.pt"), os.path.join(partial, "tp0_pp0.pt"))
    p = run(SHORT + ["--tp=2", "--max_iters=6", "--ckpt_interval=2", f"--out_dir={out}", "--resume"], nproc=2)
    assert "resumed from" in p.stdout and "iter_00000004 (iteration 4)" in p.stdout
    assert [os.path.basename(s) for s in checkpoint.sets(out, complete=False)] == ["iter_00000006"]
    # ranks that disagree (a file from another iteration) are refused before training
    f = os.path.join(out, "ckpt", "iter_00000006", "tp1_pp0.pt")
    ck = torch.load(f, weights_only=False)
    ck["iter"] = 5
    torch.save(ck, f)
    p = run(SHORT + ["--tp=2", "--max_iters=8", f"--out_dir={out}", "--resume"], nproc=2, check=False)
    assert p.returncode != 0 and "the ranks' checkpoint files disagree" in p.stdout + p.stderr
    # a damaged file is named
    with open(f, "wb") as fh:
        fh.write(b"not a checkpoint")
    p = run(SHORT + ["--tp=2", "--max_iters=8", f"--out_dir={out}", "--resume"], nproc=2, check=False)
    assert p.returncode != 0 and f"checkpoint file {f} cannot be read" in p.stdout + p.stderr


def test_resume_after_a_kill_between_checkpoints_logs_each_step_once(tmp_path):
    """A run that went on past its last checkpoint (then was killed): the resumed run's log.jsonl
    drops the steps after the checkpoint and logs them again, once, in windows that line up."""
    out = str(tmp_path)
    args = SHORT + ["--log_interval=2", f"--out_dir={out}"]
    run(args + ["--max_iters=3"])                                            # checkpoint at 3
    run(args + ["--max_iters=5", "--ckpt_interval=-1", "--resume"])          # steps 4, 5: no checkpoint
    p = run(args + ["--max_iters=8", "--resume"])
    assert "iteration 3" in p.stdout
    rows = [json.loads(ln) for ln in open(os.path.join(out, "log.jsonl"))]
    assert [r["iter"] for r in rows if "loss" in r] == [1, 2, 4, 6, 8]
    assert [r["iter0"] for r in rows if "config" in r] == [0, 3, 3]


def test_a_second_run_into_the_same_out_dir_is_refused(tmp_path):
    out = str(tmp_path / "run")
    run(SHORT + ["--max_iters=1", f"--out_dir={out}"])
    p = run(SHORT + ["--max_iters=1", f"--out_dir={out}"], check=False)
    assert p.returncode != 0 and "holds another run's checkpoints" in p.stdout + p.stderr
    run(SHORT + ["--max_iters=1", f"--out_dir={out}", "--overwrite"])       # explicit: starts over
    # a run in progress holds LOCK: a live process on this host refuses, a dead one is taken over
    lock = os.path.join(out, "LOCK")
    with open(lock, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}")
    with pytest.raises(SystemExit, match="is in use by another run"):
        checkpoint.claim(out, resume=True, overwrite=False, rank0=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(lock, "w") as f:
        f.write(f"{socket.gethostname()} {dead.pid}")
    checkpoint.claim(out, resume=True, overwrite=False, rank0=True)
    with open(lock) as f:
        assert f.read() == f"{socket.gethostname()} {os.getpid()}"
    checkpoint._release(lock, f"{socket.gethostname()} {os.getpid()}")
    assert not os.path.exists(lock)
