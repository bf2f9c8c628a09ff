"""Run a function on N ranks (gloo; or NCCL, one GPU each) from inside pytest and collect what
each rank returns. The ranks meet through a file in a fresh temporary directory (no TCP port to
pick, so no race with other jobs on the machine)."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, fn, args, outdir, backend):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank,
                            world_size=world)
    torch.save(fn(rank, world, *args), os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()                        # every rank is done with its collectives and its result
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the process group's teardown: gloo's worker threads can abort the interpreter's
    # exit ("terminate called without an active exception") after all the work is done.
    os._exit(0)


def run_ranks(fn, world, *args, backend="gloo"):
    """fn(rank, world, *args) on `world` processes; returns [result of rank 0, 1, ...] (return
    CPU tensors). fn must be a module-level function (it is pickled by name). A failing rank
    fails the test. backend="nccl": rank r on GPU r."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, fn, args, d, backend), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
