"""
tahquant — a TAH-Quant-style tile codec (arXiv 2506.01352, "Tile-wise Adaptive Hadamard
Quantization"): the TACO paper's TP baseline (its Table 1), and a codec for the activations between
pipeline stages. Same interface as taco.Codec; PyTorch only, no fused kernel. Importing the lab
registers it as taco codec `tahquant` (lab.emulate and lab.analysis import it); to train with it:

    torchrun --nproc_per_node=4 -m lab.tahquant configs/demo.py --pp_codec=tahquant --pp_codec_bwd=hint8
"""

import functools
import math
import sys

import torch

import taco
from taco import Codec, cdiv, fwht, pack_bits, rank_order_sum, unpack_bits


class TahQuant:
    """What we implement, per message of L elements (T = L / 64 tiles of 64 consecutive elements;
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
        self.name, self.block, self.int3_share, self.kappa = name, tile, int3_share, kappa
        self.c = 1.0 / math.sqrt(tile)  # 1/8: exact in fp32
        # c * log2(c) for a count c of equal codes in a tile, as integers so sums are exact everywhere
        c = torch.arange(tile + 1, dtype=torch.float64)
        self.clogc = torch.round(torch.where(c > 0, c * torch.log2(c.clamp(min=1)), c) * 2**20).long()

    @functools.lru_cache(maxsize=None)
    def _clogc(self, device):
        return self.clogc.to(device)

    def __repr__(self):
        return f"TahQuant(tile={self.block}, int3_share={self.int3_share})"

    def padded(self, n):
        return cdiv(n, self.block) * self.block

    def kernel_ok(self, t):
        return False  # no fused kernel: the reference everywhere

    def n_int3(self, T):
        return int(self.int3_share * T)

    def payload_bytes(self, T):
        """Code bytes of a message of T tiles: 32 per INT4 tile, 24 per INT3 tile."""
        k3 = self.n_int3(T)
        return (T - k3) * self.block // 2 + k3 * self.block * 3 // 8

    def nbytes(self, L):
        T = L // self.block
        return cdiv(9 * T + self.payload_bytes(T), 16) * 16

    def _swap(self, g, piv):
        """g (M, T, G) with element 0 and element piv of every tile exchanged (an involution)."""
        piv = piv[..., None]
        out = g.clone()
        out.scatter_(-1, piv, g[..., :1])  # piv == 0: both writes put back g[0]
        out[..., :1] = torch.gather(g, -1, piv)
        return out

    def _positions(self, int3, P):
        """(M, T, G/2) payload index of every tile's code bytes; the 8 bytes an INT3 tile does not use
        point at the spare byte M * P (past the payload). No data-dependent shapes, no host syncs."""
        M, T = int3.shape
        size = torch.where(int3, self.block * 3 // 8, self.block // 2)
        off = torch.cumsum(size, dim=1) - size + torch.arange(M, device=int3.device)[:, None] * P
        j = torch.arange(self.block // 2, device=int3.device)
        return torch.where(j < size[..., None], off[..., None] + j, M * P)

    def _quant(self, z, levels):
        """Asymmetric per-tile quantization of z (..., 64) to [0, levels]: (q, lo, step)."""
        lo, hi = z.amin(dim=-1), z.amax(dim=-1)
        step = (hi - lo) / levels
        q = torch.round((z - lo[..., None]) / torch.where(step > 0, step, torch.ones_like(step))[..., None])
        return q.clamp(0, levels), lo, step

    def encode(self, x, M, L):
        assert L % self.block == 0 and x.dim() == 1 and x.numel() <= M * L
        T, G = L // self.block, self.block
        g = torch.zeros(M * L, dtype=torch.float32, device=x.device)
        g[: x.numel()] = x
        g = g.view(M, T, G)
        bad = ~torch.isfinite(g).all(dim=-1)
        g = torch.where(bad[..., None], torch.zeros_like(g), g)
        # === 1. pivot swap + Hadamard on tiles with a dominant outlier ===
        piv = g.abs().argmax(dim=-1)  # first index of the max
        peak = g.abs().amax(dim=-1)
        r = g / torch.where(peak > 0, peak, torch.ones_like(peak))[..., None]  # scale-free: no overflow
        had = (self.kappa**2 * (r * r).mean(dim=-1) < 1) & ~bad
        z = torch.where(had[..., None], fwht(self._swap(g, piv) * self.c), g)  # 1/8 first: exact, and no overflow
        # === 2-3. INT4 everywhere, then the lowest-entropy share of tiles at INT3 ===
        q4, lo, step = self._quant(z, 15)
        counts = torch.zeros(M, T, 16, dtype=torch.int32, device=x.device).scatter_add_(
            -1, q4.long(), torch.ones_like(q4, dtype=torch.int32)
        )  # (M, T, 16) code histogram
        key = torch.where(bad, torch.iinfo(torch.int64).min, self._clogc(x.device)[counts.long()].sum(-1))
        k3 = self.n_int3(T)
        int3 = torch.zeros(M, T, dtype=torch.bool, device=x.device)
        if k3:  # largest sum c log c = lowest entropy; bad tiles last
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
        codes = torch.where(int3[..., None], q3, pack_bits(q, 4))
        payload = torch.zeros(M * P + 1, dtype=torch.uint8, device=x.device)
        payload[self._positions(int3, P)] = codes  # only the spare byte is written twice
        payload = payload[:-1]
        out = torch.cat(
            (meta.reshape(M, -1).contiguous().view(torch.uint8), flags.to(torch.uint8), payload.view(M, -1)), dim=1
        )
        pad = self.nbytes(L) - out.shape[1]
        return torch.cat((out, out.new_zeros(M, pad)), dim=1) if pad else out

    def _decode_ref(self, buf, L):
        M, T, G = buf.shape[0], L // self.block, self.block
        P = self.payload_bytes(T)
        meta = buf[:, : 8 * T].contiguous().view(torch.float32).view(M, T, 2)
        flags = buf[:, 8 * T : 9 * T].int()
        payload = buf[:, 9 * T : 9 * T + P].reshape(-1)
        int3, had, piv = (flags >> 7) & 1 == 1, (flags >> 6) & 1 == 1, (flags & 63).long()
        codes = torch.cat((payload, payload.new_zeros(1)))[self._positions(int3, P)]  # (M, T, G/2)
        q = torch.where(int3[..., None], _unpack_u3(codes[..., : G * 3 // 8]), unpack_bits(codes, 4) & 15).float()
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


taco.EXTRA_CODECS["tahquant"] = TahQuant


if __name__ == "__main__":
    import train

    train.main(sys.argv[1:])
