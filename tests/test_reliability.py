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

from types import SimpleNamespace

import pytest
import torch

import checkpoint
import parallel
import train
from model import GPT
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
    for at most --timeout seconds, names rank 1 as the one that did not answer and stops it, and
    the whole job has ended within timeout + 5 s of the stop (nothing here kills it by hand)."""
    timeout = 5
    log, outfile = tmp_path / "log.jsonl", tmp_path / "output.txt"
    with open(outfile, "w") as sink:
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py",
                              *SHORT, "--tp=2", "--max_iters=100000", f"--timeout={timeout}", f"--out_dir={tmp_path}"],
                             cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not log.exists() or log.read_text().count('"loss"') < 3):
            time.sleep(0.2)
        os.kill(next(c for c in _children(p.pid) if _rank_of(c) == 1), signal.SIGSTOP)
        t0 = time.time()
        p.wait(timeout=timeout + 60)
        waited = time.time() - t0
    finally:
        if p.poll() is None:                             # the test failed; leave nothing behind
            for c in _children(p.pid):
                os.kill(c, signal.SIGKILL)
            p.kill()
    out = outfile.read_text()
    assert p.returncode != 0, out[-3000:]
    assert f"did not complete within timeout={timeout} s: rank 1 did not answer and was stopped" in out, out[-3000:]
    assert waited < timeout + 5, waited


def _run(out_dir, seed=0, run_id="a"):
    """What checkpoint.save and resume see of a run (one process; a tiny model)."""
    cfg = dict(train.DEFAULTS, out_dir=str(out_dir), n_layer=1, n_head=2, n_embd=32, block_size=32, seed=seed)
    model = GPT(checkpoint.model_config(cfg), seed=seed)
    return SimpleNamespace(cfg=cfg, grid=parallel.Grid(), model=model, opt=torch.optim.AdamW(model.parameters()),
                           run_id=run_id, dev="cpu", it0=0)


def _names(out, complete=True):
    return [os.path.basename(s) for s in checkpoint.sets(str(out), complete)]


def test_resume_takes_the_newest_complete_set(tmp_path):
    """Two complete sets (an older one kept aside and put back) and one cut short by a kill (a
    file, no COMPLETE): resume loads the newest complete one and goes on as its run."""
    r = _run(tmp_path)
    checkpoint.save(r, 2)
    shutil.copytree(tmp_path / "ckpt" / "iter_00000002", tmp_path / "kept")
    checkpoint.save(r, 4)
    assert _names(tmp_path) == ["iter_00000004"]                        # the older set is deleted
    shutil.copytree(tmp_path / "kept", tmp_path / "ckpt" / "iter_00000002")
    os.makedirs(tmp_path / "ckpt" / "iter_00000006")
    shutil.copy(tmp_path / "ckpt" / "iter_00000004" / "tp0_pp0.pt", tmp_path / "ckpt" / "iter_00000006")
    again = _run(tmp_path, run_id=None)
    assert checkpoint.resume(again).endswith("iter_00000004") and (again.it0, again.run_id) == (4, "a")


def test_a_save_cut_short_keeps_the_previous_set(tmp_path, monkeypatch):
    """A kill after the files are written and before COMPLETE: the previous set is still there,
    complete, and is what a resume loads."""
    r = _run(tmp_path)
    checkpoint.save(r, 2)

    def killed(folder, meta):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "mark_complete", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(r, 4)
    assert _names(tmp_path) == ["iter_00000002"] and _names(tmp_path, False) == ["iter_00000002", "iter_00000004"]
    assert checkpoint.resume(_run(tmp_path)).endswith("iter_00000002")


def test_resume_checks_the_run_and_every_checksum(tmp_path):
    """A file from another run (other seed, same iteration and layout) swapped in, a byte flipped
    in the middle of a file, a COMPLETE holding garbage, a COMPLETE deleted: each refused, naming
    the file; the advice for a set without COMPLETE is one that is then accepted."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    checkpoint.save(_run(mine), 4)
    checkpoint.save(_run(other, seed=1, run_id="b"), 4)
    folder = mine / "ckpt" / "iter_00000004"
    f, good = folder / "tp0_pp0.pt", (folder / "tp0_pp0.pt").read_bytes()
    shutil.copy(other / "ckpt" / "iter_00000004" / "tp0_pp0.pt", f)
    with pytest.raises(SystemExit, match=f"checkpoint file {f} does not match the checksum in COMPLETE: it comes "
                                         f"from another run \\(b, this set's is a\\)"):
        checkpoint.resume(_run(mine))
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1
    f.write_bytes(bytes(flipped))
    with pytest.raises(SystemExit, match=f"checkpoint file {f} does not match the checksum in COMPLETE"):
        checkpoint.resume(_run(mine))
    f.write_bytes(good)
    assert checkpoint.resume(_run(mine)).endswith("iter_00000004")
    complete = (folder / "COMPLETE").read_text()
    (folder / "COMPLETE").write_text("garbage")
    with pytest.raises(SystemExit, match=f"{folder / 'COMPLETE'} is damaged"):
        checkpoint.resume(_run(mine))
    (folder / "COMPLETE").write_text(complete.replace('"files"', '"filez"'))
    with pytest.raises(SystemExit, match="records no run id and checksums"):
        checkpoint.resume(_run(mine))
    os.remove(folder / "COMPLETE")
    with pytest.raises(SystemExit, match="only iter_00000004, cut short before its save finished: --overwrite starts"):
        checkpoint.resume(_run(mine))
    with pytest.raises(SystemExit, match="none complete \\(cut short\\), so --overwrite starts over"):
        checkpoint.claim(str(mine), resume=False, overwrite=False, rank0=False)
    checkpoint.claim(str(mine), resume=False, overwrite=True, rank0=True)      # the advice is taken
    checkpoint._release(os.path.join(mine, "LOCK"), f"{socket.gethostname()} {os.getpid()}")
    assert _names(mine, False) == []


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
