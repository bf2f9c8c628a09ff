"""
Run a function on N CPU ranks (gloo) from one Python process, for the lab's studies that need real
TP groups on a laptop: run_ranks(fn, world, *args) forks the ranks, each joins a process group through a
file, runs fn(rank, world, *args) and hands its result back. (The test suite has a faster pool of its
own, tests/launcher.py; the lab does not depend on the tests.)
"""

import multiprocessing
import os
import tempfile
import traceback

import torch
import torch.distributed as dist


def _rank(fn, rank, world, args, folder):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
        torch.save(fn(rank, world, *args), os.path.join(folder, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)  # without the process group's teardown (gloo's threads can abort an interpreter's exit)


def run_ranks(fn, world, *args):
    """[fn(rank, world, *args) for every rank], each computed in its own forked process."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(fn, r, world, args, d)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]}); its traceback is above")
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
