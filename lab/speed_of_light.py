"""
The speed of light of tensor-parallel communication: train.py with the TP all-reduces of one
direction (or both) SKIPPED, to time what a step would cost if that communication were free.
The results are WRONG (every rank keeps its own partial sums); only the step time means anything.

    torchrun --nproc_per_node=2 -m lab.speed_of_light all configs/gpt1b.py --compile=True   # fwd | bwd | all
    python bench.py e2e configs/gpt1b.py none,hint8,sol:fwd,sol:bwd,sol:all --nproc=2 -- --compile=True

The skipped all-reduces are those of TPComm.all_reduce (g forward, f backward): the ones the codecs
compress. Sequence parallelism (reduce-scatter / all-gather) is not covered.
"""

import sys

import train

SKIP = {"fwd": ("fwd",), "bwd": ("bwd",), "all": ("fwd", "bwd")}


class _Done:
    """What an asynchronous all-reduce returns, for one that never started."""

    def wait(self):
        pass


def skipping(comm, directions):
    """Replace comm.all_reduce (on this instance) by one that returns its input untouched for the
    given directions."""
    real = comm.all_reduce

    def skipped(x, direction, async_op=False):
        if direction in directions:
            return _Done() if async_op else x
        return real(x, direction, async_op)

    comm.all_reduce = skipped


def main(argv):
    if not argv or argv[0] not in SKIP:
        raise SystemExit("usage: [torchrun ...] -m lab.speed_of_light fwd|bwd|all [config.py] [--key=value ...]")
    which = argv[0]

    def hook(model, comm, cfg):
        if cfg.sequence_parallel:
            raise SystemExit("lab.speed_of_light: not with sequence_parallel (its collectives are not skipped)")
        for c in {id(m.comm): m.comm for m in model.modules() if hasattr(m, "comm")}.values():
            skipping(c, SKIP[which])  # every TPComm the layers hold (TPComm.at: a block part's own)
        print(f"SPEED OF LIGHT: the {which} TP all-reduces are skipped; the losses are wrong, time only", flush=True)

    train.main(argv[1:], model_hook=hook)


if __name__ == "__main__":
    main(sys.argv[1:])
