"""The fused CUDA kernels against the PyTorch reference, bit for bit. Skipped without a GPU.

The reference is run twice: on the CPU, and on the GPU (torch's own CUDA ops); the kernel must give
the same bytes as both. Decoded values are compared bitwise too (NaN positions must match; NaN
payload bits are not compared)."""

import os
import time

if __name__ == "__main__":  # --watch forks CUDA-free: ask NVML, not the CUDA driver, whether a GPU is there
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest
import torch

import taco
import taco_ext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KERNEL_CODECS = [n for n in taco.CODECS if taco_ext.supports(taco.get_codec(n))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return taco_ext.load()


def inputs(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.02 + torch.randn(n, generator=g).pow(3) * 0.01
    x[torch.randint(0, n, (max(1, n // 300),), generator=g)] *= 50.0  # outliers
    if n > 2000:
        x[256:512] = 0.0  # an all-zero block
        x[512:768] = torch.randn(256, generator=g) * 1e-30  # a tiny block (fp32 only)
        x[1000] = float("nan")
        x[1300] = float("inf")
        x[1600] = float("-inf")
        x[1900:1910] *= 1e4
        x[2048:2304] = torch.randn(256, generator=g) * 1e35  # huge: scales past 2^100 (inf in fp16)
        x[2304:2560] = torch.randn(256, generator=g) * 1e37  # the transform overflows
    if n > 4000:
        x[2560:2816] = 0.0
        x[2600] = 1e-36  # zeros and one tiny value
        x[2816:3072] = 3e37  # one sign, huge: H(x) > fp32 max
        x[3072:3328] *= 1e-3
        x[3100] = 3e37  # one huge value among small ones
        x[3328:3584] = 65000.0 + torch.randn(256, generator=g)  # near fp16's max
    return x.to(dtype)


def same_values(a, b):
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


SIZES = [1, 255, 257, 4097, 3 * 65536 + 5]


@pytest.mark.parametrize("name", KERNEL_CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_decode_bit_exact(name, dtype):
    cd = taco.get_codec(name)
    for seed, n in enumerate(SIZES):
        x = inputs(n, dtype, seed)
        for M in (1, 3):
            L = cd.padded(-(-n // M))
            ref_cpu = cd._encode_ref(x, M, L)
            xg = x.cuda()
            ref_gpu = cd._encode_ref(xg, M, L)
            ker = cd.encode(xg, M, L)
            assert torch.equal(ker.cpu(), ref_cpu), (name, dtype, n, M, (ker.cpu() != ref_cpu).nonzero()[:5])
            assert torch.equal(ref_gpu.cpu(), ref_cpu), (name, dtype, n, M, "torch CPU vs torch CUDA")
            for odt in DTYPES:
                dec_ref = cd.decode(ref_cpu, L, n, odt)  # the reference (CPU)
                dec_ker = cd.decode(ker, L, n, odt)
                assert same_values(dec_ker.cpu(), dec_ref), (name, dtype, odt, n, M)


@pytest.mark.parametrize("name", KERNEL_CODECS)
@pytest.mark.parametrize("P", [2, 3, 8])
def test_reduce_encode_bit_exact(name, P):
    cd = taco.get_codec(name)
    L = 256 * 129
    msgs = torch.stack([cd._encode_ref(inputs(L, torch.float32, 10 + r), 1, L)[0] for r in range(P)])
    ref = cd.reduce_encode(msgs, L)  # CPU tensors: the reference
    ker = cd.reduce_encode(msgs.cuda(), L)
    assert torch.equal(ker.cpu(), ref)
    odd = torch.empty(msgs.numel() + 8, dtype=torch.uint8, device="cuda")[8:].view(msgs.shape)
    odd.copy_(msgs)  # messages not 16-byte aligned: not staged
    assert torch.equal(cd.reduce_encode(odd, L).cpu(), ref)


@pytest.mark.parametrize("name", ["hint8", "hint6", "taco"])
def test_grid_stride_loops_bit_exact(name, monkeypatch):
    """More blocks than one pass of each capped grid covers, so that every warp loops over groups,
    loading the next while it computes this one; the reference is torch's, on the GPU."""
    cd = taco.get_codec(name)
    n = 12 * 2**20 + 5
    L = cd.padded(n)

    def reference(f):
        monkeypatch.setenv("TACO_KERNELS", "0")
        try:
            return f()
        finally:
            monkeypatch.setenv("TACO_KERNELS", "1")

    msgs = []
    for dtype in (torch.bfloat16, torch.float32):
        x = inputs(n + 1, dtype, 11).cuda()
        for xs in (x[:n], x[1:]):  # from an aligned and an unaligned start
            ker = cd.encode(xs, 1, L)
            assert torch.equal(ker, reference(lambda: cd.encode(xs, 1, L))), (dtype, xs.data_ptr() % 16)
            assert same_values(cd.decode(ker, L, n, dtype), reference(lambda: cd.decode(ker, L, n, dtype)))
            msgs.append(ker[0])
    for P in (2, 8):  # 8: the most shared memory the reduce step takes
        m = torch.stack((msgs * 2)[:P])
        assert torch.equal(cd.reduce_encode(m, L), reference(lambda: cd.reduce_encode(m, L))), P


FIRST_LAUNCH_IN_A_GRAPH = """
import torch, taco, taco_ext
taco_ext.load()
cd, n = taco.get_codec("hint8"), 12 * 2 ** 20 + 5
L = cd.padded(n)
x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
msgs = torch.stack([cd._encode_ref(x, 1, L)[0], cd._encode_ref(x.flip(0), 1, L)[0]])
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, stream=s):
    out = (cd.encode(x, 1, L), cd.reduce_encode(msgs, L), cd.decode(msgs, L, n, torch.bfloat16))
graph.replay()
torch.cuda.synchronize()
eager = (cd.encode(x, 1, L), cd.reduce_encode(msgs, L), cd.decode(msgs, L, n, torch.bfloat16))
assert all(torch.equal(a, b) for a, b in zip(out, eager)), "replayed != eager"
"""


def test_first_launches_inside_a_cuda_graph_capture():
    """A process's first launch of a kernel may come inside a CUDA-graph capture (the symm transport
    captures its first all-reduce): what a launch asks the driver must not break the capture. In a
    fresh process, so that nothing was launched before."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", FIRST_LAUNCH_IN_A_GRAPH], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_decode_saturates_like_the_reference():
    """Values past the output type's largest become it, fp32 overflows included (16-bit outputs
    saturate in their conversion): messages whose alpha is so small that 1/alpha carries the decoded
    values past fp32's max, or is itself Inf."""
    for name in [n for n in KERNEL_CODECS if taco.get_codec(n).spec.adaptive]:
        cd = taco.get_codec(name)
        L, nb = 4096, 16
        buf = cd._encode_ref(inputs(L, torch.float32, 7) * 10, 1, L)
        pay = nb * 256 * cd.bits // 8
        meta = buf[0, pay : pay + nb * cd.nmeta * 4].view(torch.float32).view(nb, cd.nmeta)
        meta[:8, 0] = 2e-38  # 1/alpha = 5e37: |y| > 6.8 overflows
        meta[8:12, 0] = 1e-41  # 1/alpha = Inf
        for odt in DTYPES:
            ref = cd.decode(buf, L, L, odt)
            assert torch.isinf(cd._decode_ref(buf, L)).any() and not torch.isinf(ref).any()
            assert same_values(cd.decode(buf.cuda(), L, L, odt).cpu(), ref), (name, odt)


def test_decode_writes_into_a_strided_slice_only():  # the hack loop's test (README)
    decode_into_a_slice(torch.bfloat16, 1000)


@pytest.mark.parametrize("odt", DTYPES)
@pytest.mark.parametrize("at", [1000, 1004, 1001])  # fp32: 32-byte aligned, 16-byte aligned, neither
def test_decode_into_slices_of_every_dtype_and_alignment(odt, at):
    decode_into_a_slice(odt, at)


def decode_into_a_slice(odt, at):
    cd = taco.get_codec("hint8")
    x = inputs(5000, torch.bfloat16, 3).cuda()
    buf = cd.encode(x, 2, cd.padded(2500))
    out = torch.full((7000,), 7.0, dtype=odt, device="cuda")
    cd.decode(buf, cd.padded(2500), 5000, out=out[at : at + 5000])
    assert (out[:at] == 7).all() and (out[at + 5000 :] == 7).all()
    assert same_values(out[at : at + 5000].cpu(), cd.decode(buf.cpu(), cd.padded(2500), 5000, odt))


def test_roundtrip_on_gpu_matches_cpu():
    for name in KERNEL_CODECS:
        cd = taco.get_codec(name)
        x = inputs(100_003, torch.bfloat16, 5)
        assert same_values(cd.roundtrip(x.cuda()).cpu(), cd.roundtrip(x))


KERNEL_SOURCES = [
    os.path.join(os.path.dirname(os.path.abspath(taco_ext.__file__)), f)
    for f in taco_ext.SOURCES + ("taco_kernels.h", "taco_kernels_io.cuh", "taco_kernels_lanes.cuh", "taco_binding.h")
]


def run_selected(names):
    """Build/load the extension, then run the parameterless tests whose names contain one of
    `names` (every one without names). Returns the number that failed."""
    taco_ext.load()
    failed = 0
    for name, fn in sorted(globals().items()):
        if (
            name.startswith("test_")
            and callable(fn)
            and fn.__code__.co_argcount == 0
            and (not names or any(n in name for n in names))
        ):
            try:
                fn()
                print(f"{name}: passed", flush=True)
            except Exception as e:  # report and go on with the others
                failed += 1
                print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
    return failed


def watch(names, run=run_selected, sources=KERNEL_SOURCES, poll=0.1, rounds=None):
    """The edit -> rerun loop with the interpreter kept warm: this process imports torch once and
    never touches the GPU; every round forks a child that builds (ninja recompiles what changed),
    loads the extension, runs the tests on a fresh CUDA context and exits. A round starts at once,
    then whenever a source's modification time changes. Prints the time from the edit to the
    result. `rounds`: stop after that many (tests)."""
    stamp = lambda: [os.stat(f).st_mtime_ns for f in sources]
    seen, done = stamp(), 0
    while rounds is None or done < rounds:
        t0 = time.time()
        pid = os.fork()
        if pid == 0:  # the child: build, load, test
            code = 1
            try:
                code = min(run(names), 1)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        ok = os.WEXITSTATUS(status) == 0 if os.WIFEXITED(status) else False
        print(
            f"--- {'passed' if ok else 'FAILED'} in {time.time() - t0:.1f} s from the edit; "
            f"waiting for the next save of {', '.join(os.path.basename(f) for f in sources)}",
            flush=True,
        )
        done += 1
        while (rounds is None or done < rounds) and stamp() == seen:
            time.sleep(poll)
        while stamp() != seen:  # until the save is written out
            seen = stamp()
            time.sleep(poll)


if __name__ == "__main__":
    # The kernel edit -> rerun loop without pytest's start-up:
    #   python -m tests.test_kernels [NAME ...]           run the parameterless tests whose names contain NAME
    #   python -m tests.test_kernels --watch [NAME ...]   the same again at every save of the kernel sources
    import sys

    args = sys.argv[1:]
    taco_ext.require_gpu("python -m tests.test_kernels")
    if "--watch" in args:
        watch([a for a in args if a != "--watch"])
    else:
        t0 = time.time()
        failed = run_selected(args)
        print(f"{time.time() - t0:.1f} s (build included)")
        raise SystemExit(1 if failed else 0)
