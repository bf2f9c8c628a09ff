"""
taco.py — compressing the tensor-parallel all-reduce.

What TP communicates, and why it hurts
--------------------------------------
In a Megatron-style transformer layer the row-parallel linears (attention out-projection, MLP
down-projection) leave every TP rank with a PARTIAL SUM of the layer output: a (B, T, C) tensor
that must be all-reduced before the residual add (g in parallel.py). In the backward pass the
column-parallel linears produce partial input gradients of the same size (f). That is four
all-reduces of B*T*C elements per layer per step, on the critical path. TACO (arXiv 2604.24088)
sends them in 8 bits.

How a codec works (the TACO paper's Section 4, equation numbers as in the paper)
-------------------------------------------------------------------------------
A tensor is flattened and cut into blocks of `block` elements (default 256; the last block is
zero-padded). For each block G_k:

    sigma_k = sqrt(mean(G_k^2) + eps)              (6)  RMS of the block
    alpha_k = tau / sigma_k                        (7)  adaptive scale: bring the RMS to tau
    Z_k     = H(alpha_k * G_k) / sqrt(block)       (8)  Walsh-Hadamard rotation ("ASH" = 7 + 8)
    s_k     = max|Z_k| / Q_max                     (9)  per-block absmax scale ("dual scale": alpha, s)
    q_k     = FP8_E4M3(Z_k / s_k)                  (10) round-to-nearest-even, Q_max = 448
    decode: Z' = q * s;  Y' = H(Z') / sqrt(block);  G' = Y' / alpha        (11)-(13)

(The divisions by s and alpha are multiplications by 1/s and 1/alpha, computed once per block.)
The rotation spreads an outlier over the whole block (every output is a +-1 combination of all
inputs), so the block's absmax shrinks towards its RMS and the 8 bits are spent on the bulk of
the distribution. H / sqrt(block) is orthonormal and its own inverse.

Once (9) is applied, alpha cancels (Z/s = H(G) / max|H(G)| in exact arithmetic), so the codec
`hint8` keeps only s, with INT8 codes, whose uniform grid suits the rotated, near-Gaussian block.
Every codec here is one parameterised pipeline (CODECS): optional alpha, optional rotation, a
scale per block / per message / none, and a code format; a codec of another kind can be
registered in EXTRA_CODECS with the same interface (the lab's `tahquant`).

Wire format: one uint8 buffer per message,

    [ payload: nblocks * block * bits/8 bytes ][ per-block fp32 metadata: (alpha_k, s_k) ][ tensor scale ]

so block k's codes start at k*block*bits/8 and its metadata at payload_bytes + k*nmeta*4. A rotated
block's codes are in lane order (lane_order: the order the kernels hold them after the
transform), which only the rotation undoes. A message is self-contained: it decodes alone.

Non-finite input: a block holding NaN or +-Inf is marked bad (codes 0, scale NaN) and decodes to
NaN (`fp8`: per element). Finite input stays finite where the true result is representable, and
decoded values saturate at the output type's largest finite value (how: Codec._encode_ref; the few
exceptions, marked bad: docs/RELIABILITY.md). float64 goes through as fp32; integer tensors are
refused (codec 'none' carries them); on a codec's first use on a group the ranks check that they
all use it.

The two-shot compressed all-reduce (all_reduce below)
-----------------------------------------------------
    1. split the tensor into W shards (W = group size), each padded to whole blocks
    2. compress every shard                                      -> W messages
    3. all-to-all: message r goes to rank r                       (reduce-scatter phase)
    4. reduce MY shard: the W messages summed in fp32 in rank order 0..W-1 and re-compressed
       (in the rotated domain, Codec.reduce_encode: H is linear, so the inverse and forward
       rotations of decode-sum-encode cancel)
    5. all-gather the re-compressed shards                        (all-gather phase)
    6. decompress ALL W shards, my own included, from the gathered bytes
Step 6 is why every rank ends with bitwise-identical results: each rank decodes the very same
bytes with the same code. The tensor can be cut into `chunks` that pipeline: every chunk's
all-to-all is started before the first one is waited on. Inside one node the same six steps can
run with symmetric memory as the wire (taco_symm.py): the kernels read the peers' messages
directly, two barriers instead of two NCCL calls, the same bytes and results.

On CUDA tensors the fused kernels of taco_kernels.cu (loaded by taco_ext.py) do steps 2, 4 and 6;
elsewhere, and as their definition, the PyTorch reference here."""

import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

import taco_ext
import watchdog

DEFAULT_CODEC = "hint8"  # the most accurate 8-bit codec here (docs/RESULTS.md); `taco` is the paper's
TRANSPORTS = ("auto", "dist", "symm")  # how the compressed bytes travel (taco_symm.workspace)

QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0, "int6": 31.0, "int4": 7.0}
BITS = {"e4m3": 8, "e5m2": 8, "int8": 8, "int6": 6, "int4": 4}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
E4M3_NAN = 0x7F
FP32_MAX = torch.finfo(torch.float32).max
# A rotated block whose absmax (of its values / block) is under TINY / block is scaled in the order
# (g * sqrt(block)) / s, where sqrt(block) / s could overflow; taco_kernels.cu derives its TINY_ABSMAX alike
TINY = 2.0**-80


@dataclass(frozen=True)
class CodecSpec:
    adaptive: bool  # Eq. 6-7: per-block alpha = tau / rms
    rotate: bool  # Eq. 8: block Walsh-Hadamard
    scale: str  # "block" (Eq. 9) | "tensor" (one absmax per message) | "none"
    fmt: str  # "e4m3" | "e5m2" | "int8" | "int6" | "int4"


CODECS = {
    # the paper
    "taco": CodecSpec(True, True, "block", "e4m3"),
    # the paper's ablations (Figs. 11, 13, 14)
    "fp8": CodecSpec(False, False, "none", "e4m3"),  # direct cast ("NVFP8")
    "fp8-tensor": CodecSpec(False, False, "tensor", "e4m3"),  # one absmax scale per tensor
    "ds": CodecSpec(False, False, "block", "e4m3"),  # per-block absmax, no rotation
    "hadamard": CodecSpec(False, True, "tensor", "e4m3"),  # standard Hadamard, one scale
    "ash": CodecSpec(True, True, "none", "e4m3"),  # alpha + Hadamard, saturating cast
    "taco-e5m2": CodecSpec(True, True, "block", "e5m2"),
    "taco-int8": CodecSpec(True, True, "block", "int8"),
    # ours
    "hint8": CodecSpec(False, True, "block", "int8"),  # Hadamard + block absmax INT8
    "hint6": CodecSpec(False, True, "block", "int6"),  # same, 6-bit codes, 4 per 3 bytes
    "hint4": CodecSpec(False, True, "block", "int4"),  # same, 4-bit codes (SDP4Bit-style DP gradients)
}


# -----------------------------------------------------------------------------
# building blocks shared by every codec (the CUDA kernels do the same arithmetic in the same order)


def fwht(x, reverse=False):
    """Unnormalised Walsh-Hadamard transform over the last dim (a power of two), in place order:
    butterflies (a, b) -> (a + b, a - b) with stride 1, 2, 4, ... (reverse: ..., 4, 2, 1). Encode
    runs it forward and decode in reverse, the kernels' orders (the same H, rounded differently)."""
    n, lead = x.shape[-1], x.shape[:-1]
    strides = [1 << i for i in range(n.bit_length() - 1)]
    for h in reversed(strides) if reverse else strides:
        x = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2)
    return x.reshape(*lead, n)


def lane_order(x, inverse=False):
    """A rotated block's codes are stored in the order the kernels hold them after the transform:
    position (n/32) u + m of a block of n holds element u + 32 m (lane u, register m), so that encode writes and
    decode reads each lane's codes as one word. inverse: payload order -> element order."""
    n = x.shape[-1]
    shape = (32, n // 32) if inverse else (n // 32, 32)
    return x.reshape(*x.shape[:-1], *shape).transpose(-1, -2).reshape(x.shape)


def block_sumsq(g):
    """Sum of squares of each block in the kernel's order: thread t of a 32-lane warp owns the
    n/32 consecutive elements of a block of n [t*E, (t+1)*E) and sums them left to right; then the warp folds with
    xor-shuffles 16, 8, 4, 2, 1 (lane i adds lane i^m; the same as folding halves)."""
    n = g.shape[-1]
    sq = (g * g).reshape(*g.shape[:-1], 32, n // 32)
    acc = sq[..., 0]
    for j in range(1, sq.shape[-1]):
        acc = acc + sq[..., j]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def rank_order_sum(parts):
    """parts[0] + parts[1] + ... in that order, in fp32: the one summation order every path uses
    (reference, kernels, emulation), which is what makes their results bit-identical."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


def fdiv(a, b):
    """a / b rounded once to fp32, as the kernels' IEEE division does, identically on every backend
    (computed in float64, exact for fp32 operands; on CUDA, tensor / float multiplies by a reciprocal)."""
    b = b.double() if torch.is_tensor(b) else torch.full_like(a, b, dtype=torch.float64)
    return (a.double() / b).float()


def fsqrt(a):
    """sqrt rounded once to fp32 (in float64), like the kernels' sqrtf (a vectorised CPU sqrt can be 1 ulp off)."""
    return torch.sqrt(a.double()).float()


def pack_bits(q, bits):
    """(..., n) int codes of `bits` bits -> bytes, little-endian: each run of lcm(bits, 8) bits holds
    the next codes as u0 | u1 << bits | ... (INT6: 4 codes in 3 bytes; INT4: 2 in a byte, the first
    in the low nibble). n must fill whole runs (a block does)."""
    k = math.lcm(bits, 8) // bits
    u = (q.to(torch.int32) & ((1 << bits) - 1)).reshape(*q.shape[:-1], -1, k)
    w = sum(u[..., i] << (bits * i) for i in range(k))
    b = torch.stack([(w >> (8 * j)) & 255 for j in range(k * bits // 8)], dim=-1)
    return b.to(torch.uint8).reshape(*q.shape[:-1], -1)


def unpack_bits(b, bits):
    k = math.lcm(bits, 8) // bits
    t = b.to(torch.int32).reshape(*b.shape[:-1], -1, k * bits // 8)
    w = sum(t[..., j] << (8 * j) for j in range(t.shape[-1]))
    u = torch.stack([(w >> (bits * i)) & ((1 << bits) - 1) for i in range(k)], dim=-1)
    sign = 1 << (bits - 1)
    return ((u ^ sign) - sign).reshape(*b.shape[:-1], -1)  # sign-extend


def quantize(y, fmt):
    """y already scaled into [-QMAX, QMAX] (finite). E4M3/E5M2: RNE with saturation; INT: RNE."""
    y = y.clamp(-QMAX[fmt], QMAX[fmt])
    if fmt in FP8_DTYPE:
        return y.to(FP8_DTYPE[fmt]).view(torch.uint8)
    q = torch.round(y)  # round half to even
    return q.to(torch.int8).view(torch.uint8) if fmt == "int8" else pack_bits(q, BITS[fmt])


def dequantize(b, fmt):
    if fmt in FP8_DTYPE:
        return b.view(FP8_DTYPE[fmt]).float()
    return (b.view(torch.int8) if fmt == "int8" else unpack_bits(b, BITS[fmt])).float()


def cdiv(a, b):
    return -(-a // b)


# -----------------------------------------------------------------------------
# the codec


class Codec:
    """A codec = a spec + block size (+ tau, eps for the adaptive scale).

    encode(x, M, L) -> (M, S) uint8     x: 1-D, n <= M*L elements (zero-padded past n); message m
                                        holds elements [m*L, (m+1)*L); L a multiple of the block
    decode(buf, L, n, dtype, out) -> 1-D tensor of the first n elements of the M messages
    reduce_encode(buf: (P, S), L) -> (S,) uint8   sum P messages in fp32 in order, re-encode
    compress(x) -> 1-D uint8;  decompress(buf, shape, dtype);  roundtrip(x)   (any shape and size)

    On CUDA tensors the fused kernels run where they exist (TACO_KERNELS=0 forces this reference);
    everywhere else, this PyTorch reference."""

    def __init__(self, name, codec_block=256, tau=1.0, eps=1e-30):
        if name not in CODECS:
            raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODECS)} or 'none'")
        if codec_block < 32 or codec_block > 1024 or codec_block & (codec_block - 1):
            raise ValueError(f"codec_block={codec_block} must be a power of two in [32, 1024]")
        self.name = name
        self.spec = CODECS[name]
        self.block = codec_block
        self.tau = tau
        self.eps = eps
        self.bits, self.qmax = BITS[self.spec.fmt], QMAX[self.spec.fmt]
        self.nmeta = int(self.spec.adaptive) + int(self.spec.scale == "block")
        self.inv_sqrt_block = float(torch.tensor(1.0 / math.sqrt(codec_block), dtype=torch.float32))  # as fp32

    def __repr__(self):
        return f"Codec({self.name!r}, block={self.block})"

    def padded(self, n):
        return cdiv(n, self.block) * self.block

    def nbytes(self, L):
        """Bytes of one message of L elements (L a multiple of the block), padded to a multiple of 16
        (so every message starts 16-byte aligned in a (M, S) buffer)."""
        nb = L // self.block
        raw = nb * self.block * self.bits // 8 + nb * self.nmeta * 4 + (4 if self.spec.scale == "tensor" else 0)
        return cdiv(raw, 16) * 16

    def kernel_ok(self, t):
        """Whether the fused kernels run for tensor t (on a GPU, for a codec they are built for)."""
        return t.is_cuda and os.environ.get("TACO_KERNELS", "1") != "0" and taco_ext.supports(self)

    # === encode ===
    def encode(self, x, M, L):
        assert L % self.block == 0 and x.dim() == 1 and x.numel() <= M * L
        if x.dtype == torch.float64:  # codes come from fp32 values: a finite one past fp32's range saturates
            x = torch.where(x.isinf(), x, x.clamp(-FP32_MAX, FP32_MAX)).float()
        if self.kernel_ok(x):
            return taco_ext.load().encode(x.contiguous(), M, taco_ext.params(self, L))
        return self._encode_ref(x, M, L)

    def _encode_ref(self, x, M, L, rotated=False):
        """rotated=True: x is already in the rotated domain (Eq. 8 is skipped; reduce_encode)."""
        sp, block = self.spec, self.block
        nb = L // block
        g = torch.zeros(M * L, dtype=torch.float32, device=x.device)
        g[: x.numel()] = x
        g = g.view(M, nb, block)
        bad = ~torch.isfinite(g).all(dim=-1)  # (M, nb) blocks that hold NaN/Inf
        # === Eq. 6-7: adaptive scale ===
        if sp.adaptive:
            ss = block_sumsq(g)
            sigma = fsqrt(ss * (1.0 / block) + self.eps)
            big = ~torch.isfinite(ss) & ~bad  # |x| ~> 1e19: the squares overflow
            if big.any():  # sigma of x * 2^-80, times 2^80
                sigma = torch.where(big, fsqrt(block_sumsq(g * 2.0**-80) * (1.0 / block)) * 2.0**80, sigma)
            alpha = fdiv(torch.full_like(sigma, self.tau), sigma)
        # === Eq. 8: rotation, as H(x / block) * sqrt(block): the butterflies never overflow ===
        rot = sp.rotate and not rotated
        cb = self.inv_sqrt_block * block if rot else 1.0  # sqrt(block), exact in fp32
        pre = 1.0 / block if rot else 1.0  # (folded into alpha when there is one)
        g = g * (alpha * pre)[..., None] if sp.adaptive else g * pre
        if rot:
            g = fwht(g)  # Z / sqrt(block), Z = H(x) / sqrt(block)
        # === Eq. 9: absmax scale s = m cb / Qmax (as (m / Qmax) cb: it cannot overflow; at least 2^-126
        # when m > 0, so that 1/s is finite), and 1/s correctly rounded, once per block ===
        if sp.scale in ("block", "tensor"):
            m = g.abs().amax(dim=-1) if sp.scale == "block" else g.abs().reshape(M, -1).amax(dim=-1)[:, None]
            s = fdiv(m, self.qmax) * cb
            s = torch.where((m > 0) & (s < 2.0**-126), torch.full_like(s, 2.0**-126), s)
            inv = fdiv(torch.ones_like(s), torch.where(s > 0, s, torch.ones_like(s)))
            # y = Z / s without forming Z (which can pass fp32's max when H(x) does): g * (cb / s),
            # exact like (g * cb) / s; for tiny blocks (cb / s could overflow) in that order
            tiny = m < TINY / block
            gt, mul = torch.where(tiny[..., None], g * cb, g), torch.where(tiny, inv, inv * cb)[..., None]
            # integer codes round the exact product (fp64 holds it; the kernels use one fma)
            y = gt.double() * mul.double() if sp.fmt.startswith("int") else gt * mul
            if sp.scale == "tensor":  # one scale: a bad block spoils its message
                bad |= bad.any(dim=-1, keepdim=True)
        else:
            y = g * cb
        # === Eq. 10: codes (of a rotated block in the kernels' lane order) ===
        y = lane_order(y) if rot else y
        if sp.scale == "none" and not sp.adaptive:  # raw cast: NaN per element
            nonfinite = ~torch.isfinite(y)
            q = quantize(torch.where(nonfinite, torch.zeros_like(y), y), sp.fmt)
            q = torch.where(nonfinite, torch.full_like(q, E4M3_NAN), q)
        else:
            q = quantize(torch.where(bad[..., None], torch.zeros_like(y), y), sp.fmt)
        # === pack: payload | per-block (alpha, s) | tensor scale | zero padding to 16 bytes ===
        nan = torch.tensor(float("nan"), device=x.device)
        meta = ([alpha] if sp.adaptive else []) + ([s] if sp.scale == "block" else [])
        parts = [q.reshape(M, -1)]
        if meta:
            parts.append(torch.where(bad[..., None], nan, torch.stack(meta, dim=-1)).reshape(M, -1).view(torch.uint8))
        if sp.scale == "tensor":
            parts.append(torch.where(bad[:, :1], nan, s).view(torch.uint8))
        pad = self.nbytes(L) - sum(part.shape[1] for part in parts)
        return torch.cat((*parts, q.new_zeros(M, pad)), dim=1)

    # === decode ===
    def decode(self, buf, L, n=None, dtype=torch.float32, out=None):
        """First n (default all) elements of the M messages in buf, as dtype; written into `out`
        (1-D, n elements) if given."""
        n = buf.shape[0] * L if n is None else n
        odt = dtype if out is None else out.dtype
        if odt == torch.float64:  # decoded in fp32, then widened
            y = self.decode(buf, L, n, torch.float32).double()
            return y if out is None else out.copy_(y)
        if self.kernel_ok(buf):
            out = torch.empty(n, dtype=odt, device=buf.device) if out is None else out  # the binding checks it
            return taco_ext.load().decode(buf.contiguous(), out, taco_ext.params(self, L))
        big = torch.finfo(odt).max  # saturate, NaN stays NaN
        y = self._decode_ref(buf, L).reshape(-1)[:n].clamp(-big, big).to(odt)
        return y if out is None else out.copy_(y)

    def _decode_ref(self, buf, L, rotated=False):
        """rotated=True: stop before the inverse rotation (the values stay in the rotated domain)."""
        sp, block, M = self.spec, self.block, buf.shape[0]
        nb = L // block
        pay = nb * block * self.bits // 8
        y = dequantize(buf[:, :pay].contiguous(), sp.fmt).reshape(M, nb, block)
        meta = buf[:, pay : pay + nb * self.nmeta * 4].contiguous().view(torch.float32).reshape(M, nb, self.nmeta)
        s = meta[..., -1:] if sp.scale == "block" else None
        if sp.scale == "tensor":
            tpos = pay + nb * self.nmeta * 4
            s = buf[:, tpos : tpos + 4].contiguous().view(torch.float32).reshape(M, 1, 1)
        # === Eq. 11: Z' = q s (a huge block, s > 2^100, in units of 2^64, so that H(q s) cannot overflow) ===
        inverse = sp.rotate and not rotated
        unit = torch.where(s > 2.0**100, 2.0**64, 1.0) if inverse and s is not None else 1.0
        if s is not None:
            y = y * (s / unit)
        # === Eq. 12: Y' = H(Z') / sqrt(block) (the kernels multiply s by 1/sqrt(256) = 1/16 first where
        # that is exact, 2^-90 <= s: the same values), times the unit ===
        if inverse:
            y = fwht(lane_order(y, inverse=True), reverse=True) * self.inv_sqrt_block * unit
        # === Eq. 13: G' = Y' / alpha ===
        if sp.adaptive:
            alpha = meta[..., :1]
            y = y * fdiv(torch.ones_like(alpha), alpha)
        return y.reshape(M, L)

    def reduce_encode(self, buf, L):
        """Sum P messages in fp32 in message order 0..P-1 and encode the sum as one message, in the
        rotated domain: each message decoded up to, not through, the inverse rotation (q s / alpha),
        the P blocks added, the sum encoded from Eq. 9 on (alpha computed on it: an orthonormal
        rotation keeps a block's RMS). H is linear, so this is decode-sum-encode without the P + 1
        transforms per block, up to fp32 rounding. Unrotated codecs: the plain decode-sum-encode."""
        if self.kernel_ok(buf):
            return taco_ext.load().reduce_encode(buf.contiguous(), taco_ext.params(self, L))
        return self._encode_ref(rank_order_sum(self._decode_ref(buf, L, rotated=True)), 1, L, rotated=True)[0]

    # === whole tensors ===
    def compress(self, x):
        n = x.numel()
        if n == 0:  # nothing to encode (a tensor scale of 0)
            return torch.zeros(self.nbytes(0), dtype=torch.uint8, device=x.device)
        return self.encode(x.reshape(-1), 1, self.padded(n))[0]

    def decompress(self, buf, shape, dtype=torch.float32):
        n = math.prod(shape)
        if n == 0:
            return torch.zeros(shape, dtype=dtype, device=buf.device)
        return self.decode(buf[None], self.padded(n), n, dtype).reshape(shape)

    def roundtrip(self, x):
        return self.decompress(self.compress(x), x.shape, x.dtype)


# the codec `none`: the tensor's own bytes on the wire (bf16 stays bf16); every user of a codec (the
# collectives, parallel.send_stage) takes the plain torch.distributed path for it
IDENTITY = SimpleNamespace(name="none")
EXTRA_CODECS = {}  # name -> class with Codec's interface, made with no arguments (its block is its own)
_CODEC_CACHE = {}


def get_codec(name, codec_block=256, tau=1.0, eps=1e-30):
    """A (cached) codec object by name; `none` (or None) is IDENTITY."""
    if name in (None, "none"):
        return IDENTITY
    key = (name,) if name in EXTRA_CODECS else (name, codec_block, tau, eps)
    if key not in _CODEC_CACHE:
        _CODEC_CACHE[key] = EXTRA_CODECS[name]() if name in EXTRA_CODECS else Codec(name, codec_block, tau, eps)
    return _CODEC_CACHE[key]


def codec_names():
    """Every codec name a config may use."""
    return ["none", *CODECS, *EXTRA_CODECS]


# -----------------------------------------------------------------------------
# the compressed collectives


@dataclass
class CommStats:
    """Bytes this rank put on the wire vs what an uncompressed ring all-reduce would have sent (the
    collectives below add to it, the step line prints it)."""

    calls: int = 0
    wire_bytes: int = 0
    logical_bytes: int = 0

    def add(self, wire, logical):
        self.calls += 1
        self.wire_bytes += int(wire)
        self.logical_bytes += int(logical)

    def reset(self):
        self.calls = self.wire_bytes = self.logical_bytes = 0

    @property
    def ratio(self):
        return self.logical_bytes / self.wire_bytes if self.wire_bytes else 1.0


def load_kernels(names, codec_block, device):
    """Build and load the fused kernels (local rank 0 builds) if a codec in `names` runs on them on `device`."""
    if device.type == "cuda" and any(taco_ext.supports(get_codec(n, codec_block)) for n in names):
        taco_ext.load()


def _workspace(x, group, has_kernels, transport):
    """taco_symm.workspace for a GPU tensor, else None (taco_symm, with torch._dynamo, loads on first use)."""
    if transport == "dist" or (transport == "auto" and not x.is_cuda):
        return None
    import taco_symm

    return taco_symm.workspace(x, group, has_kernels, transport)


def all_reduce(
    x, group=None, codec=DEFAULT_CODEC, codec_block=256, chunks=1, stats=None, async_op=False, transport="auto"
):
    """In-place SUM of x over `group`, like torch.distributed.all_reduce: the two-shot compressed
    all-reduce of the module docstring (below; inside a GPU node whose GPUs are peers, with
    transport "auto" or "symm", the same six steps over symmetric memory: taco_symm.py). Returns x;
    with async_op=True a handle once steps 1-3 are started: handle.wait() leaves the sum in x.
    Codec none: torch.distributed's all-reduce (transport="symm": PyTorch's symmetric-memory one)."""
    cd = get_codec(codec, codec_block)
    _check(x, group, cd, chunks)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: choose {', '.join(TRANSPORTS)}")
    if any(st == 0 and size > 1 for st, size in zip(x.stride(), x.shape)):
        raise ValueError(
            "taco.all_reduce sums in place, but elements of x share memory (an expand()ed view): pass x.clone()"
        )
    W = dist.get_world_size(group) if dist.is_initialized() else 1
    if W == 1 or x.numel() == 0:
        return taco_ext.Pending(None) if async_op else x
    if cd is IDENTITY and transport != "symm":
        work = dist.all_reduce(x, group=group, async_op=async_op)
        if stats is not None:  # after the collective: torch.compile's graph breaks there anyway
            logical = 2 * (W - 1) * x.numel() * x.element_size() / W
            stats.add(logical, logical)
        return work if async_op else x
    ws = _workspace(x, group, cd is IDENTITY or cd.kernel_ok(x), transport)
    if ws is not None:
        return ws.all_reduce(x, cd, stats, async_op)
    # steps 1-6 of the module docstring over torch.distributed, chunk by chunk
    n = x.numel()
    flat = x.contiguous().view(-1)  # a copy only if x is not contiguous
    pending = []  # per chunk: (a, b, L, the all-to-all's work, its receive buffer)
    wire = 0  # bytes this rank sends
    for a, b in _plan_chunks(n, W, cd.block, chunks):
        # === 1. W shards of L elements (whole blocks);  2. compress each: (W, S) bytes, message r for rank r ===
        L = cd.padded(cdiv(b - a, W))
        send = cd.encode(flat[a:b], W, L)
        # === 3. all-to-all (async: the next chunk is compressed while this one is on the wire) ===
        recv = torch.empty_like(send)
        pending.append((a, b, L, dist.all_to_all_single(recv, send, group=group, async_op=True), recv))
        wire += 2 * (W - 1) * send.shape[1]
    if stats is not None:
        stats.add(wire, 2 * (W - 1) * n * x.element_size() / W)

    def finish():
        gathers = []
        for a, b, L, work, recv in pending:
            work.wait()  # orders the stream, no host sync on GPU
            # === 4. reduce my shard: W messages summed in fp32 in rank order, re-compressed ===
            mine = cd.reduce_encode(recv, L)
            # === 5. all-gather the re-compressed shards ===
            gathered = torch.empty(W * mine.numel(), dtype=torch.uint8, device=x.device)
            gathers.append(
                (a, b, L, _all_gather_flat(gathered, mine, group=group, async_op=True), gathered.view(W, -1))
            )
        for a, b, L, work, gathered in gathers:
            work.wait()
            # === 6. decompress all W shards, my own included: every rank decodes the same bytes ===
            cd.decode(gathered, L, b - a, out=flat[a:b])
        if flat.data_ptr() != x.data_ptr():  # x was not contiguous: flat is a copy
            x.copy_(flat.view_as(x))

    if async_op:
        return taco_ext.Pending(finish)
    finish()
    return x


_AGREED = set()  # (group, codec, block, numel, dtype) whose ranks were checked to agree
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # a dtype's code in that check


def _check(x, group, cd, chunks=1):
    """Refuse what the codecs cannot carry; the first time a group sees a codec, size and dtype, one small
    all-gather checks that every rank passes the same (else a rank decodes the others' bytes wrongly). A gloo
    group, with any codec, is also noted for the exit (watchdog.meet_at_exit)."""
    if cd is not IDENTITY and not x.is_floating_point():
        raise TypeError(
            f"taco: a {x.dtype} tensor cannot go through the lossy {cd.name!r} codec; "
            f"all-reduce it with torch.distributed (or codec='none')"
        )
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"taco: chunks={chunks!r} must be a positive integer")
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    g = group or dist.group.WORLD
    watchdog.meet_at_exit(g)  # a gloo group's ranks meet before the interpreter ends (no abort at exit)
    key = (g, cd.name, getattr(cd, "block", 0), x.numel(), x.dtype)
    if cd is IDENTITY or key in _AGREED:
        return
    mine = torch.tensor([codec_names().index(cd.name), key[2], key[3], _DTYPES.index(x.dtype)], device=x.device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(e, mine) for e in every):
        said = "; ".join(
            f"rank {r}: {codec_names()[c]!r}, block {b}, {n} x {_DTYPES[d]}"
            for r, (c, b, n, d) in enumerate(e.tolist() for e in every)
        )
        raise RuntimeError(
            f"taco: the ranks of a group pass different codecs, block sizes, element counts or "
            f"dtypes to one collective ({said}); every rank must pass the same"
        )
    _AGREED.add(key)


def _plan_chunks(n, W, block, chunks):
    """Split n elements into <= chunks contiguous pieces, each W whole blocks' multiple except the last."""
    per = cdiv(cdiv(n, chunks), W * block) * W * block
    return [(a, min(a + per, n)) for a in range(0, n, per)]


# torch >= 2.12 renames all_gather_into_tensor to all_gather_single (same arguments)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(x, group=None, codec=DEFAULT_CODEC, codec_block=256, stats=None, transport="auto"):
    """Sum over the group of x (n elements, n divisible by W); returns this rank's n/W slice.
    Steps 1-4 of the two-shot all-reduce; the summed shard is not re-compressed (it stays here)."""
    W, n = dist.get_world_size(group), x.numel()
    if n % W:
        raise ValueError(f"reduce_scatter needs numel ({n}) divisible by the group size ({W})")
    cd = get_codec(codec, codec_block)
    _check(x, group, cd)
    out = torch.empty(n // W, dtype=x.dtype, device=x.device)
    if cd is IDENTITY:
        dist.reduce_scatter_tensor(out, x.reshape(-1).contiguous(), group=group)
        if stats is not None:
            stats.add((W - 1) * out.numel() * x.element_size(), (W - 1) * out.numel() * x.element_size())
        return out
    L = cd.padded(n // W)
    shards = torch.zeros(W, L, dtype=x.dtype, device=x.device)  # shard r padded to whole blocks
    shards[:, : n // W] = x.reshape(W, n // W)
    ws = _workspace(x, group, cd.kernel_ok(x), transport)
    if ws is not None:  # the W messages for my shard, read from the peers' buffers
        parts, S = ws.gather_messages(cd, shards.view(-1), W, L, dist.get_rank(group))
    else:
        send = cd.encode(shards.view(-1), W, L)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        parts, S = cd.decode(recv, L).view(W, L), send.shape[1]
    out.copy_(rank_order_sum(parts)[: n // W])
    if stats is not None:
        stats.add((W - 1) * S, (W - 1) * out.numel() * x.element_size())
    return out


def all_gather(x, group=None, codec=DEFAULT_CODEC, codec_block=256, stats=None, transport="auto"):
    """Concatenate x from every rank (rank order): steps 5-6 of the two-shot all-reduce. Every rank
    decodes every piece, its own included, so all ranks hold bitwise-identical results."""
    W, n = dist.get_world_size(group), x.numel()
    cd = get_codec(codec, codec_block)
    _check(x, group, cd)
    out = torch.empty(W * n, dtype=x.dtype, device=x.device)
    if cd is IDENTITY:
        _all_gather_flat(out, x.reshape(-1).contiguous(), group=group)
        if stats is not None:
            stats.add((W - 1) * n * x.element_size(), (W - 1) * n * x.element_size())
        return out
    ws = _workspace(x, group, cd.kernel_ok(x), transport) if n else None
    if ws is not None:  # every rank's one message, read from its buffer
        parts, S = ws.gather_messages(cd, x.reshape(-1), 1, cd.padded(n), 0)
    else:
        mine = cd.compress(x)
        gathered = torch.empty(W * mine.numel(), dtype=torch.uint8, device=x.device)
        _all_gather_flat(gathered, mine, group=group)
        parts, S = cd.decode(gathered.view(W, -1), cd.padded(n)).view(W, -1), mine.numel()
    out.copy_(parts[:, :n].reshape(-1))
    if stats is not None:
        stats.add((W - 1) * S, (W - 1) * n * x.element_size())
    return out
