"""
The fused CUDA kernels (taco_kernels.cu), JIT-built on first use into build/taco_kernels, and the
calls into them. taco.Codec calls the binding's encode / decode / reduce_encode (load().encode(...))
for CUDA tensors of a codec that supports() covers; taco_symm.py calls its two_shot (the whole
symmetric-memory all-reduce, given a TwoShotPlan filled by name) and its helpers for messages in the peers'
symmetric memory (taco_symm.py wraps them). Beside the loader: what a GPU route lacks (gpu_missing), in one line.

A codec reaches the kernels as one named struct, TacoParams (taco_kernels.h; taco_binding.cpp
exposes it as ext.Params with the same field names): params() below fills it by name.
"""

import functools
import hashlib
import os
import re
import subprocess
import sys

import torch.distributed as dist

SOURCES = ("taco_binding.cpp", "taco_kernels.cu", "taco_symm.cu")  # one extension
MAX_PEERS = 8  # TACO_MAX_PEERS in taco_kernels.h: messages at up to 8 addresses
_HERE = os.path.dirname(os.path.abspath(__file__))
_EXT = None


class Pending:
    """What an asynchronous collective returns (taco.all_reduce, taco_symm.Workspace): wait() runs the
    rest of the collective, once."""

    def __init__(self, rest):
        self.rest = rest

    def wait(self):
        if self.rest is not None:
            self.rest()
            self.rest = None
        return True


def supports(cd):
    """The kernels are built for blocks of 256 elements and for the (format, rotation, scale) of the codecs in
    taco.CODECS with a block scale or none: rotated + block scale in E4M3, E5M2, INT8, INT6 (taco,
    its variants, hint8, hint6), and E4M3 also rotated without a scale (ash) and unrotated (ds, fp8);
    taco_kernels.cu's kernels() has one instantiation each. The per-tensor-scale ablations
    (fp8-tensor, hadamard) need a grid-wide absmax, INT4, other block sizes and other codecs other
    layouts: those run on the PyTorch reference, also on the GPU."""
    sp = getattr(cd, "spec", None)
    if sp is None or cd.block != 256 or sp.scale == "tensor":
        return False
    return sp.fmt == "e4m3" or (sp.rotate and sp.scale == "block" and sp.fmt in ("e5m2", "int8", "int6"))


def load(verbose=False):
    """Build (first time: about a minute for the binding; after a kernel edit: seconds, ninja
    rebuilds only taco_kernels.cu) and load the extension. Under torchrun call it on every rank at
    start: local rank 0 builds, the others wait at a barrier and then load the finished build
    (concurrent JIT builds of one directory race, or hang on a stale lock). The GPU's own
    architecture is built unless TORCH_CUDA_ARCH_LIST says otherwise."""
    global _EXT
    if _EXT is not None:
        return _EXT
    why = gpu_missing()
    if why:
        raise RuntimeError(f"taco_ext: cannot build the CUDA kernels: {why}")
    from torch.utils.cpp_extension import load as jit_load

    # TACO_NVCC_FLAGS: extra nvcc flags for kernel work, e.g. "-lineinfo" (ncu source view);
    # each set of flags gets its own build directory and module name
    extra = os.environ.get("TACO_NVCC_FLAGS", "").split()
    tag = "_" + hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8] if extra else ""
    build = os.path.join(_HERE, "build", "taco_kernels" + tag)
    os.makedirs(build, exist_ok=True)
    build_it = lambda: jit_load(
        name="taco_ext" + tag,
        sources=[os.path.join(_HERE, f) for f in SOURCES],
        extra_cuda_cflags=["-O3", "-fmad=false"] + _split_compile() + extra,
        extra_include_paths=[_HERE],
        build_directory=build,
        verbose=verbose,
    )
    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if shared and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        dist.barrier()  # wait for local rank 0's build
        _EXT = build_it()
    else:
        if not any(f.endswith(".so") for f in os.listdir(build)):
            print(
                f"taco_ext: building the CUDA kernels into {os.path.relpath(build)} (the first build takes "
                f"about a minute; later ones only what changed)",
                flush=True,
            )
        _EXT = build_it()
        if shared:
            dist.barrier()
    return _EXT


@functools.lru_cache(maxsize=1)  # asked by gpu_missing and _split_compile: one nvcc run
def _nvcc_version():
    """(major, minor) of the nvcc the build would run (CUDA_HOME's, as torch's JIT finds it), or None."""
    from torch.utils.cpp_extension import CUDA_HOME

    try:
        out = subprocess.run(
            [os.path.join(CUDA_HOME or "/usr/local/cuda", "bin", "nvcc"), "--version"], capture_output=True, text=True
        ).stdout
        return tuple(map(int, re.search(r"release (\d+)\.(\d+)", out).groups()))
    except (OSError, AttributeError):
        return None


def gpu_missing(build=True):
    """What a GPU route lacks here, in one line with the fix, before any build or CUDA call (None:
    nothing). build: the kernels will be compiled, so an nvcc of torch's CUDA major version is needed."""
    import torch

    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU build: install a CUDA build of torch "
            f"(pip install torch --index-url https://download.pytorch.org/whl/cu130, or your CUDA's)"
        )
    if not torch.cuda.is_available():
        return (
            "no CUDA GPU is visible (torch.cuda.is_available() is False): run on a GPU machine, "
            "check CUDA_VISIBLE_DEVICES"
        )
    nvcc, want = _nvcc_version(), int(torch.version.cuda.split(".")[0])
    if build and nvcc is None:
        return f"no nvcc found (CUDA_HOME, /usr/local/cuda): install the CUDA {want} toolkit and set CUDA_HOME to it"
    if build and nvcc[0] != want:
        return (
            f"nvcc is CUDA {nvcc[0]}.{nvcc[1]}, torch is built for CUDA {torch.version.cuda}: "
            f"set CUDA_HOME to a CUDA {want} toolkit"
        )
    return None


def require_gpu(what, build=True):
    """Exit 2 with one line when `what` (a GPU route: a benchmark, the kernel tests, --device=cuda)
    cannot run on this machine."""
    why = gpu_missing(build)
    if why:
        print(f"{what} needs a CUDA GPU with its toolkit: {why}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _split_compile():
    """nvcc >= 12.1 optimises the kernels on all CPU threads with --split-compile=0 (a kernel edit
    rebuilds in about half the time; the code is the same)."""
    v = _nvcc_version()
    return ["--split-compile=0"] if v and v >= (12, 1) else []


@functools.lru_cache(maxsize=1024)
def params(cd, L):
    """The kernels' TacoParams for codec cd and messages of L elements (the kernels index blocks
    with 32-bit integers: at most 2^38 elements per message)."""
    if L >= 2**38:
        raise ValueError(f"taco kernels: a message of {L} elements; at most 2^38 (split the tensor)")
    sp, p = cd.spec, load().Params()
    p.fmt = getattr(load().Fmt, sp.fmt)
    p.adaptive, p.rotate, p.scale_block, p.nmeta = sp.adaptive, sp.rotate, sp.scale == "block", cd.nmeta
    p.tau, p.eps, p.inv_sqrt_block, p.qmax = cd.tau, cd.eps, cd.inv_sqrt_block, cd.qmax
    p.L, p.S = L, cd.nbytes(L)
    return p
