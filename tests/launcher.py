"""Run code on N ranks from inside pytest, in a fraction of a second.

A pytest run starts one rank pool (a fork server) once: a process that imports torch and the book,
then forks a fresh process for every rank of every multi-rank test (about 0.1 s for 4 ranks, against
2-5 s to start Python and import torch in each rank of a torchrun launch). Each rank is a copy of
the warm pool, so no state leaks from one test to the next, and a test's failure fails that test
alone. The ranks meet through a file in a fresh temporary directory (no TCP port to pick).

run_ranks(fn, world, ...) runs a function on every rank and returns what each returned;
launch(script_or_module, argv, world) runs `python train.py argv` (or `python -m module argv`) as a
torchrun launch would: same environment variables, output captured per rank, the process's exit
code. The tests whose subject is the launch itself (torchrun, signals, two nodes) still use torchrun.
"""

import multiprocessing
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "numpy",
    "tiktoken",
    "train",
    "sample",
    "lab.emulate",
    "lab.tahquant",
    "launcher",
]  # torch._dynamo: the ranks that torch.compile (the book imports it lazily)
GRACE = 3.0  # seconds the other ranks get to finish after one fails (torchrun: it then stops them)
_pool = None


def pool():
    """The fork server, started on first use with torch and the book imported."""
    global _pool
    if _pool is None:
        _pool = multiprocessing.get_context("forkserver")
        _pool.set_forkserver_preload(PRELOAD)
    return _pool


def _rank(rank, world, job, folder, env, cwd):
    """One rank: torchrun's environment, output into the folder, the process group, the job."""
    os.environ.clear()
    os.environ.update(
        env,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    os.chdir(cwd)
    for fd, name in ((1, "out"), (2, "err")):
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(os.open(os.path.join(folder, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    code = 0
    try:
        if world > 1:
            dist.init_process_group(
                "gloo", init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank, world_size=world
            )
        job(rank, world, folder)
    except SystemExit as e:  # as the interpreter ends on it
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    # leave without the process group's teardown: gloo's threads can abort an interpreter's exit
    os._exit(code)


def _start(job, world, folder, timeout, env=None):
    """Fork the ranks, wait for them; returns each rank's exit code (None: stopped after another failed
    or after the timeout) and whether the timeout passed."""
    env = dict(os.environ, **(env or {}))
    procs = [pool().Process(target=_rank, args=(r, world, job, folder, env, ROOT)) for r in range(world)]
    for p in procs:
        p.start()
    deadline, failed_at = time.time() + timeout, None
    while any(p.exitcode is None for p in procs):
        for p in procs:
            p.join(0.01)
        if failed_at is None and any(p.exitcode for p in procs):
            failed_at = time.time()
        if time.time() > deadline or (failed_at is not None and time.time() > failed_at + GRACE):
            break
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    codes = [p.exitcode if p.exitcode >= 0 else None for p in procs]
    return codes, time.time() > deadline


def _read(folder, rank, name):
    with open(os.path.join(folder, f"rank{rank}.{name}"), errors="replace") as f:
        return f.read()


class _Call:
    """A picklable job: fn(rank, world, *args), its result saved for the parent."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __call__(self, rank, world, folder):
        torch.save(self.fn(rank, world, *self.args), os.path.join(folder, f"rank{rank}.pt"))
        if world > 1:
            dist.barrier()  # every rank is done with its collectives and its result


def run_ranks(fn, world, *args, backend="gloo", timeout=300):
    """fn(rank, world, *args) on `world` ranks; returns [result of rank 0, 1, ...] (return CPU
    tensors). fn must be a module-level function (it is pickled by name). A failing rank fails the
    test, with its traceback. backend="nccl": rank r on GPU r, in freshly spawned processes."""
    if backend == "nccl":
        return _run_nccl(fn, world, args)
    with tempfile.TemporaryDirectory() as d:
        codes, late = _start(_Call(fn, args), world, d, timeout)
        if any(codes):
            bad = next(r for r, c in enumerate(codes) if c)
            raise AssertionError(
                f"rank {bad} of {world} failed (exit codes {codes}{', timed out' if late else ''}):\n"
                + _read(d, bad, "err")[-4000:]
            )
        if late:
            raise AssertionError(f"{world} ranks did not finish within {timeout} s")
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]


class _Main:
    """A picklable job: run a script or module as `python script argv` / `python -m module argv` would."""

    def __init__(self, entry, argv):
        self.entry, self.argv = entry, argv

    def __call__(self, rank, world, folder):
        sys.argv = [self.entry, *self.argv]
        if self.entry.endswith(".py"):
            runpy.run_path(self.entry, run_name="__main__")
        else:
            runpy.run_module(self.entry, run_name="__main__", alter_sys=True)


def launch(entry, argv, world=1, timeout=600, env=None):
    """`python entry argv` on world ranks (torchrun's environment variables; world 1: a plain
    process): SimpleNamespace(returncode, stdout, stderr), every rank's output in rank order.
    entry: a script ("train.py") or a module ("lab.tahquant"); env: variables to add."""
    with tempfile.TemporaryDirectory() as d:
        codes, late = _start(_Main(entry, list(argv)), world, d, timeout, env)
        out = "".join(_read(d, r, "out") for r in range(world))
        err = "".join(_read(d, r, "err") for r in range(world))
        if late:
            err += f"\n(timed out after {timeout} s)"
        code = next((c for c in codes if c), 0 if not late and None not in codes else 1)
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def _entry_nccl(rank, world, fn, args, outdir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank, world_size=world
    )
    torch.save(fn(rank, world, *args), os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def _run_nccl(fn, world, args):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry_nccl, args=(world, fn, args, d), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
