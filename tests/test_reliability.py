"""What holds when things go wrong: a stalled rank, a kill during a checkpoint save, a damaged
file, a second run into the same out_dir, a run killed between checkpoints (docs/RELIABILITY.md)."""

import errno
import json
import os
import re
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
import config
import parallel
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


@pytest.mark.slow  # a 5 s timeout waited out at 2 ranks: 13 s
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads worker pids from /proc (Linux)")
def test_a_stalled_rank_stops_the_job_within_the_timeout(tmp_path):
    """Rank 1 is stopped (SIGSTOP: alive, silent) after a few steps; rank 0 waits in a collective
    for at most --timeout seconds, names rank 1 as the one that did not answer and stops it, and
    the whole job ends by itself (nothing here kills it by hand): through the timeout's path, which the
    message proves. How long that takes is timeout + STALL_WAIT (the watchdog's wait for the others to check in)
    and the processes' exit on a quiet machine; the test bounds no time a busy machine could stretch, only a
    hang (10 minutes)."""
    timeout = 5
    log, outfile = tmp_path / "log.jsonl", tmp_path / "output.txt"
    with open(outfile, "w") as sink:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                "train.py",
                *SHORT,
                "--tp=2",
                "--max_iters=100000",
                f"--timeout={timeout}",
                f"--out_dir={tmp_path}",
            ],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.time() + 600  # a hang's guard, not a time limit
        while time.time() < deadline and (not log.exists() or log.read_text().count('"loss"') < 3):
            time.sleep(0.2)
        os.kill(next(c for c in _children(p.pid) if _rank_of(c) == 1), signal.SIGSTOP)
        p.wait(timeout=600)
    finally:
        if p.poll() is None:  # the test failed; leave nothing behind
            for c in _children(p.pid):
                os.kill(c, signal.SIGKILL)
            p.kill()
    out = outfile.read_text()
    assert p.returncode != 0, out[-3000:]
    assert f"did not complete within timeout={timeout} s: rank 1 did not answer and was stopped" in out, out[-3000:]


def _state(out_dir):
    found = checkpoint.sets(out_dir)[-1]
    return torch.load(os.path.join(found, "tp0_pp0.pt"), weights_only=False)


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_saves_a_last_set_and_the_resume_is_bit_exact(tmp_path, sig):
    """Ctrl-C in a terminal: SIGINT reaches torchrun and both ranks at once (and torchrun passes it on
    again); SIGTERM (a scheduler): torchrun alone gets it and passes it on. Either way every rank
    stops at the same step, a complete set is saved there, and the job ends non-zero; --resume then
    continues bit for bit as a run never interrupted does."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = SHORT + ["--tp=2", "--lr_decay_iters=100"]
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "train.py",
            *common,
            "--max_iters=100000",
            f"--out_dir={a}",
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 600  # a hang's guard, not a time limit
        while time.time() < deadline and (
            not (a / "log.jsonl").exists() or (a / "log.jsonl").read_text().count('"loss"') < 3
        ):
            time.sleep(0.1)
        os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)
        out = p.communicate(timeout=600)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    n = _state(a)["iter"]
    assert p.returncode != 0 and n >= 3 and f"stopped at step {n}; continue with --resume" in out, out[-3000:]
    assert "Traceback" not in out.split("stopped at step")[0], out[-3000:]
    if sig == signal.SIGINT:  # what the README says a user sees: torchrun's own report, exit code 1
        after = out.split("continue with --resume")[1]
        assert "its traceback and exit code 1 are its own" in after and p.returncode == 1, out[-3000:]
        assert "Traceback" not in after or "SignalException" in after, out[-3000:]
    run(common + [f"--max_iters={n + 2}", f"--out_dir={a}", "--resume"], nproc=2)
    run(common + [f"--max_iters={n + 2}", f"--out_dir={b}"], nproc=2)
    ca, cb = _state(a), _state(b)
    assert ca["iter"] == cb["iter"] == n + 2
    assert all(torch.equal(v, cb["model"][k]) for k, v in ca["model"].items())


def test_a_second_ctrl_c_ends_the_process_at_once():
    """The same Ctrl-C again within a second (the terminal's and torchrun's copy) only asks once; a
    second one later ends the process at once, with 128 + SIGINT."""
    code = (
        "import os, signal, time, watchdog; stop = watchdog.Stop(True); os.kill(os.getpid(), signal.SIGINT); "
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(1.2); print('still here', flush=True); "
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(300)"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 128 + signal.SIGINT  # not 0: the third SIGINT ended it during its 300 s sleep
    assert "SIGINT: saving a checkpoint set after this step" in p.stdout and "still here" in p.stdout


def _run(out_dir, seed=0, run_id="a"):
    """What checkpoint.save and resume see of a run (one process; a tiny model)."""
    cfg = config.Settings(out_dir=str(out_dir), n_layer=1, n_head=2, n_embd=32, block_size=32, seed=seed)
    model = GPT(cfg.model_config(), seed=seed)
    return SimpleNamespace(
        cfg=cfg,
        grid=parallel.Grid(),
        model=model,
        opt=torch.optim.AdamW(model.parameters()),
        run_id=run_id,
        dev="cpu",
        it0=0,
    )


def _names(out, complete=True):
    return [os.path.basename(s) for s in checkpoint.sets(str(out), complete)]


def test_resume_takes_the_newest_complete_set(tmp_path):
    """Two complete sets (an older one kept aside and put back) and one cut short by a kill (a
    file, no COMPLETE): resume loads the newest complete one and goes on as its run."""
    r = _run(tmp_path)
    checkpoint.save(r, 2)
    shutil.copytree(tmp_path / "ckpt" / "iter_00000002", tmp_path / "kept")
    checkpoint.save(r, 4)
    assert _names(tmp_path) == ["iter_00000004"]  # the older set is deleted
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
    with pytest.raises(
        SystemExit,
        match=f"checkpoint file {f} does not match the checksum in COMPLETE: it comes "
        f"from another run \\(b, this set's is a\\)",
    ):
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
    checkpoint.claim(str(mine), resume=False, overwrite=True, rank0=True)  # the advice is taken
    checkpoint._release(os.path.join(mine, "LOCK"), f"{socket.gethostname()} {os.getpid()}")
    assert _names(mine, False) == []


def test_resume_after_a_kill_between_checkpoints_logs_each_step_once(tmp_path):
    """A run that went on past its last checkpoint (then was killed): the resumed run's log.jsonl
    drops the steps after the checkpoint and logs them again, once, in windows that line up."""
    out = str(tmp_path)
    args = SHORT + ["--log_interval=2", f"--out_dir={out}"]
    run(args + ["--max_iters=3"])  # checkpoint at 3
    run(args + ["--max_iters=5", "--ckpt_interval=-1", "--resume"])  # steps 4, 5: no checkpoint
    p = run(args + ["--max_iters=8", "--resume"])
    assert "iteration 3" in p.stdout
    rows = [json.loads(ln) for ln in open(os.path.join(out, "log.jsonl"))]
    assert [r["iter"] for r in rows if "loss" in r] == [1, 2, 3, 4, 6, 8]  # 3: a run's last step is always logged
    assert [r["iter0"] for r in rows if "config" in r] == [0, 3, 3]


def test_a_second_run_into_the_same_out_dir_is_refused(tmp_path):
    out = str(tmp_path / "run")
    run(SHORT + ["--max_iters=1", f"--out_dir={out}"])
    p = run(SHORT + ["--max_iters=1", f"--out_dir={out}"], check=False)
    assert p.returncode != 0 and "holds another run's checkpoints" in p.stdout + p.stderr
    run(SHORT + ["--max_iters=1", f"--out_dir={out}", "--overwrite"])  # explicit: starts over
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


def test_a_resume_takes_only_the_out_dirs_own_run(tmp_path):
    """A whole set of another run copied in as the newest: refused, naming its run and --resume_from;
    with --resume_from it is taken on purpose and the run goes on as that run; sets in an out_dir without
    its RUN file likewise need --resume_from. And a resume with
    nothing left to train (max_iters at or below the set's iteration) says so and stops."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    checkpoint.save(_run(mine), 4)
    checkpoint.save(_run(other, seed=1, run_id="b"), 6)
    foreign = mine / "ckpt" / "iter_00000006"
    shutil.copytree(other / "ckpt" / "iter_00000006", foreign)
    with pytest.raises(
        SystemExit,
        match=f"the newest set {foreign} is of run b, not of {mine}'s own run a "
        f"\\(its RUN\\): take it on purpose with --resume_from={foreign}",
    ):
        checkpoint.resume(_run(mine))
    r = _run(mine)
    r.cfg.resume_from = str(foreign)
    assert checkpoint.resume(r) == str(foreign) and (r.it0, r.run_id) == (6, "b")
    shutil.rmtree(foreign)
    copied = tmp_path / "copied"  # a whole out_dir's sets without its RUN: not known to be this run's
    shutil.copytree(other / "ckpt", copied / "ckpt")
    with pytest.raises(SystemExit, match="has no RUN file .* take it on purpose with --resume_from="):
        checkpoint.resume(_run(copied))
    r = _run(mine)
    r.cfg.max_iters = 4
    with pytest.raises(SystemExit, match="is at iteration 4, and max_iters=4: nothing left to train"):
        checkpoint.resume(r)


def _agreement(rank, world, folder, iters):
    """Rank r resumes from a set whose file for r says iteration iters[r] (each file's checksum right)."""
    cfg = config.Settings(out_dir=folder, n_layer=1, n_head=2, n_embd=32, block_size=32, tp=world)
    grid = parallel.Grid(rank=rank, world=world, tp=world, tp_rank=rank)
    model = GPT(
        cfg.model_config(),
        parallel.TPComm(group=torch.distributed.group.WORLD, size=world, rank=rank),
        seed=0,
    )
    r = SimpleNamespace(cfg=cfg, grid=grid, model=model, opt=torch.optim.AdamW(model.parameters()), dev="cpu")
    ckpt = os.path.join(folder, "ckpt", "iter_00000004")
    os.makedirs(ckpt, exist_ok=True)
    sha = checkpoint.write_file(
        {
            "model": model.state_dict(),
            "optimizer": r.opt.state_dict(),
            "iter": iters[rank],
            "config": cfg.as_dict(),
            "layout": [world, 1],
            "run_id": "a",
        },
        os.path.join(ckpt, f"tp{rank}_pp0.pt"),
    )
    every = [None] * world
    torch.distributed.all_gather_object(every, (f"tp{rank}_pp0.pt", sha))
    if rank == 0:
        checkpoint.mark_complete(
            ckpt, {"iter": 4, "tp": world, "pp": 1, "dp": 1, "zero1": False, "run_id": "a", "files": dict(every)}
        )
        with open(os.path.join(folder, "RUN"), "w") as f:  # the out_dir's own run, as a save writes it
            f.write("a")
    torch.distributed.barrier()
    try:
        return checkpoint.resume(r) and f"resumed at {r.it0}"
    except SystemExit as e:
        return str(e)


def test_ranks_that_load_different_iterations_refuse_to_resume(tmp_path):
    """Two TP ranks whose files (each matching its checksum) hold iterations 4 and 5: both refuse,
    naming the disagreement; with the same iteration both resume."""
    from launcher import run_ranks

    bad = run_ranks(_agreement, 2, str(tmp_path / "bad"), [4, 5])
    assert all("the ranks' checkpoint files disagree" in m for m in bad), bad
    assert run_ranks(_agreement, 2, str(tmp_path / "good"), [4, 4]) == ["resumed at 4"] * 2


def test_a_changed_byte_past_the_first_hashing_piece_is_found(tmp_path, monkeypatch):
    """The checksum covers the whole file: with the piece size lowered to 1 KiB, a byte flipped in
    the last piece of a shard is found."""
    monkeypatch.setattr(checkpoint, "HASH_PIECE", 1024)
    checkpoint.save(_run(tmp_path), 4)
    f = tmp_path / "ckpt" / "iter_00000004" / "tp0_pp0.pt"
    data = bytearray(f.read_bytes())
    assert len(data) > 8 * 1024
    data[-100] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="does not match the checksum in COMPLETE"):
        checkpoint.resume(_run(tmp_path))


def test_os_errors_are_one_line_naming_the_path_and_the_fix(tmp_path, monkeypatch):
    """A full disk while saving (torch.save's RuntimeError), a read-only file system, a name over 255
    bytes, a whole path over the system's limit, an export onto a file, an empty LOCK: each a clear line (or a stale LOCK taken over)."""
    r = _run(tmp_path)
    checkpoint.save(r, 2)

    def full(obj, path):
        open(path, "wb").close()
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(
        SystemExit,
        match="cannot write the checkpoint .* free space or choose another --out_dir; "
        "the previous complete set is kept",
    ):
        checkpoint.save(r, 4)
    monkeypatch.undo()
    assert _names(tmp_path) == ["iter_00000002"] and not list((tmp_path / "ckpt").glob("*/*.tmp"))

    def read_only(path, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(os, "makedirs", read_only)
    with pytest.raises(SystemExit, match=f"{tmp_path / 'ro'}: cannot claim the out_dir: the file system is read-only"):
        checkpoint.claim(str(tmp_path / "ro"), resume=False, overwrite=False, rank0=True)
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="a name in the path is too long"):
        checkpoint.claim(str(tmp_path / ("x" * 300)), resume=False, overwrite=False, rank0=True)
    deep = str(tmp_path.joinpath(*["d" * 200] * 21))  # every name short, the whole path over 4 KiB
    with pytest.raises(SystemExit, match=r"the path is [\d,]+ bytes, longer than the system allows") as e:
        checkpoint.claim(deep, resume=False, overwrite=False, rank0=True)
    assert len(str(e.value)) < 300
    (tmp_path / "afile").write_text("")
    import sample

    with pytest.raises(SystemExit, match="afile is a file: export writes a folder"):
        sample.cli(["export", os.path.join(ROOT, "tests", "fixtures", "hf_qwen2_tied"), str(tmp_path / "afile")])
    lock = tmp_path / "locked" / "LOCK"
    lock.parent.mkdir()
    lock.write_text("")  # a claim cut short by a full disk
    checkpoint.claim(str(lock.parent), resume=False, overwrite=False, rank0=True)
    me = f"{socket.gethostname()} {os.getpid()}"
    assert lock.read_text() == me and not list(lock.parent.glob("LOCK.*"))
    checkpoint._release(str(lock), me)


def test_init_from_weights_of_the_wrong_shape_end_without_a_traceback(tmp_path):
    """A folder whose config.json matches the settings but whose tensors do not: one line, no traceback."""
    src = tmp_path / "hf"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "hf_qwen2_tied"), src)
    c = json.load(open(src / "config.json"))
    json.dump(dict(c, intermediate_size=40), open(src / "config.json", "w"))
    from test_cli import _tiny_vocab_data

    _tiny_vocab_data(str(tmp_path / "tiny"), 300)
    p = run(
        TINY
        + [
            "--family=qwen2",
            "--vocab_size=300",
            "--n_head=4",
            "--intermediate_size=40",
            "--norm_eps=1e-6",
            "--rope_theta=1000.0",
            "--max_iters=1",
            f"--init_from={src}",
            f"--out_dir={tmp_path / 'out'}",
            "--dataset=tiny",
            f"--data_dir={tmp_path}",
        ],
        check=False,
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert f"--init_from={src}: h.0.mlp.fc.weight: the weights hold shape (96, 32)" in out, out[-2000:]


EXIT_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
import taco
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
for n in (1000, 5000, 70000):
    for codec in ("none", "taco", "hint8"):
        taco.all_reduce(torch.randn(n), codec=codec)
    taco.reduce_scatter(torch.randn(3 * n), codec="hint8")
    taco.all_gather(torch.randn(n), codec="none")
print("OK", flush=True)
"""  # no destroy_process_group: a user's script ends like this


@pytest.mark.parametrize("runs", [pytest.param(2), pytest.param(40, marks=pytest.mark.slow)])
def test_a_script_of_compressed_all_reduces_exits_cleanly_every_time(tmp_path, runs):
    """Three ranks under torchrun that end without destroying the process group, after taco's collectives with
    every codec kind (none: torch.distributed's own; taco, hint8: compressed) and both halves: every run exits
    0 on every rank. Without taco's exit hook a rank aborted at exit ("terminate called without an active
    exception", SIGABRT) in about one run in four with a codec, and in some with `none` (torch's own all_reduce
    alone does too: 2 of 20 runs); the slow tier's 40 runs would show a 1-in-20 abort with 87% odds."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT.format(root=ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(script)]
    for i in range(runs):
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
        assert p.returncode == 0 and p.stdout.count("OK") == 3, f"run {i + 1}: rc {p.returncode}\n{p.stderr[-3000:]}"
        assert "terminate called" not in p.stderr, f"run {i + 1}:\n{p.stderr[-3000:]}"


def _qwen_run(out_dir, **given):
    given = dict(dict(family="qwen2", n_layer=1, n_head=2, n_embd=32, block_size=32), **given)
    cfg = config.Settings(out_dir=str(out_dir), **given)
    r = _run(out_dir)
    r.cfg, r.model = cfg, GPT(cfg.model_config(), seed=0)
    r.opt = torch.optim.AdamW(r.model.parameters())
    return r


@pytest.mark.parametrize(
    "given, said",
    [
        (dict(rope_theta=500000.0), "rope_theta (saved 10000.0, given 500000.0)"),
        (dict(norm_eps=0.5), "norm_eps (saved 1e-05, given 0.5)"),
        (dict(family="llama"), "family (saved 'qwen2', given 'llama')"),
        (dict(rope_factor=16.0), "rope_factor (saved 8.0, given 16.0)"),  # Llama 3's rotary scaling, every setting
        (dict(rope_scaling="llama3"), "rope_scaling (saved '', given 'llama3')"),
    ],
)
def test_resume_refuses_a_setting_that_changes_the_model(tmp_path, given, said):
    """A resume whose settings change what the model computes (rotary base, norm eps, family, shape) is
    refused naming the saved and the given value; loss_chunk (how, not what) may change."""
    checkpoint.save(_qwen_run(tmp_path), 2)
    checkpoint.resume(_qwen_run(tmp_path, resume=True, max_iters=10, loss_chunk=16))  # changeable
    with pytest.raises(SystemExit, match=re.escape(said)):
        checkpoint.resume(_qwen_run(tmp_path, resume=True, max_iters=10, **given))


def test_init_from_keeps_the_settings_that_say_how_not_what():
    """--init_from gives the model; the settings that change only how it is computed (recompute, loss_chunk,
    block_size, dropout) are the user's, not contradictions of the folder's."""
    c = config.parse(["--init_from=tests/fixtures/hf_qwen2_untied", "--recompute=block", "--loss_chunk=16"])
    config.take_init_from(c)
    assert (c.family, c.recompute, c.loss_chunk) == ("qwen2", "block", 16)


def test_a_deleted_shard_is_named_as_missing_not_as_another_layout(tmp_path):
    """A rank's file deleted from a complete set: the resume names the file as missing and says how to go on
    (it was blamed on another layout); a file that the set does not list is one of another layout, named so."""
    r = _run(tmp_path)
    checkpoint.save(r, 2)
    folder = tmp_path / "ckpt" / "iter_00000002"
    os.remove(folder / "tp0_pp0.pt")
    with pytest.raises(SystemExit, match="tp0_pp0.pt is missing: its set lists it") as e:
        checkpoint.resume(_run(tmp_path, run_id=None))
    assert "another layout" not in str(e.value)
    meta = checkpoint.read_complete(str(folder))
    with pytest.raises(SystemExit, match=r"is not in its set .* written at another layout \(tp 1 x pp 1"):
        checkpoint.load_file(str(folder / "tp1_pp0.pt"), meta)
