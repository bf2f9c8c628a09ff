"""The two-shot compressed collectives on gloo: agreement with torch.distributed, bitwise identity
across ranks, world sizes 2-4, odd sizes, chunking."""

import pytest
import torch
import torch.distributed as dist

import taco
from lab.emulate import emulated_all_reduce
from launcher import run_ranks
from test_codecs import realistic, rel_err


def _all_reduce(rank, world, n, codec, chunks, dtype):
    x = realistic(n, seed=rank).to(dtype)
    ref = x.clone()
    dist.all_reduce(ref)
    stats = taco.CommStats()
    out = taco.all_reduce(x.clone(), codec=codec, chunks=chunks, stats=stats)
    return out, ref, stats


CASES = [
    (codec, n, chunks)
    for codec in ("hint8", "taco", "hint6", "tahquant")
    for n, chunks in ((1, 1), (1000, 1), (256 * 7 + 3, 3), (12289, 2))
]


def _all_reduce_cases(rank, world):
    return [_all_reduce(rank, world, n, codec, chunks, torch.float32) for codec, n, chunks in CASES]


def _suite(rank, world):
    """Every check of this file that runs at `world` ranks, on one launch (a launch costs seconds)."""
    out = {"cases": _all_reduce_cases(rank, world)}
    if world == 2:
        out["bf16"] = _all_reduce(rank, world, 64 * 1024, "hint8", 2, torch.bfloat16)
        out["strided"] = _strided(rank, world)
        out["nan"] = _nonfinite(rank, world)
    if world == 3:
        out["none"] = _all_reduce(rank, world, 5000, "none", 1, torch.float32)
        out["emulation"] = _emulation(rank, world)
    if world == 4:
        out["rs_ag"] = {codec: _rs_ag(rank, world, codec) for codec in ("none", "hint8", "taco")}
    return out


_LAUNCHES = {}


def at(world, key):
    """[what rank r's _suite returned under `key`, for r in ranks]: one launch per world size."""
    if world not in _LAUNCHES:
        _LAUNCHES[world] = run_ranks(_suite, world)
    return [r[key] for r in _LAUNCHES[world]]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_close_and_bitwise_identical(world):
    per_rank = at(world, "cases")
    for i, (codec, n, chunks) in enumerate(CASES):
        out0 = per_rank[0][i][0]
        for rank in range(world):
            out, ref, stats = per_rank[rank][i]
            assert torch.equal(out.view(torch.int32), out0.view(torch.int32)), (codec, n)  # bit for bit
            # two quantisations (shards, then the reduced shard): about twice the codec's roundtrip
            # error on the sum; hint8 ~0.5%, taco (E4M3) ~3%, tahquant (3.5 bits) ~15% per roundtrip
            tol = {"hint8": 0.02, "hint6": 0.06, "taco": 0.08, "tahquant": 0.35}[codec]
            assert rel_err(out, ref) < tol, (codec, n)
            assert stats.calls == 1 and stats.wire_bytes > 0


def test_codec_none_equals_dist_all_reduce():
    for out, ref, stats in at(3, "none"):
        assert torch.equal(out, ref) and stats.ratio == 1.0


def test_bf16_all_reduce_keeps_dtype_and_halves_the_bytes():
    for out, ref, stats in at(2, "bf16"):
        assert out.dtype == torch.bfloat16
        assert rel_err(out.float(), ref.float()) < 0.02
        assert 1.9 < stats.ratio < 2.0  # (256 + 4) bytes per 256 bf16 elements


def _nonfinite(rank, world):
    x = realistic(2048, seed=rank)
    if rank == 1:
        x[100] = float("nan")
    return taco.all_reduce(x, codec="hint8")


def _strided(rank, world):
    base = realistic(2 * 3001, seed=rank)
    x, ref = base[::2], base[::2].clone()  # a non-contiguous 1-D view, and its copy
    taco.all_reduce(x, codec="hint8")
    taco.all_reduce(ref, codec="hint8")
    return x, ref, base[1::2], realistic(2 * 3001, seed=rank)[1::2]


def test_non_contiguous_input_is_reduced_in_place_like_its_copy():
    for x, ref, untouched, original in at(2, "strided"):
        assert torch.equal(x, ref) and torch.equal(untouched, original)  # the other half stays as it was


def test_nan_on_one_rank_propagates_to_all():
    for out in at(2, "nan"):
        assert torch.isnan(out[100]) and torch.isfinite(out[256:]).all()


def _rs_ag(rank, world, codec):
    x = realistic(4 * 1000, seed=rank)
    ref = torch.empty(1000)
    dist.reduce_scatter_tensor(ref, x.clone())
    rs = taco.reduce_scatter(x, codec=codec)
    ag = taco.all_gather(ref, codec=codec)
    ag_ref = torch.empty(4000)
    dist.all_gather_into_tensor(ag_ref, ref)
    return rs, ref, ag, ag_ref


@pytest.mark.parametrize("codec", ["none", "hint8", "taco"])
def test_reduce_scatter_and_all_gather(codec):
    results = [r[codec] for r in at(4, "rs_ag")]
    for rs, ref, ag, ag_ref in results:
        tol = 0 if codec == "none" else 0.05
        assert rel_err(rs, ref) <= tol and rel_err(ag, ag_ref) <= tol
        assert torch.equal(ag, results[0][2])


EMULATED = ["taco", "hint6", "hadamard", "tahquant"]  # block, packed, per-message scale, tiles


def _emulation(rank, world):
    partials = [realistic(3001, seed=r) for r in range(world)]
    return [
        (taco.all_reduce(partials[rank].clone(), codec=c), emulated_all_reduce(partials, codec=c)) for c in EMULATED
    ]


def test_single_process_emulation_is_bitwise_the_real_collective():
    for per_codec in at(3, "emulation"):
        for codec, (real, emulated) in zip(EMULATED, per_codec):
            assert torch.equal(real, emulated), codec


def _mismatched(rank, world):
    """Each case: what every rank passes (codec, block size, elements, dtype); one rank differs."""
    cases = [
        [("hint8", 256, 1000, torch.float32), ("taco", 256, 1000, torch.float32)],
        [("hint8", 256, 1000, torch.float32), ("hint8", 128, 1000, torch.float32)],
        [("hint8", 256, 1000, torch.float32), ("hint8", 256, 1010, torch.float32)],  # pad to one length
        [("hint8", 256, 1000, torch.float32), ("hint8", 256, 1000, torch.bfloat16)],
    ]
    if world == 3:
        cases = [[("hint8", 256, 1000, torch.float32)] * 2 + [("hint8", 256, 1100, torch.float32)]]
    out = []
    for case in cases:
        codec, block, n, dtype = case[rank]
        try:
            taco.all_reduce(torch.ones(n, dtype=dtype), codec=codec, codec_block=block)
            out.append("no error")
        except RuntimeError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_are_told_so(world):
    """Different codecs, block sizes, element counts (1000 and 1010 elements pad to the same message
    length, so the bytes alone would sum silently) or dtypes: every rank raises, naming what each passed."""
    for msgs in run_ranks(_mismatched, world, timeout=120):  # told in a second; a hang fails here, not at 300 s
        assert all(
            "the ranks of a group pass different codecs, block sizes, element counts or dtypes" in m for m in msgs
        ), msgs
    if world == 2:
        assert (
            "rank 0: 'hint8', block 256, 1000 x torch.float32; rank 1: 'hint8', block 256, 1010 x torch.float32"
            in msgs[2]
        )
    else:
        assert "rank 2: 'hint8', block 256, 1100 x torch.float32" in msgs[0]
