"""The symmetric-memory transport of the compressed collectives (taco_symm.py): the same
bits as the torch.distributed path, identical on every rank, across changing sizes, mixed
collectives, async handles and CUDA-graph replay. Needs 2 GPUs with peer access (NCCL ranks);
one GPU runs the workspace's single binding call on a 1-rank group, and two ranks (barriers
included) in one process; on CPU only the transport choice is tested (gloo)."""

import time

import pytest
import torch
import torch.distributed as dist

import taco
import taco_ext
from launcher import run_ranks

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _data(n, dtype, seed, rank):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, generator=g) * 0.05
    x[torch.randint(0, n, (max(1, n // 500),), generator=g)] *= 40.0
    return x.to(dtype).cuda()


def _fingerprint(x):
    """Bits of x, summed two ways (cheap to compare across ranks, sensitive to any bit)."""
    b = x.contiguous().view(torch.uint8).long()
    return torch.stack([b.sum(), (b * torch.arange(1, b.numel() + 1, device=b.device) % 65521).sum()]).cpu()


def _symm_cases(rank, world):
    taco_ext.load()
    out, fps = {}, []  # fps: fingerprints of results, compared across ranks at the end
    # 1. all_reduce: symm == dist bit for bit; changing sizes (odd, growing, shrinking), codecs, dtypes
    cases = [
        ("hint8", 1 << 20, torch.bfloat16),
        ("taco", 1000003, torch.bfloat16),
        ("hint6", 777, torch.float32),
        ("hint8", 3 << 22, torch.bfloat16),
        ("taco-e5m2", 5000, torch.float16),
        ("hint8", 256, torch.float32),
    ]
    for i, (codec, n, dtype) in enumerate(cases):
        x = _data(n, dtype, i, rank)
        a, b = x.clone(), x.clone()
        sa, sb = taco.CommStats(), taco.CommStats()
        taco.all_reduce(a, codec=codec, transport="dist", stats=sa)
        taco.all_reduce(b, codec=codec, transport="symm", stats=sb)
        out[f"ar {codec} {n} {dtype}"] = (
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)),
            sa.wire_bytes == sb.wire_bytes,
        )
        fps.append(_fingerprint(b))
    # a non-contiguous tensor (its flat copy is reduced and written back)
    x = _data(2 * 5000, torch.bfloat16, 8, rank).view(5000, 2).t()
    a, b = x.clone(), x.clone()  # clone keeps the strides: both non-contiguous
    taco.all_reduce(a, codec="hint8", transport="dist")
    taco.all_reduce(b, codec="hint8", transport="symm")
    out["ar non-contiguous"] = (not b.is_contiguous() and torch.equal(a, b), True)
    # 2. NaN on one rank reaches every rank
    x = _data(4096, torch.bfloat16, 9, rank)
    if rank == 1:
        x[300] = float("nan")
    taco.all_reduce(x, codec="hint8", transport="symm")
    out["nan"] = (bool(torch.isnan(x[256:512]).all()), bool(torch.isfinite(x[:256]).all()))
    # 3. reduce_scatter and all_gather, interleaved with all_reduce on the same workspace
    for codec in ("hint8", "taco"):
        x = _data(world * 3000, torch.bfloat16, 20, rank)
        rs = [taco.reduce_scatter(x, codec=codec, transport=t) for t in ("dist", "symm")]
        y = _data(5000, torch.bfloat16, 21, rank)
        ag = [taco.all_gather(y, codec=codec, transport=t) for t in ("dist", "symm")]
        z = _data(70000, torch.bfloat16, 22, rank)
        taco.all_reduce(z, codec=codec, transport="symm")
        out[f"rs/ag {codec}"] = (torch.equal(rs[0], rs[1]), torch.equal(ag[0], ag[1]))
        fps += [_fingerprint(ag[1]), _fingerprint(z)]
    # 4. async: the handle orders the caller's stream; other work meanwhile
    x = _data(1 << 20, torch.bfloat16, 30, rank)
    ref = x.clone()
    taco.all_reduce(ref, codec="hint8", transport="symm")
    h = taco.all_reduce(x, codec="hint8", transport="symm", async_op=True)
    w = torch.randn(2048, 2048, device="cuda") @ torch.randn(2048, 2048, device="cuda")  # meanwhile
    h.wait()
    out["async"] = torch.equal(x, ref) and bool(torch.isfinite(w).all())
    # 5. CUDA graph: two all-reduces captured once, replayed with new inputs each time
    n = 1 << 18
    static = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    for s in static:  # warm-up: the buffer is big enough
        taco.all_reduce(s, codec="hint8", transport="symm")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in static:
            taco.all_reduce(s, codec="hint8", transport="symm")
    ok = True
    for rep in range(5):
        inputs = [_data(n, torch.bfloat16, 40 + rep * 2 + k, rank) for k in range(2)]
        for s, v in zip(static, inputs):
            s.copy_(v)
        graph.replay()
        for s, v in zip(static, inputs):
            e = v.clone()
            taco.all_reduce(e, codec="hint8", transport="dist")
            ok &= torch.equal(s, e)
    torch.cuda.synchronize()
    out["graph"] = ok
    # 6. uncompressed over symmetric memory (torch's two-shot): the sum, odd sizes and fp32 too
    for n, dtype in ((1 << 20, torch.bfloat16), (3 * 65536 + 5, torch.bfloat16), (4097, torch.float32)):
        a = _data(n, dtype, 60, rank)
        b = a.clone()
        dist.all_reduce(a)
        taco.all_reduce(b, codec="none", transport="symm")
        torch.cuda.synchronize()
        out[f"plain symm {n} {dtype}"] = torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)
        fps.append(_fingerprint(b))
    # 7. every rank the same bits
    fps = torch.stack(fps + [_fingerprint(s) for s in static]).cuda()
    allf = [torch.empty_like(fps) for _ in range(world)]
    dist.all_gather(allf, fps)
    out["identical across ranks"] = all(torch.equal(allf[0], f) for f in allf)
    return out


@two_gpus
def test_symmetric_memory_transport_matches_nccl_bitwise():
    per_rank = run_ranks(_symm_cases, 2, backend="nccl")
    for rank, out in enumerate(per_rank):
        for key, v in out.items():
            if key.startswith("ar "):
                assert v[0], f"rank {rank} {key}: symm and dist results differ"
                assert v[1], f"rank {rank} {key}: wire bytes differ"
            elif key.startswith("rs/ag"):
                assert v[0] and v[1], f"rank {rank} {key}: reduce_scatter/all_gather differ from dist"
            elif key == "nan":
                assert v == (True, True), f"rank {rank}: NaN block not propagated exactly"
            else:
                assert v, f"rank {rank}: {key} failed"


def _codec_steps(cd, xs):
    """What an all-reduce of the ranks' tensors xs gives through the codec's own steps: each rank
    encodes W messages, rank q reduces every rank's message q, every rank decodes the W results."""
    W, n = len(xs), xs[0].numel()
    L = cd.padded(-(-n // W))
    sent = [cd.encode(x, W, L) for x in xs]
    reduced = [cd.reduce_encode(torch.stack([s[q] for s in sent]), L) for q in range(W)]
    return cd.decode(torch.stack(reduced), L, n, xs[0].dtype)


def _one_rank_cases(rank, world):
    """On a 1-rank group (taco.all_reduce itself returns at once there), the workspace's
    all-reduce against _codec_steps."""
    import taco_symm

    taco_ext.load()
    ws = taco_symm.Workspace(None, torch.device("cuda", 0))
    same = lambda u, v: torch.equal(_fingerprint(u), _fingerprint(v))
    out = {}
    for codec, n, dtype in (
        ("hint8", 1 << 20, torch.bfloat16),
        ("taco", 100_001, torch.float32),
        ("hint6", 3 * 4096 + 7, torch.float16),
        ("hint8", 1 << 22, torch.bfloat16),
        ("hint8", 1000, torch.bfloat16),
    ):
        cd = taco.get_codec(codec)
        x = _data(n, dtype, 3, 0)
        x[n // 2] = float("nan")
        ref = _codec_steps(cd, [x])
        a, b, c = x.clone(), x.clone(), x.clone()
        ws.all_reduce(a, cd, None, async_op=False)  # captured as a graph, which runs
        h = ws.all_reduce(b, cd, None, async_op=True)
        h.wait()
        ok = same(a, ref) and same(b, ref)
        a.copy_(x)
        ws.all_reduce(a, cd, None, async_op=False)  # the graph replayed
        taco_ext.load().two_shot(c, ws.plans[(n, cd)], replay=False)  # five launches
        out[f"{codec} {n} {dtype}"] = (ok, same(a, ref) and same(c, ref))
    cd, x, y = taco.get_codec("hint8"), _data(1 << 20, torch.bfloat16, 5, 0), _data(1 << 20, torch.bfloat16, 6, 0)
    a, b = x.clone(), y.clone()  # an eager call while an async one is unfinished: in order
    h = ws.all_reduce(a, cd, None, async_op=True)
    ws.all_reduce(b, cd, None, async_op=False)
    h.wait()
    out["async, then eager before its wait"] = (same(a, _codec_steps(cd, [x])), same(b, _codec_steps(cd, [y])))
    x = _data(1 << 16, torch.bfloat16, 4, 0)
    s, graph = x.clone(), torch.cuda.CUDAGraph()
    ws.all_reduce(s, cd, None, async_op=False)  # once before capturing (the plan)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        ws.all_reduce(s, cd, None, async_op=True).wait()
    for _ in range(3):
        s.copy_(x)
        graph.replay()
    torch.cuda.synchronize()
    out["graph replay"] = (same(s, _codec_steps(cd, [x])),) * 2
    return out


@one_gpu
def test_workspace_all_reduce_on_one_rank_equals_the_codec_steps():
    """One binding call (encode, barrier, reduce, barrier, decode) on the workspace's stream, joined
    at once or at wait(), as its own graph (captured, replayed) or five launches, also inside a
    caller's CUDA graph: the codec's own steps' bits."""
    for key, (sync, asy) in run_ranks(_one_rank_cases, 1, backend="nccl")[0].items():
        assert sync and asy, f"{key}: the workspace's all-reduce differs from encode -> reduce -> decode"


@one_gpu
def test_two_ranks_on_one_gpu():
    """Two ranks in one process on one GPU, each with its buffer, signal pad and stream: the
    binding's all-reduce, barriers included, gives both the codec steps' bits, as a graph (captured,
    replayed) and as five launches; rank 0 waits at the barrier until rank 1 comes; every flag is
    lowered again, so calls repeat."""
    import taco_symm

    taco_ext.load()
    W = 2
    bufs = [torch.zeros(1 << 23, dtype=torch.uint8, device="cuda") for _ in range(W)]
    pad_mem = [torch.zeros(2 * W, dtype=torch.int32, device="cuda") for _ in range(W)]  # channels 0, 1
    pads = taco_symm.signal_pads([p.data_ptr() for p in pad_mem])
    streams = [torch.cuda.Stream() for _ in range(W)]
    sides = [(s.stream_id, s.device_index, s.device_type) for s in streams]
    cases = [
        ("hint8", 1 << 20, torch.bfloat16),
        ("taco", 100_001, torch.float32),
        ("hint6", 3 * 4096 + 7, torch.float16),
        ("hint8", 1 << 20, torch.bfloat16),
        ("hint8", 1000, torch.bfloat16),
    ]
    for i, (codec, n, dtype) in enumerate(cases):
        cd = taco.get_codec(codec)
        xs = [_data(n, dtype, i, r) for r in range(W)]
        xs[1][n // 3] = float("nan")
        ref = _codec_steps(cd, xs)
        ptrs = [b.data_ptr() for b in bufs]
        plans = [taco_symm.make_plan(cd, n, r, bufs[r], ptrs, pads, sides[r]) for r in range(W)]
        ys = [x.clone() for x in xs]
        for how in ("graph captured", "graph replayed", "five launches"):
            for r in range(W):
                ys[r].copy_(xs[r])
                taco_ext.load().two_shot(ys[r], plans[r], replay=how != "five launches", join=False)
                if i == 0 and r == 0:
                    time.sleep(0.2)
                    assert not streams[0].query(), f"{how}: rank 0 passed the barrier alone"
            for side in sides:
                taco_symm.join_stream(side)
            torch.cuda.synchronize()
            for r in range(W):
                same = torch.equal(_fingerprint(ys[r]), _fingerprint(ref))
                assert same, f"{codec} {n} {dtype} {how}: rank {r} differs"
    assert not any(p.any() for p in pad_mem), "a flag was left raised"


def _transport_choice(rank, world):
    x = torch.ones(4096)
    res = {
        "auto": torch.equal(
            taco.all_reduce(x.clone(), codec="hint8", transport="auto"),
            taco.all_reduce(x.clone(), codec="hint8", transport="dist"),
        )
    }
    try:
        taco.all_reduce(x.clone(), codec="hint8", transport="symm")
        res["symm"] = "no error"
    except RuntimeError as e:
        res["symm"] = str(e)
    try:
        taco.all_reduce(x.clone(), codec="hint8", transport="nvlink")
        res["bad"] = "no error"
    except ValueError as e:
        res["bad"] = str(e)
    return res


def test_transport_choice_on_cpu():
    """Off the GPU, auto falls back to torch.distributed; asking for symm explains why it cannot."""
    for r in run_ranks(_transport_choice, 2):
        assert r["auto"]
        assert "impossible here: the tensor is not on a GPU" in r["symm"]
        assert "choose auto, dist, symm" in r["bad"]
