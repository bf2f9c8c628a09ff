"""
taco.py — compressing the tensor-parallel all-reduce.

What TP communicates, and why it hurts
--------------------------------------
In a Megatron-style transformer layer the row-parallel linears (attention out-projection, MLP
down-projection) leave every TP rank with a PARTIAL SUM of the layer output: a (B, T, C) tensor
that must be all-reduced before the residual add. In the backward pass the column-parallel
linears produce partial input gradients of the same size. That is four all-reduces of B*T*C
elements per layer per step, on the critical path. TACO (arXiv 2604.24088) sends them in 8 bits.

How a codec works (the TACO paper's Section 4, equation numbers as in the paper)
-------------------------------------------------------------------------------
A tensor is flattened and cut into blocks of B elements (default B = 256; the last block is
zero-padded). For each block G_k:

    sigma_k = sqrt(mean(G_k^2) + eps)              (6)  RMS of the block
    alpha_k = tau / sigma_k                        (7)  adaptive scale: bring the RMS to tau
    Z_k     = H_B(alpha_k * G_k) / sqrt(B)         (8)  Walsh-Hadamard rotation ("ASH" = 7 + 8)
    s_k     = max|Z_k| / Q_max                     (9)  per-block absmax scale ("dual scale": alpha, s)
    q_k     = FP8_E4M3(Z_k / s_k)                  (10) round-to-nearest-even, Q_max = 448
    decode: Z' = q * s;  Y' = H_B(Z') / sqrt(B);  G' = Y' / alpha          (11)-(13)

(In our arithmetic the divisions by s and alpha are multiplications by 1/s and 1/alpha, computed
once per block: the same numbers to within one rounding, and 8x fewer divisions in the kernels.)

The rotation spreads an outlier over the whole block (every output is a +-1 combination of all
inputs), so the block's absmax shrinks towards its RMS and the 8 bits are spent on the bulk of
the distribution. H_B / sqrt(B) is orthonormal and its own inverse.

One observation of ours, proved in tests/test_codecs.py: once (9) is applied, alpha cancels.
Z/s = H(alpha G) / max|H(alpha G)| = H(G) / max|H(G)| in exact arithmetic, so alpha carries no
information and the codec `hint8` keeps only s (one fp32 per block) and uses INT8 codes, whose
uniform grid suits the post-rotation, near-Gaussian block better than E4M3's log grid.

All codecs here are one parameterised pipeline (see CODECS): optional alpha, optional rotation,
a scale per block / per tensor / none, and a code format (E4M3, E5M2, INT8, INT6, INT4) — except
`tahquant` (class TahQuant), the TAH-Quant-style tile codec used between pipeline stages and as the
paper's TP baseline, which has its own format and the same interface.

Wire format ("zero-copy" layout, paper Section 5): one uint8 buffer per message,

    [ payload: nblocks * B * bits/8 bytes ][ per-block fp32 metadata: (alpha_k, s_k) ][ tensor scale ]

so block k's codes start at k*B*bits/8 and its metadata at payload_bytes + k*nmeta*4: pointer
arithmetic, no index. A message is self-contained: it can be sent, stored and decoded alone.

Non-finite input: a block containing NaN or +-Inf (or whose rotation/RMS overflows fp32) is
marked bad: its codes are 0 and its scale is NaN, so it decodes to NaN. Nothing non-finite is
ever silently turned into a finite number. (For the scale-free `fp8` codec this is per element.)

The two-shot compressed all-reduce
----------------------------------
    1. split the tensor into W shards (W = group size), each padded to a multiple of B
    2. compress every shard                                      -> W messages
    3. all_to_all: message r goes to rank r                       (reduce-scatter phase)
    4. decompress the W messages for MY shard, sum in fp32 in rank order 0..W-1, re-compress
       (in the rotated domain: Codec.reduce_encode)
    5. all_gather the re-compressed shards                        (all-gather phase)
    6. decompress ALL W shards, my own included, from the gathered bytes
Step 6 is why every rank ends with bitwise-identical results: each rank decodes the very same
bytes with the same code. (Keeping one's own uncompressed shard would break that.)
Two transports move the bytes: torch.distributed (NCCL all_to_all + all_gather; gloo on CPU), or,
inside one node, symmetric memory (_SymmWorkspace: the kernels read the peers' buffers directly,
two barriers instead of two NCCL calls). Same kernels, same bytes, same results.
The tensor can be cut into `chunks` that pipeline: every chunk's all-to-all is started (async)
before the first one is waited on, so chunk i+1 is compressed while chunk i is on the wire.

What we measured (README.md has the tables; results/ the raw numbers and commands)
-------------------------------------------------------------------------------
- Accuracy (`python bench.py codecs`: the demo model's real TP=4 all-reduce inputs): relative
  error of the two-shot all-reduce: taco 3.0%, every other E4M3 variant 3.0-3.1% (E4M3's 3
  mantissa bits set the floor), taco-e5m2 6%, hint8 0.87% (= taco-int8: alpha cancels), hint6 3.5%,
  raw fp8 99% on gradients, tahquant (4.6 bits) 15%. In training (README, the accuracy study, TP=8
  emulated, 3 seeds, paired): final validation loss +0.15% with hint8, +0.38% with taco. So
  DEFAULT_CODEC is hint8.
- Speed on 2xH200: the fused kernels run at 54-72% of copy bandwidth (hint8: compress 65-67%,
  decompress 69-72%, the reduce step 56-58%). Over NVLink the compressed all-reduce beats NCCL from
  64 MB on the symmetric-memory transport (hint8 1.33-1.40x eagerly, 1.43x from a CUDA graph;
  1.14-1.32x PyTorch's own symm-mem two-shot), not on the NCCL transport (0.88-0.95x). Over a
  host-staged link it wins from 16 MB (hint8 1.23-1.54x, hint6 1.19-1.97x). Eagerly, below ~8 MB
  it loses everywhere, hence train.py's taco_min_bytes; this function's own default (min_bytes=0)
  compresses whatever it is given. End to end (1B GPT, TP=2): hint8 0.97-1.00x over NVLink,
  1.21-1.28x host-staged (README).
"""
import functools
import hashlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_CODEC = "hint8"          # the codec that measures best (README "Codecs"); `taco` is the paper
TRANSPORTS = ("auto", "dist", "symm")   # how the compressed bytes travel (symm_workspace)
DEFAULT_MIN_BYTES = 0            # below this many bytes, a plain all-reduce (train.py sets 8 MiB, measured)

QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0, "int6": 31.0, "int4": 7.0}
BITS = {"e4m3": 8, "e5m2": 8, "int8": 8, "int6": 6, "int4": 4}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
E4M3_NAN = 0x7F


@dataclass(frozen=True)
class CodecSpec:
    adaptive: bool   # Eq. 6-7: per-block alpha = tau / rms
    rotate: bool     # Eq. 8: block Walsh-Hadamard
    scale: str       # "block" (Eq. 9) | "tensor" (one absmax per message) | "none"
    fmt: str         # "e4m3" | "e5m2" | "int8" | "int6"


CODECS = {
    # the paper
    "taco":       CodecSpec(True,  True,  "block",  "e4m3"),
    # the paper's ablations (Figs. 11, 13, 14)
    "fp8":        CodecSpec(False, False, "none",   "e4m3"),   # direct cast ("NVFP8")
    "fp8-tensor": CodecSpec(False, False, "tensor", "e4m3"),   # one absmax scale per tensor
    "ds":         CodecSpec(False, False, "block",  "e4m3"),   # per-block absmax, no rotation
    "hadamard":   CodecSpec(False, True,  "tensor", "e4m3"),   # standard Hadamard, one scale
    "ash":        CodecSpec(True,  True,  "none",   "e4m3"),   # alpha + Hadamard, saturating cast
    "taco-e5m2":  CodecSpec(True,  True,  "block",  "e5m2"),
    "taco-int8":  CodecSpec(True,  True,  "block",  "int8"),
    # ours
    "hint8":      CodecSpec(False, True,  "block",  "int8"),   # Hadamard + block absmax INT8
    "hint6":      CodecSpec(False, True,  "block",  "int6"),   # same, 6-bit codes, 4 per 3 bytes
    "hint4":      CodecSpec(False, True,  "block",  "int4"),   # same, 4-bit codes (SDP4Bit-style DP gradients)
}


# -----------------------------------------------------------------------------
# building blocks shared by every codec (the CUDA kernels do the same arithmetic in the same order)

def fwht(x):
    """Unnormalised Walsh-Hadamard transform over the last dim (a power of two), in place order:
    butterflies (a, b) -> (a + b, a - b) with stride 1, 2, 4, ... (the kernel's order)."""
    B = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < B:
        x = x.reshape(*lead, B // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return x.reshape(*lead, B)


def block_sumsq(g):
    """Sum of squares of each block in the kernel's order: thread t of a 32-lane warp owns the
    B/32 consecutive elements [t*E, (t+1)*E) and sums them left to right; then the warp folds with
    xor-shuffles 16, 8, 4, 2, 1 (lane i adds lane i^m; the same as folding halves)."""
    B = g.shape[-1]
    sq = (g * g).reshape(*g.shape[:-1], 32, B // 32)
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
    """a / b rounded once to fp32, identically on every backend: the quotient is computed in
    float64 and rounded (exact for fp32 operands), which is what the kernels' IEEE fp32 division
    gives. (torch's own fp32 ops are not enough: on CUDA, tensor / python-float is a multiply by
    the reciprocal, and we measured a CPU build whose vectorised sqrt was 1 ulp off.)"""
    b = b.double() if torch.is_tensor(b) else torch.full_like(a, b, dtype=torch.float64)
    return (a.double() / b).float()


def fsqrt(a):
    """sqrt rounded once to fp32 (computed in float64: exact for fp32 inputs), like the kernels' sqrtf."""
    return torch.sqrt(a.double()).float()


def pack_int6(q):
    """(..., 4k) int codes in [-31, 31] -> (..., 3k) bytes: w = u0 | u1<<6 | u2<<12 | u3<<18, little-endian."""
    u = (q.to(torch.int32) & 63).reshape(*q.shape[:-1], -1, 4)
    w = u[..., 0] | (u[..., 1] << 6) | (u[..., 2] << 12) | (u[..., 3] << 18)
    b = torch.stack((w & 255, (w >> 8) & 255, (w >> 16) & 255), dim=-1)
    return b.to(torch.uint8).reshape(*q.shape[:-1], -1)


def unpack_int6(b):
    t = b.to(torch.int32).reshape(*b.shape[:-1], -1, 3)
    w = t[..., 0] | (t[..., 1] << 8) | (t[..., 2] << 16)
    u = torch.stack([(w >> s) & 63 for s in (0, 6, 12, 18)], dim=-1)
    return ((u ^ 32) - 32).reshape(*b.shape[:-1], -1)          # sign-extend 6 bits


def pack_int4(q):
    """(..., 2k) int codes in [-7, 7] -> (..., k) bytes, the first code in the low nibble."""
    u = (q.to(torch.int32) & 15).reshape(*q.shape[:-1], -1, 2)
    return (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)


def unpack_int4(b):
    t = b.to(torch.int32)
    u = torch.stack((t & 15, t >> 4), dim=-1)
    return ((u ^ 8) - 8).reshape(*b.shape[:-1], -1)             # sign-extend 4 bits


def quantize(y, fmt):
    """y already scaled into [-QMAX, QMAX] (finite). E4M3/E5M2: RNE with saturation; INT: RNE."""
    y = y.clamp(-QMAX[fmt], QMAX[fmt])
    if fmt in FP8_DTYPE:
        return y.to(FP8_DTYPE[fmt]).view(torch.uint8)
    q = torch.round(y)                                          # round half to even
    return {"int8": lambda: q.to(torch.int8).view(torch.uint8), "int6": lambda: pack_int6(q),
            "int4": lambda: pack_int4(q)}[fmt]()


def dequantize(b, fmt):
    if fmt in FP8_DTYPE:
        return b.view(FP8_DTYPE[fmt]).float()
    return {"int8": lambda: b.view(torch.int8), "int6": lambda: unpack_int6(b),
            "int4": lambda: unpack_int4(b)}[fmt]().float()


# -----------------------------------------------------------------------------
# the codec

class Codec:
    """A codec = a spec + block size (+ tau, eps for the adaptive scale).

    encode(x, M, L) -> (M, S) uint8     x: 1-D, n <= M*L elements (zero-padded past n); message m
                                        holds elements [m*L, (m+1)*L); L a multiple of B
    decode(buf, L, n, dtype, out) -> 1-D tensor of the first n elements of the M messages
    reduce_encode(buf: (P, S), L) -> (S,) uint8   sum P messages in fp32 in order, re-encode (in the
                                        rotated domain: see reduce_encode)
    compress(x) -> 1-D uint8;  decompress(buf, shape, dtype);  roundtrip(x)   (any shape and size)

    On CUDA tensors the fused kernels of taco_kernels.cu run where they exist (TACO_KERNELS=0
    forces this reference); everywhere else, this PyTorch reference."""

    def __init__(self, name, block_size=256, tau=1.0, eps=1e-30):
        if name not in CODECS:
            raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODECS)} or 'none'")
        if block_size < 32 or block_size > 1024 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size} must be a power of two in [32, 1024]")
        self.name, self.spec, self.B, self.tau, self.eps = name, CODECS[name], block_size, tau, eps
        self.bits = BITS[self.spec.fmt]
        self.nmeta = int(self.spec.adaptive) + int(self.spec.scale == "block")
        self.c = float(torch.tensor(1.0 / math.sqrt(block_size), dtype=torch.float32))  # 1/sqrt(B) as fp32

    def __repr__(self):
        return f"Codec({self.name!r}, B={self.B})"

    def padded(self, n):
        return cdiv(n, self.B) * self.B

    def nbytes(self, L):
        """Bytes of one message of L elements (L a multiple of B), padded to a multiple of 16
        (so every message starts 16-byte aligned in a (M, S) buffer)."""
        nb = L // self.B
        raw = nb * self.B * self.bits // 8 + nb * self.nmeta * 4 + (4 if self.spec.scale == "tensor" else 0)
        return cdiv(raw, 16) * 16

    def _kernel_ok(self, t):
        return t.is_cuda and _use_kernels() and kernels_support(self)

    # === encode ===
    def encode(self, x, M, L):
        assert L % self.B == 0 and x.dim() == 1 and x.numel() <= M * L
        if self._kernel_ok(x):
            return _kernels().encode(self, x, M, L)
        return self._encode_ref(x, M, L)

    def _encode_ref(self, x, M, L, rotated=False):
        """rotated=True: x is already in the rotated domain (Eq. 8 is skipped; reduce_encode)."""
        sp, B = self.spec, self.B
        nb = L // B
        g = torch.zeros(M * L, dtype=torch.float32, device=x.device)
        g[:x.numel()] = x
        g = g.view(M, nb, B)
        bad = ~torch.isfinite(g).all(dim=-1)                     # (M, nb) blocks that hold NaN/Inf
        # === Eq. 6-7: adaptive scale ===
        if sp.adaptive:
            ss = block_sumsq(g)
            sigma = fsqrt(ss * (1.0 / B) + self.eps)
            alpha = fdiv(torch.full_like(sigma, self.tau), sigma)
            bad |= ~torch.isfinite(ss)
            g = g * alpha[..., None]
        # === Eq. 8: rotation ===
        if sp.rotate and not rotated:
            g = fwht(g) * self.c
        # === Eq. 9: absmax scale ===
        # (s = m / Qmax and 1/s are correctly rounded divisions, once per block; the elements
        # are multiplied by 1/s)
        if sp.scale == "block":
            m = g.abs().amax(dim=-1)
            bad |= ~torch.isfinite(m)
            s = fdiv(m, QMAX[sp.fmt])
            y = g * fdiv(torch.ones_like(s), torch.where(s > 0, s, torch.ones_like(s)))[..., None]
        elif sp.scale == "tensor":
            m = g.abs().reshape(M, -1).amax(dim=-1)
            tbad = ~torch.isfinite(m) | bad.any(dim=-1)
            bad |= tbad[:, None]
            s = fdiv(m, QMAX[sp.fmt])
            y = g * fdiv(torch.ones_like(s), torch.where(s > 0, s, torch.ones_like(s)))[:, None, None]
        else:
            y = g
        # === Eq. 10: codes ===
        if sp.scale == "none" and not sp.adaptive:                 # raw cast: NaN per element
            nonfinite = ~torch.isfinite(y)
            q = quantize(torch.where(nonfinite, torch.zeros_like(y), y), sp.fmt)
            q = torch.where(nonfinite, torch.full_like(q, E4M3_NAN), q)
        else:
            q = quantize(torch.where(bad[..., None], torch.zeros_like(y), y), sp.fmt)
        # === pack: payload | per-block (alpha, s) | tensor scale | zero padding to 16 bytes ===
        nan = torch.tensor(float("nan"), device=x.device)
        parts = [q.reshape(M, -1)]
        meta = []
        if sp.adaptive:
            meta.append(torch.where(bad, nan, alpha))
        if sp.scale == "block":
            meta.append(torch.where(bad, nan, s))
        if meta:
            parts.append(torch.stack(meta, dim=-1).reshape(M, -1).contiguous().view(torch.uint8))
        if sp.scale == "tensor":
            parts.append(torch.where(tbad, nan, s).reshape(M, 1).contiguous().view(torch.uint8))
        out = torch.cat(parts, dim=1)
        pad = self.nbytes(L) - out.shape[1]
        return torch.cat((out, out.new_zeros(M, pad)), dim=1) if pad else out

    # === decode ===
    def decode(self, buf, L, n=None, dtype=torch.float32, out=None):
        """First n (default all) elements of the M messages in buf, as dtype; written into `out`
        (1-D, n elements) if given."""
        n = buf.shape[0] * L if n is None else n
        if self._kernel_ok(buf):
            return _kernels().decode(self, buf, L, n, dtype if out is None else out.dtype, out)
        y = self._decode_ref(buf, L).reshape(-1)[:n].to(dtype)
        return y if out is None else out.copy_(y)

    def _decode_ref(self, buf, L, rotated=False):
        """rotated=True: stop before the inverse rotation (the values stay in the rotated domain)."""
        sp, B, M = self.spec, self.B, buf.shape[0]
        nb = L // B
        pay = nb * B * self.bits // 8
        y = dequantize(buf[:, :pay].contiguous(), sp.fmt).reshape(M, nb, B)
        meta = buf[:, pay:pay + nb * self.nmeta * 4].contiguous().view(torch.float32).reshape(M, nb, self.nmeta)
        if sp.scale == "block":
            y = y * meta[..., -1:]
        elif sp.scale == "tensor":
            tpos = pay + nb * self.nmeta * 4
            y = y * buf[:, tpos:tpos + 4].contiguous().view(torch.float32).reshape(M, 1, 1)
        if sp.rotate and not rotated:
            y = fwht(y) * self.c
        if sp.adaptive:
            alpha = meta[..., :1]
            y = y * fdiv(torch.ones_like(alpha), alpha)
        return y.reshape(M, L)

    def reduce_encode(self, buf, L):
        """Sum P messages in fp32 in message order 0..P-1 and encode the sum as one message.

        The sum is taken in the rotated domain: each message is decoded up to, not through, the
        inverse rotation (q s / alpha), the P blocks are added, and the sum is encoded from Eq. 9 on
        with alpha computed on it (Eq. 6-7 skip nothing: the rotation is orthonormal, so a block's
        RMS is the same on both sides of it). H is linear, so this is the sum of the decoded messages
        rotated and re-encoded, as a two-shot all-reduce needs, without the P inverse and the one
        forward Walsh-Hadamard transform per block: the values differ from that by fp32 rounding
        only (tests/test_codecs.py measures both against an exact sum). Unrotated codecs: the plain
        decode-sum-encode."""
        if self._kernel_ok(buf):
            return _kernels().reduce_encode(self, buf, L)
        return self._encode_ref(rank_order_sum(self._decode_ref(buf, L, rotated=True)), 1, L, rotated=True)[0]

    # === whole tensors ===
    def compress(self, x):
        n = x.numel()
        if n == 0:                                                 # nothing to encode (a tensor scale of 0)
            return torch.zeros(self.nbytes(0), dtype=torch.uint8, device=x.device)
        return self.encode(x.reshape(-1), 1, self.padded(n))[0]

    def decompress(self, buf, shape, dtype=torch.float32):
        n = math.prod(shape)
        if n == 0:
            return torch.zeros(shape, dtype=dtype, device=buf.device)
        return self.decode(buf[None], self.padded(n), n, dtype).reshape(shape)

    def roundtrip(self, x):
        return self.decompress(self.compress(x), x.shape, x.dtype)


class TahQuant:
    """TAH-Quant-style tile quantization (arXiv 2506.01352, "Tile-wise Adaptive Hadamard
    Quantization"): the paper's pipeline-parallel activation codec, and its TP baseline (Table 1).

    What we implement, per message of L elements (T = L / 64 tiles of 64 consecutive elements;
    for a (tokens, C) activation with 64 | C a tile is 64 channels of one token, as in the paper):
      1. outlier tiles: if rms(x / max|x|) < 1 / kappa (kappa = 4: max|x| > 4 rms), swap the largest-magnitude element
         into position 0 (the "pivot swap") and apply the orthonormal 64-point Walsh-Hadamard
         transform. Row 0 of H is all ones, so the pivot becomes a CONSTANT offset of x_p / 8 on
         every element, which the asymmetric quantizer's zero point (step 2) absorbs for free;
         anywhere else its +-x_p / 8 pattern would widen the range. (This is our reading of why
         the swap helps; the paper's exact transform may differ in detail.)
      2. asymmetric uniform quantization per tile: lo = min, step = (max - min) / (2^b - 1),
         q = round((z - lo) / step), decode z = q * step + lo.
      3. bits: every tile is first quantized at INT4; the `int3_share` of tiles (per message, a
         fixed count, so the message size does not depend on the data) whose INT4 codes have the
         LOWEST histogram entropy are re-quantized at INT3. Low entropy = the tile's values use
         few of the 16 levels, so they lose least from a coarser grid.
    Simplified vs the paper: the bit allocation is per tile, not per token, and by a fixed share,
    not a threshold; the entropy is that of the INT4 code histogram; fp32 (lo, step) metadata.
    Wire format: [ (lo, step) fp32 per tile ][ flags: 1 byte per tile: bit 7 INT3, bit 6
    Hadamard, bits 0-5 pivot index ][ payload: 32 bytes per INT4 tile, 24 per INT3 tile, in tile
    order ][ pad to 16 bytes ]. Non-finite tiles decode to NaN (lo = step = NaN).
    Same interface as Codec (B = the tile); PyTorch only, no fused kernel."""

    def __init__(self, name="tahquant", tile=64, int3_share=0.5, kappa=4.0):
        self.name, self.B, self.int3_share, self.kappa = name, tile, int3_share, kappa
        self.c = 1.0 / math.sqrt(tile)                               # 1/8: exact in fp32
        # c * log2(c) for a count c of equal codes in a tile, as integers so sums are exact everywhere
        c = torch.arange(tile + 1, dtype=torch.float64)
        self.clogc = torch.round(torch.where(c > 0, c * torch.log2(c.clamp(min=1)), c) * 2 ** 20).long()

    @functools.lru_cache(maxsize=None)
    def _clogc(self, device):
        return self.clogc.to(device)

    def __repr__(self):
        return f"TahQuant(tile={self.B}, int3_share={self.int3_share})"

    def padded(self, n):
        return cdiv(n, self.B) * self.B

    def n_int3(self, T):
        return int(self.int3_share * T)

    def payload_bytes(self, T):
        """Code bytes of a message of T tiles: 32 per INT4 tile, 24 per INT3 tile."""
        k3 = self.n_int3(T)
        return (T - k3) * self.B // 2 + k3 * self.B * 3 // 8

    def nbytes(self, L):
        T = L // self.B
        return cdiv(9 * T + self.payload_bytes(T), 16) * 16

    def _swap(self, g, piv):
        """g (M, T, G) with element 0 and element piv of every tile exchanged (an involution)."""
        piv = piv[..., None]
        out = g.clone()
        out.scatter_(-1, piv, g[..., :1])                          # piv == 0: both writes put back g[0]
        out[..., :1] = torch.gather(g, -1, piv)
        return out

    def _positions(self, int3, P):
        """(M, T, G/2) payload index of every tile's code bytes; the 8 bytes an INT3 tile does not use
        point at the spare byte M * P (past the payload). No data-dependent shapes, no host syncs."""
        M, T = int3.shape
        size = torch.where(int3, self.B * 3 // 8, self.B // 2)
        off = torch.cumsum(size, dim=1) - size + torch.arange(M, device=int3.device)[:, None] * P
        j = torch.arange(self.B // 2, device=int3.device)
        return torch.where(j < size[..., None], off[..., None] + j, M * P)

    def _quant(self, z, levels):
        """Asymmetric per-tile quantization of z (..., 64) to [0, levels]: (q, lo, step)."""
        lo, hi = z.amin(dim=-1), z.amax(dim=-1)
        step = (hi - lo) / levels
        q = torch.round((z - lo[..., None]) / torch.where(step > 0, step, torch.ones_like(step))[..., None])
        return q.clamp(0, levels), lo, step

    def encode(self, x, M, L):
        assert L % self.B == 0 and x.dim() == 1 and x.numel() <= M * L
        T, G = L // self.B, self.B
        g = torch.zeros(M * L, dtype=torch.float32, device=x.device)
        g[:x.numel()] = x
        g = g.view(M, T, G)
        bad = ~torch.isfinite(g).all(dim=-1)
        g = torch.where(bad[..., None], torch.zeros_like(g), g)
        # === 1. pivot swap + Hadamard on tiles with a dominant outlier ===
        piv = g.abs().argmax(dim=-1)                                # first index of the max
        peak = g.abs().amax(dim=-1)
        r = g / torch.where(peak > 0, peak, torch.ones_like(peak))[..., None]     # scale-free: no overflow
        had = (self.kappa ** 2 * (r * r).mean(dim=-1) < 1) & ~bad
        z = torch.where(had[..., None], fwht(self._swap(g, piv) * self.c), g)   # 1/8 first: exact, and no overflow
        # === 2-3. INT4 everywhere, then the lowest-entropy share of tiles at INT3 ===
        q4, lo, step = self._quant(z, 15)
        counts = torch.zeros(M, T, 16, dtype=torch.int32, device=x.device).scatter_add_(
            -1, q4.long(), torch.ones_like(q4, dtype=torch.int32))            # (M, T, 16) code histogram
        key = torch.where(bad, torch.iinfo(torch.int64).min, self._clogc(x.device)[counts.long()].sum(-1))
        k3 = self.n_int3(T)
        int3 = torch.zeros(M, T, dtype=torch.bool, device=x.device)
        if k3:                                   # largest sum c log c = lowest entropy; bad tiles last
            order = torch.argsort(key, dim=-1, descending=True, stable=True)[:, :k3]
            int3.scatter_(1, order, True)
        q3, lo3, step3 = self._quant(z, 7)
        q = torch.where(int3[..., None], q3, q4).to(torch.int32)
        lo, step = torch.where(int3, lo3, lo), torch.where(int3, step3, step)
        nan = torch.tensor(float("nan"), device=x.device)
        meta = torch.stack((torch.where(bad, nan, lo), torch.where(bad, nan, step)), dim=-1)
        flags = (int3.int() << 7) | (had.int() << 6) | torch.where(had, piv, 0).int()
        # === pack: every tile's bytes at its offset in the message's payload (INT3 tiles use 24 of 32) ===
        P = self.payload_bytes(T)
        q3 = torch.nn.functional.pad(_pack_u3(q & 7), (0, G // 8))
        codes = torch.where(int3[..., None], q3, pack_int4(q))
        payload = torch.zeros(M * P + 1, dtype=torch.uint8, device=x.device)
        payload[self._positions(int3, P)] = codes             # only the spare byte is written twice
        payload = payload[:-1]
        out = torch.cat((meta.reshape(M, -1).contiguous().view(torch.uint8), flags.to(torch.uint8),
                         payload.view(M, -1)), dim=1)
        pad = self.nbytes(L) - out.shape[1]
        return torch.cat((out, out.new_zeros(M, pad)), dim=1) if pad else out

    def _decode_ref(self, buf, L):
        M, T, G = buf.shape[0], L // self.B, self.B
        P = self.payload_bytes(T)
        meta = buf[:, :8 * T].contiguous().view(torch.float32).view(M, T, 2)
        flags = buf[:, 8 * T:9 * T].int()
        payload = buf[:, 9 * T:9 * T + P].reshape(-1)
        int3, had, piv = (flags >> 7) & 1 == 1, (flags >> 6) & 1 == 1, (flags & 63).long()
        codes = torch.cat((payload, payload.new_zeros(1)))[self._positions(int3, P)]     # (M, T, G/2)
        q = torch.where(int3[..., None], _unpack_u3(codes[..., :G * 3 // 8]), unpack_int4(codes) & 15).float()
        z = q * meta[..., 1:] + meta[..., :1]
        y = torch.where(had[..., None], self._swap(fwht(z * self.c), piv), z)
        return y.reshape(M, L)

    def decode(self, buf, L, n=None, dtype=torch.float32, out=None):
        n = buf.shape[0] * L if n is None else n
        y = self._decode_ref(buf, L).reshape(-1)[:n].to(dtype)
        return y if out is None else out.copy_(y)

    def reduce_encode(self, buf, L):
        return self.encode(rank_order_sum(self._decode_ref(buf, L)).reshape(-1), 1, L)[0]

    compress, decompress, roundtrip = Codec.compress, Codec.decompress, Codec.roundtrip


def _pack_u3(q):
    """(..., 8k) codes in [0, 7] -> (..., 3k) bytes: w = u0 | u1<<3 | ... | u7<<21, little-endian."""
    u = q.reshape(*q.shape[:-1], -1, 8)
    w = sum(u[..., i] << (3 * i) for i in range(8))
    return torch.stack((w & 255, (w >> 8) & 255, w >> 16), dim=-1).to(torch.uint8).reshape(*q.shape[:-1], -1)


def _unpack_u3(b):
    t = b.to(torch.int32).reshape(*b.shape[:-1], -1, 3)
    w = t[..., 0] | (t[..., 1] << 8) | (t[..., 2] << 16)
    return torch.stack([(w >> (3 * i)) & 7 for i in range(8)], dim=-1).reshape(*b.shape[:-1], -1)


class Identity:
    """The codec `none`: the tensor's own bytes on the wire (bf16 stays bf16, fp32 stays fp32).
    The collectives take the plain torch.distributed path for it."""
    name = "none"

    def compress(self, x):
        return x.detach().contiguous().reshape(-1).view(torch.uint8).clone()

    def decompress(self, buf, shape, dtype=torch.float32):
        return buf.view(dtype).reshape(shape).clone()

    def roundtrip(self, x):
        return self.decompress(self.compress(x), x.shape, x.dtype)


IDENTITY = Identity()
_CODEC_CACHE = {}


def get_codec(name, block_size=256, tau=1.0, eps=1e-30):
    """A (cached) Codec; `none` (or None) is the Identity."""
    if name in (None, "none"):
        return IDENTITY
    if name == "tahquant":                                         # its tile (64) is part of its definition
        block_size = tau = eps = None
    key = (name, block_size, tau, eps)
    if key not in _CODEC_CACHE:
        _CODEC_CACHE[key] = TahQuant() if name == "tahquant" else Codec(name, block_size, tau, eps)
    return _CODEC_CACHE[key]


def codec_names():
    """Every codec name a config may use."""
    return ["none", *CODECS, "tahquant"]


# -----------------------------------------------------------------------------
# the fused CUDA kernels (taco_kernels.cu), JIT-built on first use into build/taco_kernels

_KERNELS = None
_HERE = os.path.dirname(os.path.abspath(__file__))
_FMT_CODE = {"e4m3": 0, "e5m2": 1, "int8": 2, "int6": 3}


def _use_kernels():
    return os.environ.get("TACO_KERNELS", "1") != "0"


def kernels_support(codec):
    """The kernels are built for B = 256 and for the (format, rotation, scale) of the codecs in
    CODECS that have a block scale or none: rotated + block scale in E4M3, E5M2, INT8, INT6 (taco,
    its variants, hint8, hint6), and E4M3 also rotated without a scale (ash) and unrotated (ds, fp8);
    taco_kernels.cu's dispatch() has one instantiation each. The per-tensor-scale ablations
    (fp8-tensor, hadamard) need a grid-wide absmax, INT4 and other block sizes other layouts: those
    run on the reference, also on the GPU."""
    sp = codec.spec
    if codec.B != 256 or sp.scale == "tensor":
        return False
    return sp.fmt == "e4m3" or (sp.rotate and sp.scale == "block" and sp.fmt in ("e5m2", "int8", "int6"))


class _Kernels:
    """Thin wrapper: codec -> the kernel's parameter vectors, and output allocation."""

    def __init__(self, ext):
        self.ext = ext

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def params(cd, L):
        sp = cd.spec
        ip = [_FMT_CODE[sp.fmt], int(sp.adaptive), int(sp.rotate), int(sp.scale == "block"), cd.nmeta,
              L, cd.nbytes(L)]
        return ip, [cd.tau, cd.eps, cd.c, QMAX[sp.fmt]]

    def encode(self, cd, x, M, L, into=None):
        return self.ext.encode(x.contiguous(), M, *self.params(cd, L), into)

    def decode(self, cd, buf, L, n, dtype, out=None):
        target = out if out is not None and out.is_contiguous() else torch.empty(n, dtype=dtype, device=buf.device)
        self.ext.decode(buf.contiguous(), target, *self.params(cd, L))
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target

    def reduce_encode(self, cd, buf, L):
        return self.ext.reduce_encode(buf.contiguous(), *self.params(cd, L))

    # messages at raw device addresses (the peers' symmetric memory): results into `out`
    def decode_peers(self, cd, ptrs, L, out):
        return self.ext.decode_peers(ptrs, out, *self.params(cd, L))

    def reduce_encode_peers(self, cd, ptrs, L, out):
        return self.ext.reduce_encode_peers(ptrs, out, *self.params(cd, L))


def load_kernels(verbose=False):
    """Build (first time: ~1 min for the binding; after a kernel edit: seconds, ninja rebuilds only
    taco_kernels.cu) and load the extension. Under torchrun call it on every rank at start: local
    rank 0 builds, the others wait at a barrier and then load the finished build (concurrent JIT
    builds of one directory race, or hang on a stale lock)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    from torch.utils.cpp_extension import load
    # TACO_NVCC_FLAGS: extra nvcc flags for kernel work, e.g. "-lineinfo" (ncu source view) or
    # "-DTACO_K=2"; each set of flags gets its own build directory and module name
    extra = os.environ.get("TACO_NVCC_FLAGS", "").split()
    tag = "_" + hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8] if extra else ""
    build = os.path.join(_HERE, "build", "taco_kernels" + tag)
    os.makedirs(build, exist_ok=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    build_it = lambda: load(name="taco_ext" + tag, sources=[os.path.join(_HERE, "taco_binding.cpp"),
                                                            os.path.join(_HERE, "taco_kernels.cu")],
                            extra_cuda_cflags=["-O3", "-fmad=false"] + extra, extra_include_paths=[_HERE],
                            build_directory=build, verbose=verbose)
    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if shared and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        dist.barrier()                                             # wait for local rank 0's build
        ext = build_it()
    else:
        ext = build_it()
        if shared:
            dist.barrier()
    _KERNELS = _Kernels(ext)
    return _KERNELS


def _kernels():
    return _KERNELS if _KERNELS is not None else load_kernels()


# -----------------------------------------------------------------------------
# compressed collectives

@dataclass
class CommStats:
    """Bytes this rank put on the wire vs what an uncompressed ring all-reduce would have sent."""
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


def cdiv(a, b):
    return -(-a // b)


def _plan_chunks(n, W, B, chunks):
    """Split n elements into <= chunks contiguous pieces, each a multiple of W*B elements except the last."""
    per = cdiv(cdiv(n, chunks), W * B) * W * B
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def emulated_all_reduce(partials, codec=DEFAULT_CODEC, block_size=256):
    """What `all_reduce` returns when rank r contributes partials[r], computed in one process with the
    same arithmetic (same shards, same fp32 rank-order sum, same re-encode): the TP-emulation path."""
    cd = get_codec(codec, block_size)
    W, n = len(partials), partials[0].numel()
    if cd is IDENTITY:
        return rank_order_sum(partials).view_as(partials[0]).to(partials[0].dtype)
    L = cd.padded(cdiv(n, W))
    # all W ranks' W messages in one encode (message r*W + k: rank r's shard k; messages are
    # independent, so this is bit for bit what each rank encodes)
    x = partials[0].new_zeros(W, W * L)
    x[:, :n] = torch.stack([p.reshape(-1) for p in partials])
    sent = cd.encode(x.view(-1), W * W, L).view(W, W, -1)              # [sender, shard, byte]
    # what rank k does with the W messages for shard k (rank order), then everyone's decode
    mine = torch.stack([cd.reduce_encode(sent[:, k], L) for k in range(W)])
    return cd.decode(mine, L, n, partials[0].dtype).view_as(partials[0])


# torch >= 2.12 renames all_gather_into_tensor to all_gather_single (same arguments)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Pending:
    """What all_reduce(async_op=True) returns: wait() runs the rest of the collective (once)."""

    def __init__(self, rest):
        self.rest = rest

    def wait(self):
        if self.rest is not None:
            self.rest()
            self.rest = None
        return True


# -----------------------------------------------------------------------------
# the symmetric-memory transport: inside one node, the shards go peer to peer, not through NCCL

class _SymmWorkspace:
    """A buffer in PyTorch's symmetric memory, one per (group, device), mapped by every rank of
    the group: a kernel on rank r reads rank q's compressed shard straight from q's GPU over
    NVLink, so a collective is three kernels and two barriers, no NCCL call, no staging copy.

    Layout: [ A: W messages | B: 1 message ]. Order of one call (all on this workspace's stream):
      all_reduce:                  write my A; barrier; reduce every peer's A[me] into my B;
                                   barrier; decode every peer's B (all W shards, mine included)
      reduce_scatter, all_gather:  write my A; barrier; read the peers' A; barrier
    Why no call can overwrite what a peer still reads: every read of an A comes before a barrier
    that its owner passes before writing A again; B is written only after the call's first
    barrier, which a peer reaches only after it finished reading the previous B. symm_mem's
    barrier consumes its signals (put: 0 -> 1 on the peer, wait: 1 -> 0 on mine), so a stale
    flag from an earlier call cannot satisfy a later one, also when a CUDA graph replays it.
    Growing the buffer is collective (every rank makes the same calls with the same sizes) and
    cannot happen inside a CUDA-graph capture: run the collective once before capturing. Old
    buffers are kept (a peer may still read them); sizes double, so that costs < 2x."""

    def __init__(self, group, device):
        self.group, self.device = group, device
        self.group_name = (group or dist.group.WORLD).group_name
        self.W, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.stream = torch.cuda.Stream(device)
        self.buf, self.hdl, self.ptrs, self.retired = None, None, [], []

    def reserve(self, nbytes):
        if self.buf is not None and self.buf.numel() >= nbytes:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("taco: the symmetric-memory buffer must grow, which cannot be captured in a "
                               "CUDA graph: run the collective once with the same sizes before capturing")
        import warnings
        import torch.distributed._symmetric_memory as symm_mem
        with warnings.catch_warnings():                  # needed by older torch, a deprecated no-op in newer
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        size = max(nbytes, 2 * (0 if self.buf is None else self.buf.numel()), 1 << 20)
        if self.buf is not None:
            self.retired.append((self.buf, self.hdl))
        self.buf = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        self.hdl = symm_mem.rendezvous(self.buf, self.group_name)
        self.ptrs = [int(p) for p in self.hdl.buffer_ptrs]

    @torch.compiler.disable            # streams and raw addresses: run eagerly, also inside torch.compile
    def run(self, fn, async_op, then=None):
        """fn() on this workspace's stream, ordered after the caller's stream; the caller's stream
        waits for it now, or at handle.wait() (async_op: other work meanwhile, e.g. the weight-
        gradient matmuls), and then runs then()."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)                       # the input is ready
        with torch.cuda.stream(self.stream):
            fn()

        def done():
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            if then is not None:
                then()
        if async_op:
            return _Pending(done)
        done()

    def all_reduce(self, flat, cd, stats, async_op, then=None):
        W, me, K = self.W, self.me, _kernels()
        L = cd.padded(cdiv(flat.numel(), W))
        S = cd.nbytes(L)
        self.reserve((W + 1) * S)

        def fn():
            K.encode(cd, flat, W, L, into=self.buf[:W * S])              # my A: message q is for rank q
            self.hdl.barrier(channel=0)
            K.reduce_encode_peers(cd, [p + me * S for p in self.ptrs], L, self.buf[W * S:(W + 1) * S])
            self.hdl.barrier(channel=1)
            K.decode_peers(cd, [p + W * S for p in self.ptrs], L, flat)   # every B, mine included
        if stats is not None:
            stats.add(2 * (W - 1) * S, 2 * (W - 1) * flat.numel() * flat.element_size() / W)
        return self.run(fn, async_op, then)

    def all_reduce_plain(self, flat, stats, async_op, then=None):
        """Uncompressed (codec none, transport "symm"): PyTorch's own symmetric-memory two-shot
        all-reduce, the fastest uncompressed one inside a node (bench.py collective) and so the
        baseline to beat. Its input must live in symmetric memory: flat is copied in, and the sum
        is written back to flat (one extra copy of the tensor, which the compressed path avoids:
        its encode kernel reads flat and writes the buffer)."""
        n, esize = flat.numel(), flat.element_size()
        npad = cdiv(n, 16 // esize) * (16 // esize)          # the op wants 16-byte multiples: zero padding
        nbytes = npad * esize
        self.reserve(nbytes)
        op = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None)

        def fn():
            buf = self.buf[:nbytes].view(flat.dtype)
            buf[:n].copy_(flat)
            if npad > n:
                buf[n:].zero_()
            if op is not None and npad == n:
                op(buf, "sum", self.group_name, flat)
            else:                                            # in place, then copy back
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
                flat.copy_(buf[:n])
        if stats is not None:
            logical = 2 * (self.W - 1) * nbytes / self.W
            stats.add(logical, logical)
        return self.run(fn, async_op, then)

    def gather_messages(self, cd, x, M, L, msg):
        """Encode x as M messages into my A, then decode message `msg` of every rank's A
        (rank order) into a (W, L) fp32 tensor."""
        S, K = cd.nbytes(L), _kernels()
        self.reserve(M * S)
        out = torch.empty(self.W, L, dtype=torch.float32, device=self.device)

        def fn():
            K.encode(cd, x, M, L, into=self.buf[:M * S])
            self.hdl.barrier(channel=0)
            K.decode_peers(cd, [p + msg * S for p in self.ptrs], L, out.view(-1))
            self.hdl.barrier(channel=1)                      # nobody rewrites its A before all have read it
        self.run(fn, async_op=False)
        return out, S


@functools.lru_cache(maxsize=None)
def _peer_access_everywhere():
    n = torch.cuda.device_count()
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b)


_WORKSPACES = {}


def _why_not_symm(x, cd, W):
    """Why the symmetric-memory transport cannot carry this collective, or None if it can."""
    env = os.environ.get
    if not x.is_cuda:
        return "the tensor is not on a GPU"
    if cd is not IDENTITY and not (isinstance(cd, Codec) and cd._kernel_ok(x)):
        return f"codec {cd.name} has no fused kernel (the B=256 block codecs have)"
    if W > 8:
        return "more than 8 ranks"
    if env("LOCAL_WORLD_SIZE") is None:
        return "LOCAL_WORLD_SIZE is unset (torchrun sets it): cannot tell that the job is on one node"
    if env("LOCAL_WORLD_SIZE") != env("WORLD_SIZE"):
        return "the job spans more than one node"
    if not _peer_access_everywhere():
        return "no peer access between the GPUs"
    if env("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        return "NCCL_P2P_DISABLE is set"
    return None


def symm_workspace(x, group, cd, transport):
    """The symmetric-memory workspace for this collective, or None for the torch.distributed path.
    transport: "dist" (NCCL, gloo: portable), "symm" (required: an error if impossible), or
    "auto" = symm when x is on a GPU, the kernels cover the codec, the whole job runs on this
    node with peer access between all GPUs, and NCCL_P2P_DISABLE is not set (we use that to
    stand for a host-staged link, and then the NCCL path is the one being measured)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: choose {', '.join(TRANSPORTS)}")
    if transport == "dist":
        return None
    why = _why_not_symm(x, cd, dist.get_world_size(group))
    if why is not None:
        if transport == "symm":
            raise RuntimeError(f"taco: transport='symm' is impossible here: {why}; use transport='dist' or 'auto'")
        return None
    key = ((group or dist.group.WORLD).group_name, x.device)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = _SymmWorkspace(group, x.device)
    return _WORKSPACES[key]


def all_reduce(x, group=None, codec=DEFAULT_CODEC, block_size=256, chunks=1,
               min_bytes=DEFAULT_MIN_BYTES, stats=None, async_op=False, transport="auto"):
    """In-place SUM over `group`, like torch.distributed.all_reduce, two-shot and compressed.
    Returns x; with async_op=True a handle instead, after the first phase has been started (the
    shards compressed and their all-to-all under way): do other work, then handle.wait(), after
    which x holds the sum. codec "none" (or a tensor under min_bytes) is a plain dist.all_reduce,
    or with transport="symm" PyTorch's symmetric-memory two-shot (_SymmWorkspace.all_reduce_plain).
    transport (symm_workspace): "auto" takes symmetric memory inside a node (one chunk, no NCCL),
    torch.distributed (NCCL or gloo) otherwise; both give the same bits."""
    W = dist.get_world_size(group) if dist.is_initialized() else 1
    n, esize = x.numel(), x.element_size()
    logical = 2 * (W - 1) * n * esize / W
    cd = get_codec(codec, block_size)
    if W == 1:
        return _Pending(None) if async_op else x
    plain_symm = cd is IDENTITY and transport == "symm" and n > 0     # uncompressed over symmetric memory
    if not plain_symm and (cd is IDENTITY or n * esize < min_bytes or n == 0):
        work = dist.all_reduce(x, group=group, async_op=async_op)
        if stats is not None:
            stats.add(logical, logical)
        return work if async_op else x
    flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
    ws = symm_workspace(x, group, cd, transport)
    if ws is not None:                     # (a non-contiguous x: flat is a copy, written back at the end)
        then = None if x.is_contiguous() else (lambda: x.copy_(flat.view_as(x)))
        handle = (ws.all_reduce_plain(flat, stats, async_op, then) if plain_symm else
                  ws.all_reduce(flat, cd, stats, async_op, then))
        return handle if async_op else x
    pending, wire = [], 0
    # === reduce-scatter phase: compress every chunk's W shards, start its all-to-all ===
    for a, b in _plan_chunks(n, W, cd.B, chunks):
        L = cd.padded(cdiv(b - a, W))                              # shard length, whole blocks
        send = cd.encode(flat[a:b], W, L)                          # (W, S): message r is for rank r
        recv = torch.empty_like(send)
        # async: the next chunk is compressed while this one is on the wire (on GPU, NCCL's stream)
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        pending.append((a, b, L, work, recv))
        wire += 2 * (W - 1) * send.shape[1]
    if stats is not None:
        stats.add(wire, logical)

    def rest():
        # === reduce my shard in fp32 (rank order), re-compress, start the all-gather ===
        gathers = []
        for a, b, L, work, recv in pending:
            work.wait()                                            # orders the stream, no host sync on GPU
            mine = cd.reduce_encode(recv, L)
            gathered = torch.empty(W * mine.numel(), dtype=torch.uint8, device=x.device)
            gathers.append((a, b, L, _all_gather_flat(gathered, mine, group=group, async_op=True),
                            gathered.view(W, -1)))
        # === decode all W shards, my own included, from the gathered bytes ===
        for a, b, L, work, gathered in gathers:
            work.wait()
            cd.decode(gathered, L, b - a, out=flat[a:b])
        if not x.is_contiguous():
            x.copy_(flat.view_as(x))

    if async_op:
        return _Pending(rest)
    rest()
    return x


def reduce_scatter(x, group=None, codec=DEFAULT_CODEC, block_size=256, stats=None, transport="auto"):
    """Sum over the group of x (n elements, n divisible by W); returns this rank's n/W slice.
    The summed shard is not re-compressed (it stays with its owner)."""
    W = dist.get_world_size(group)
    n = x.numel()
    if n % W:
        raise ValueError(f"reduce_scatter needs numel ({n}) divisible by the group size ({W})")
    cd = get_codec(codec, block_size)
    out = torch.empty(n // W, dtype=x.dtype, device=x.device)
    if cd is IDENTITY:
        dist.reduce_scatter_tensor(out, x.reshape(-1).contiguous(), group=group)
        if stats is not None:
            stats.add((W - 1) * out.numel() * x.element_size(), (W - 1) * out.numel() * x.element_size())
        return out
    L = cd.padded(n // W)
    shards = torch.zeros(W, L, dtype=x.dtype, device=x.device)     # shard r padded to whole blocks
    shards[:, :n // W] = x.reshape(W, n // W)
    ws = symm_workspace(x, group, cd, transport)
    if ws is not None:                     # the W messages for my shard, read from the peers' buffers
        parts, S = ws.gather_messages(cd, shards.view(-1), W, L, dist.get_rank(group))
    else:
        send = cd.encode(shards.view(-1), W, L)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        parts, S = cd.decode(recv, L).view(W, L), send.shape[1]
    out.copy_(rank_order_sum(parts)[:n // W])
    if stats is not None:
        stats.add((W - 1) * S, (W - 1) * out.numel() * x.element_size())
    return out


def all_gather(x, group=None, codec=DEFAULT_CODEC, block_size=256, stats=None, transport="auto"):
    """Concatenate x from every rank (rank order); every rank decodes every piece, its own
    included, so all ranks hold bitwise-identical results."""
    W = dist.get_world_size(group)
    n = x.numel()
    cd = get_codec(codec, block_size)
    out = torch.empty(W * n, dtype=x.dtype, device=x.device)
    if cd is IDENTITY:
        _all_gather_flat(out, x.reshape(-1).contiguous(), group=group)
        if stats is not None:
            stats.add((W - 1) * n * x.element_size(), (W - 1) * n * x.element_size())
        return out
    ws = symm_workspace(x, group, cd, transport) if n else None
    if ws is not None:                     # every rank's one message, read from its buffer
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
