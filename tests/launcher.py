"""Run a function on N ranks (gloo; or NCCL, one GPU each) from inside pytest and collect what
each rank returns."""
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, outdir, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world, *args, backend="gloo"):
    """fn(rank, world, *args) on `world` processes; returns [result of rank 0, 1, ...] (return
    CPU tensors). fn must be a module-level function (it is pickled by name). A failing rank
    fails the test. backend="nccl": rank r on GPU r."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, _free_port(), fn, args, d, backend), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
