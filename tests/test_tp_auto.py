"""tp_codec=auto (tp_auto.py): the decision from timings (injected here), the timing harness on
gloo (every rank gets the same numbers), and what auto means without GPUs."""

import pytest
import torch

import config
import tp_auto
from launcher import run_ranks
from test_parallel import comm_for


@pytest.mark.parametrize(
    "times, want",
    [
        ({"fwd": {"none": 1.0, "hint8": 0.80}, "bwd": {"none": 1.0, "hint8": 0.80}}, {"fwd": "hint8", "bwd": "hint8"}),
        ({"fwd": {"none": 1.0, "hint8": 0.99}, "bwd": {"none": 1.0, "hint8": 1.20}}, {"fwd": "none", "bwd": "none"}),
        (
            {"fwd": {"none": 1.0, "hint8": 0.90, "hint6": 0.70}, "bwd": {"none": 0.2, "hint8": 0.5, "hint6": 0.4}},
            {"fwd": "hint6", "bwd": "none"},
        ),
        ({"fwd": {"none": 1.0, "hint8": 0.96}, "bwd": {"none": 1.0, "hint8": 0.97}}, {"fwd": "hint8", "bwd": "none"}),
    ],
)
def test_decide_takes_the_fastest_only_beyond_the_margin(times, want):
    """A codec wins a direction only if it beats `none` by more than tp_auto.MARGIN (3%): `auto` is
    never slower than uncompressed beyond timing noise, and each direction decides alone."""
    assert tp_auto.decide(times) == want


def _measure(rank, world):
    return tp_auto.measure(comm_for(rank, world), 4096, 64, torch.float32, torch.device("cpu"), ("hint8",), reps=2)


def test_measure_gives_every_rank_the_same_timings():
    """The harness runs the real collectives (here on gloo) and takes each entry's largest time over
    the job, so every rank decides alike."""
    a, b = run_ranks(_measure, 2)
    assert a == b and set(a) == {"fwd", "bwd"}
    assert all(set(t) == {"none", "hint8"} and all(v >= 0 for v in t.values()) for t in a.values())
    assert a["fwd"]["none"] > 0 and a["fwd"]["hint8"] > 0


def test_auto_without_gpus_is_none_and_is_a_valid_setting():
    comm = comm_for(0, 1, fwd_codec="auto", bwd_codec="auto")
    decision = tp_auto.choose(comm, 1 << 20, 64, torch.float32, torch.device("cpu"))
    assert (comm.fwd_codec, comm.bwd_codec) == ("none", "none") and "no GPU" in decision["why"]
    comm = comm_for(0, 1, fwd_codec="auto", bwd_codec="hint6")  # a direction given explicitly stays
    tp_auto.choose(comm, 1 << 20, 64, torch.float32, torch.device("cpu"))
    assert (comm.fwd_codec, comm.bwd_codec) == ("none", "hint6")
    config.check(config.parse(["--tp_codec=auto", "--tp_auto_bits=6"]), 1)
    with pytest.raises(config.ConfigError, match="tp_auto_bits=4"):
        config.check(config.parse(["--tp_codec=auto", "--tp_auto_bits=4"]), 1)
