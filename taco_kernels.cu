// taco_kernels.cu — fused TACO codec kernels: compress, decompress, decompress-reduce-compress, bit-exact with
// taco.py's reference.
//
// The wire format (taco.py's docstring): a message of L elements is nbs = L / BLOCK blocks, in one buffer
//     [ payload: nbs * BLOCK * bits / 8 bytes ][ per block fp32 metadata: (alpha_k,) s_k ][ zeros to 16 bytes ]
// block k's codes at k * BLOCK * bits / 8 (a rotated block's in the wire's lane order, taco.lane_order), its
// metadata at the payload's end + 4 nmeta k. A bad block (NaN/Inf in, or overflow) has codes 0 and metadata NaN.
//
// The equations, numbered as in the TACO paper and taco.py (the same "=== Eq. N" markers mark them there and here):
//     sigma_k = sqrt(mean(G_k^2) + eps)              (6)   encode
//     alpha_k = tau / sigma_k                        (7)
//     Z_k     = H(alpha_k G_k) / sqrt(BLOCK)         (8)   H: the Walsh-Hadamard transform of the block
//     s_k     = max|Z_k| / Qmax                      (9)
//     q_k     = code(Z_k / s_k)                      (10)  FP8 E4M3 / E5M2 saturating, INT8 / INT6 half to even
//     Z' = q s    Y' = H(Z') / sqrt(BLOCK)    G' = Y' / alpha          (11) (12) (13)   decode
// and the reduce step of the two-shot all-reduce: P messages decoded up to, not through, H (q s / alpha), summed in
// fp32 in message order, encoded again from (9) on: H is linear, so the transforms cancel.
//
// The three kernels, after the equations' device functions: encode_kernel (6-10), decode_kernel (11-13),
// reduce_encode_kernel. Work split: a warp owns GROUP = 4 blocks of BLOCK = 256 elements and runs them in lock
// step (all loads issued first, then each stage for the GROUP blocks: independent instructions that hide latency),
// and loops over such groups, fetching the next group's input while it computes this one (decode and the reduce
// step into registers; encode into shared memory, cp.async, which holds no registers). A block is read from global
// memory once, written once. How a lane holds its 8 elements of a block, and the transform's butterflies and
// layout changes: taco_kernels_lanes.cuh; loads, staging, stores and the host's questions: taco_kernels_io.cuh.
//
// The arithmetic is the reference's (taco.py), operation for operation and in the same order:
// fp32 products and sums without FMA contraction (built with -fmad=false), the sum of squares
// folded in the reference's order, IEEE division and sqrt; the one fused multiply-add is the
// integer codes' rounding of the exact product Z * (1/s), which the reference takes in fp64. That
// makes the codes bit-identical to the PyTorch reference. Two shortcuts are exact and guarded (see
// encode / decode): 1/sqrt(BLOCK) = 1/16 is a power of two, so it is folded into the block's scale where
// no value can be subnormal or overflow; integers are rounded with the 1.5 * 2^23 trick and
// converted back the same way. Plain CUDA: no PyTorch headers, so an edit here recompiles in seconds.
#include <cstdio>
#include <cuda_fp8.h>

#include "taco_kernels_io.cuh"      // BLOCK, E, GROUP, WARPS, FULL; loads, staging, conversions, stores; grid, capture
#include "taco_kernels_lanes.cuh"   // SMW; the transform's butterflies and layout changes; the warp's reductions

namespace {

constexpr int EW = 4;                  // warps per CTA in encode
constexpr int ENC_CTAS = 7;            // encode's CTAs per SM (__launch_bounds__): <= 72 registers a thread
constexpr int RGROUP = 2;              // blocks per warp in reduce-encode (it holds two sets of values)
constexpr long long RED_CTAS_PER_SM = 16;  // reduce-encode's grid cap; past it its warps loop over groups
constexpr unsigned CANONICAL_NAN = 0x7fc00000u;   // what torch.tensor(float("nan")) stores
constexpr float MAGIC = 12582912.f;    // 1.5 * 2^23: y + MAGIC holds round(y) in its low mantissa bits
constexpr float INV_SQRT_BLOCK = 0.0625f;             // 1 / sqrt(BLOCK)
constexpr float SQRT_BLOCK = INV_SQRT_BLOCK * BLOCK;  // encode rotates x / BLOCK (no overflow), then scales by this
constexpr float S_MIN = 0x1p-126f;     // the smallest block scale (1 / s stays finite)
// a rotated block whose absmax (of x / BLOCK) is under this is scaled in the reference's order (taco.TINY)
constexpr float TINY_ABSMAX = 0x1p-80f / BLOCK;

// Of a message's nbs blocks, how many lie wholly inside a tensor whose rem (<= 0: none) elements from the
// message's start on exist, and how many hold any: 32-bit block indices (the host refuses L / BLOCK >= 2^30)
__device__ __forceinline__ int whole_blocks(long long rem, int nbs) {
  return rem <= 0 ? 0 : (int)min((long long)nbs, rem / BLOCK);
}

__device__ __forceinline__ int touched_blocks(long long rem, int nbs) {
  return rem <= 0 ? 0 : (int)min((long long)nbs, (rem + BLOCK - 1) / BLOCK);
}


// --- codes ----------------------------------------------------------------------------------------

// the fp8 codes of y[0..7], saturating (the same codes as clamp(+-qmax) then cast), low byte first in
// two words: paired conversions, each pair's two bytes already side by side
template <int FMT>
__device__ __forceinline__ void quant_fp8(const float y[E], unsigned& lo, unsigned& hi) {
  unsigned h[4];
  UNROLL for (int i = 0; i < 4; i++)
    h[i] = __nv_cvt_float2_to_fp8x2(make_float2(y[2 * i], y[2 * i + 1]), __NV_SATFINITE,
                                    FMT == TACO_E4M3 ? __NV_E4M3 : __NV_E5M2);
  lo = __byte_perm(h[0], h[1], 0x5410);
  hi = __byte_perm(h[2], h[3], 0x5410);
}

// 8 codes of a lane, low byte first in two words -> the block's payload
template <int FMT>
__device__ __forceinline__ void write_codes(uint8_t* blk, int lane, unsigned lo, unsigned hi) {
  if (FMT == TACO_INT6) {          // 8 codes -> 6 bytes: two groups of w = u0|u1<<6|u2<<12|u3<<18
    const unsigned a = lo & 0x3f3f3f3fu, b = hi & 0x3f3f3f3fu;
    const unsigned w0 = (a & 0x3fu) | ((a >> 2) & 0xfc0u) | ((a >> 4) & 0x3f000u) | ((a >> 6) & 0xfc0000u);
    const unsigned w1 = (b & 0x3fu) | ((b >> 2) & 0xfc0u) | ((b >> 4) & 0x3f000u) | ((b >> 6) & 0xfc0000u);
    unsigned short* dst = reinterpret_cast<unsigned short*>(blk + 6 * lane);
    dst[0] = w0 & 0xffff;
    dst[1] = (w0 >> 16) | ((w1 & 0xff) << 8);
    dst[2] = w1 >> 8;
  } else {
    *reinterpret_cast<uint2*>(blk + 8 * lane) = make_uint2(lo, hi);
  }
}

template <int FMT>
__host__ __device__ constexpr int payload_bytes() { return FMT == TACO_INT6 ? 192 : 256; }

// one lane's codes of one block (INT6: 4 codes of 6 bits in each word) and the block's metadata
struct Raw {
  unsigned lo, hi;
  float s, alpha;
};

// blocks first .. first + nk - 1 of a message of nbs blocks (the rest of r: block first again); the
// addresses from two pointers and 32-bit offsets. INT6: a lane's 6 bytes as the two aligned words that
// hold them (WORDS; decode's choice) or as three halfwords (fewer registers; the reduce step's). SPLIT:
// a whole group (nk == N) takes a path of its own with constant offsets (decode's choice; the reduce
// step is faster without; docs/KERNELS.md).
template <int FMT, int N, bool WORDS, bool ALL>
__device__ __forceinline__ void load_blocks(Raw (&r)[N], const uint8_t* blk, const float* meta, int nk, int lane,
                                            const TacoParams& p) {
  const int pb = payload_bytes<FMT>();
  UNROLL for (int k = 0; k < N; k++) {
    const int kk = ALL || k < nk ? k : 0;
    if (FMT == TACO_INT6 && WORDS) {   // the two words holding the lane's 6 bytes (from byte 0 or 2 of them)
      const unsigned* src = reinterpret_cast<const unsigned*>(blk + kk * pb - 2 * (lane & 1));
      const unsigned long long v = (src[0] | (unsigned long long)src[1] << 32) >> (16 * (lane & 1));
      r[k].lo = (unsigned)v;                  // dequant8 reads the low 24 bits of each
      r[k].hi = (unsigned)(v >> 24);
    } else if (FMT == TACO_INT6) {
      const unsigned short* src = reinterpret_cast<const unsigned short*>(blk + kk * pb);
      unsigned a = src[0], b = src[1], c = src[2];
      r[k].lo = a | ((b & 0xff) << 16);
      r[k].hi = (b >> 8) | (c << 8);
    } else {
      uint2 u = *reinterpret_cast<const uint2*>(blk + kk * pb);
      r[k].lo = u.x;
      r[k].hi = u.y;
    }
    r[k].s = p.scale_block ? meta[kk * p.nmeta + p.nmeta - 1] : 1.f;
    r[k].alpha = p.adaptive ? meta[kk * p.nmeta] : 1.f;
  }
}

template <int FMT, int N, bool WORDS = true, bool SPLIT = true>
__device__ __forceinline__ void load_group(Raw (&r)[N], const uint8_t* msg, int first, int nk, int nbs, int lane,
                                           const TacoParams& p) {
  const uint8_t* blk = msg + (long long)first * payload_bytes<FMT>() + (FMT == TACO_INT6 ? 6 : 8) * lane;
  const float* meta = reinterpret_cast<const float*>(msg + (long long)nbs * payload_bytes<FMT>()) +
                      (long long)first * p.nmeta;
  if (SPLIT && nk == N) load_blocks<FMT, N, WORDS, true>(r, blk, meta, nk, lane, p);   // constant offsets
  else load_blocks<FMT, N, WORDS, false>(r, blk, meta, nk, lane, p);
}

// codes -> values, layout io. Integers come back exactly: the code, biased to be non-negative, as the
// low mantissa bits of 1.5 * 2^23, minus the same constant.
template <int FMT>
__device__ __forceinline__ void dequant8(const Raw& r, float v[E]) {
  if (FMT == TACO_INT8) {
    const unsigned lo = r.lo ^ 0x80808080u, hi = r.hi ^ 0x80808080u;      // k -> k + 128
    UNROLL for (int j = 0; j < 4; j++) {                   // byte j of the codes under the constant's top bytes
      v[j] = __uint_as_float(__byte_perm(0x4B400000u, lo, 0x3214 + j)) - (MAGIC + 128.f);
      v[j + 4] = __uint_as_float(__byte_perm(0x4B400000u, hi, 0x3214 + j)) - (MAGIC + 128.f);
    }
  } else if (FMT == TACO_INT6) {
    UNROLL for (int j = 0; j < 4; j++) {                                        // k -> k + 32
      v[j] = __uint_as_float(((r.lo >> (6 * j)) & 63u) ^ 0x4B400020u) - (MAGIC + 32.f);
      v[j + 4] = __uint_as_float(((r.hi >> (6 * j)) & 63u) ^ 0x4B400020u) - (MAGIC + 32.f);
    }
  } else {
    const __nv_fp8_interpretation_t f = FMT == TACO_E4M3 ? __NV_E4M3 : __NV_E5M2;
    const unsigned w[2] = {r.lo, r.hi};
    UNROLL for (int j = 0; j < E; j += 2) {                                      // fp8 -> fp16 -> fp32: exact
      __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[j / 4] >> (8 * (j & 3))), f);
      float2 x = __half22float2(*reinterpret_cast<__half2*>(&h));
      v[j] = x.x;
      v[j + 1] = x.y;
    }
  }
}

// --- encode: Eq. 6-10 on N blocks ---------------------------------------------------------------

// Each step below is one equation of taco.py's reference (Codec._encode_ref), on N blocks at once.
// A block is bad (codes 0, metadata NaN) when it holds NaN/Inf or its arithmetic overflows: the
// reference's predicate, tested where it shows anyway (a non-finite input makes the sum of squares
// non-finite, and every rotated value; the absmax sees it in any case).

// === Eq. 6-7: alpha = tau / sqrt(mean(G^2) + eps), then G * alpha (and the rotation's 1/BLOCK) ===
// returns lane k's copy of block k's alpha; alpha[k] is block k's in every lane
template <bool ROT, int N>
__device__ __forceinline__ float adaptive_scale(float (&v)[N][E], bool (&bad)[N], float (&alpha)[N], int lane,
                                                const TacoParams& p) {
  float ss[N];
  UNROLL for (int k = 0; k < N; k++) {
    ss[k] = v[k][0] * v[k][0];
    UNROLL for (int j = 1; j < E; j++) ss[k] = ss[k] + v[k][j] * v[k][j];
  }
  const float tot = block_sums<N>(ss, lane);
  const float ss_mine = __shfl_sync(FULL, tot, lane * (32 / N));
  // |x| ~> 1e19 overflows the squares: sigma of x * 2^-80, times 2^80 (a warp-uniform branch); a
  // block with NaN/Inf stays non-finite there too, and is bad
  float sg = -1.f;
  if (__any_sync(FULL, !isfinite(tot))) {
    float s2[N];
    UNROLL for (int k = 0; k < N; k++) {
      s2[k] = (v[k][0] * 0x1p-80f) * (v[k][0] * 0x1p-80f);
      UNROLL for (int j = 1; j < E; j++) s2[k] = s2[k] + (v[k][j] * 0x1p-80f) * (v[k][j] * 0x1p-80f);
    }
    const float t2 = block_sums<N>(s2, lane);
    const unsigned nonfinite = __ballot_sync(FULL, !isfinite(t2));
    UNROLL for (int k = 0; k < N; k++) bad[k] = (nonfinite >> (k * (32 / N))) & 1u;
    const float s2_mine = __shfl_sync(FULL, t2, lane * (32 / N));
    sg = isfinite(ss_mine) ? -1.f : sqrtf(s2_mine * (1.0f / BLOCK)) * 0x1p80f;
  }
  const float alpha_mine = p.tau / (sg >= 0.f ? sg : sqrtf(ss_mine * (1.0f / BLOCK) + p.eps));
  lane_spread<N>(alpha_mine, alpha);
  UNROLL for (int k = 0; k < N; k++) {
    const float mul = ROT ? alpha[k] * (1.0f / BLOCK) : alpha[k];        // the rotation's 1/BLOCK folded in
    UNROLL for (int j = 0; j < E; j++) v[k][j] = v[k][j] * mul;
  }
  return alpha_mine;
}

// === Eq. 9: s = max|Z| / Qmax, and the multiplier of Eq. 10's Z / s, as Z * (1 / s) ===
// returns lane k's copy of block k's s; mul[k] is block k's multiplier (v holds Z / SQRT_BLOCK when rotated)
template <int FMT, bool ROT, int N>
__device__ __forceinline__ float block_scale(float (&v)[N][E], bool (&bad)[N], float (&mul)[N], int lane,
                                             const TacoParams& p) {
  float m[N], s_mine;
  UNROLL for (int k = 0; k < N; k++) {
    const unsigned mb = absmax_bits(v[k]);
    bad[k] |= mb >= 0x7f800000u;
    m[k] = __uint_as_float(mb);
  }
  const float mm = lane_pick<N>(m, lane);
  if (ROT) {
    // s = (m / Qmax) * SQRT_BLOCK: the reference's rounding, and never overflows. Then
    // v * (inv * SQRT_BLOCK) == (v * SQRT_BLOCK) * inv for every v whose product v * SQRT_BLOCK is exact,
    // and the others (|v * SQRT_BLOCK| < 2^-126) give code 0 both ways, as |v| / m < 2^-46. Below
    // m = TINY_ABSMAX (where inv * SQRT_BLOCK could overflow): the reference's own order (v * SQRT_BLOCK first).
    s_mine = mm / p.qmax * SQRT_BLOCK;
    s_mine = mm > 0.f && s_mine < S_MIN ? S_MIN : s_mine;
    const float inv = 1.f / (s_mine > 0.f ? s_mine : 1.f);
    lane_spread<N>(mm >= TINY_ABSMAX ? inv * SQRT_BLOCK : inv, mul);
    UNROLL for (int k = 0; k < N; k++) {
      if (!(m[k] >= TINY_ABSMAX)) {
        UNROLL for (int j = 0; j < E; j++) v[k][j] = v[k][j] * SQRT_BLOCK;
      }
    }
  } else {
    s_mine = mm / p.qmax;
    s_mine = mm > 0.f && s_mine < S_MIN ? S_MIN : s_mine;
    lane_spread<N>(1.f / (s_mine > 0.f ? s_mine : 1.f), mul);
  }
  return s_mine;
}

// === Eq. 10: the codes of v * mul (a lane's 8 side by side, low byte first). Integers: the exact
// product rounded half to even, in one FMA (+ 1.5 * 2^23: the integer in the low mantissa bits;
// |Z / s| <= Qmax, so two's complement in the low byte); fp8: v already multiplied. raw (a plain
// cast, no scale at all): a NaN code per non-finite element ===
template <int FMT, int N>
__device__ __forceinline__ void codes(const float (&v)[N][E], const float (&mul)[N], bool raw, unsigned (&lo)[N],
                                      unsigned (&hi)[N]) {
  constexpr bool INT = FMT == TACO_INT8 || FMT == TACO_INT6;
  UNROLL for (int k = 0; k < N; k++) {
    if (INT) {
      unsigned q[E];
      UNROLL for (int j = 0; j < E; j++) q[j] = __float_as_uint(__fmaf_rn(v[k][j], mul[k], MAGIC));
      lo[k] = __byte_perm(__byte_perm(q[0], q[1], 0x0040), __byte_perm(q[2], q[3], 0x0040), 0x5410);
      hi[k] = __byte_perm(__byte_perm(q[4], q[5], 0x0040), __byte_perm(q[6], q[7], 0x0040), 0x5410);
    } else {
      quant_fp8<FMT>(v[k], lo[k], hi[k]);
    }
    if (raw) {
      UNROLL for (int j = 0; j < E; j++) {
        unsigned& w = j < 4 ? lo[k] : hi[k];
        if (!isfinite(v[k][j])) w = (w & ~(0xffu << 8 * (j & 3))) | (0x7fu << 8 * (j & 3));
      }
    }
  }
}

// === pack: the codes (element order, or rotated the wire's lane order) and, by lane k, block k's
// metadata (alpha, s); the last block's writer zeroes the message's padding ===
template <int FMT, bool SCALE, int N>
__device__ __forceinline__ void pack(const unsigned (&lo)[N], const unsigned (&hi)[N], const bool (&bad)[N],
                                     float alpha_mine, float s_mine, int nk, int lane, const TacoParams& p,
                                     uint8_t* msg, int first, int nbs) {
  const int pb = payload_bytes<FMT>();
  uint8_t* blocks = msg + (long long)first * pb;
  UNROLL for (int k = 0; k < N; k++)
    if (k < nk) write_codes<FMT>(blocks + k * pb, lane, bad[k] ? 0u : lo[k], bad[k] ? 0u : hi[k]);
  if (lane < nk) {
    const int lb = first + lane;
    bool bad_mine = bad[0];
    UNROLL for (int k = 1; k < N; k++) bad_mine = lane == k ? bad[k] : bad_mine;
    const float nan = __uint_as_float(CANONICAL_NAN);
    float* meta = reinterpret_cast<float*>(msg + (long long)nbs * pb) + (long long)lb * p.nmeta;
    int i = 0;
    if (p.adaptive) meta[i++] = bad_mine ? nan : alpha_mine;
    if (SCALE) meta[i] = bad_mine ? nan : s_mine;
    if (lb == nbs - 1) {
      for (long long b = (long long)nbs * (pb + 4 * p.nmeta); b < p.S; b++) msg[b] = 0;
    }
  }
}

// Encode N blocks (layout io in registers) into a message: msg, its bytes; blocks first .. first + N - 1
// of nbs, of which the first nk are real (sm: unused without ROT)
template <int FMT, bool ROT, bool SCALE, int N>
__device__ __forceinline__ void encode_blocks(float (&v)[N][E], int nk, int lane, const TacoParams& p,
                                              uint8_t* msg, int first, int nbs, float (*sm)[SMW]) {
  static_assert(SCALE || !(FMT == TACO_INT8 || FMT == TACO_INT6), "integer codes need a block scale");
  bool bad[N];
  float alpha[N], alpha_mine = 1.f, s_mine = 1.f, mul[N];
  UNROLL for (int k = 0; k < N; k++) { bad[k] = false; alpha[k] = 1.f; }
  if (p.adaptive) alpha_mine = adaptive_scale<ROT, N>(v, bad, alpha, lane, p);            // Eq. 6-7
  // === Eq. 8: Z = H(alpha G) / sqrt(BLOCK), as H(alpha G / BLOCK) (butterflies that cannot overflow); the
  // factor SQRT_BLOCK is applied with the scale ===
  if (ROT) {
    if (!p.adaptive) {
      UNROLL for (int k = 0; k < N; k++)
        UNROLL for (int j = 0; j < E; j++) v[k][j] = v[k][j] * (1.0f / BLOCK);
    }
    fwht_io_to_wire<N>(v, sm, lane);
  }
  if (SCALE) {
    s_mine = block_scale<FMT, ROT, N>(v, bad, mul, lane, p);                              // Eq. 9
    if (!(FMT == TACO_INT8 || FMT == TACO_INT6)) {   // integers: the product is taken in the rounding
      UNROLL for (int k = 0; k < N; k++)
        UNROLL for (int j = 0; j < E; j++) v[k][j] = v[k][j] * mul[k];
    }
  } else if (ROT) {
    UNROLL for (int k = 0; k < N; k++)
      UNROLL for (int j = 0; j < E; j++) v[k][j] = v[k][j] * SQRT_BLOCK;
  }
  unsigned lo[N], hi[N];
  codes<FMT, N>(v, mul, !p.adaptive && !SCALE, lo, hi);                                  // Eq. 10
  pack<FMT, SCALE, N>(lo, hi, bad, alpha_mine, s_mine, nk, lane, p, msg, first, nbs);
}

// --- decode N blocks: Z' = q s;  Y' = H(Z') / sqrt(BLOCK);  G' = Y' * (1 / alpha) (sm: unused without ROT)

// r: the blocks' codes (rotated: in layout wire); v: out, layout io. sat: saturate the results at fp32's
// largest finite value, as the reference does at its end (fp32 outputs; 16-bit outputs saturate in
// their conversion, and the reduce step's sums must not)
template <int FMT, bool ROT, bool SCALE, int N>
__device__ __forceinline__ void decode_blocks(const Raw (&r)[N], float (&v)[N][E], int lane, const TacoParams& p,
                                              float (*sm)[SMW], bool sat) {
  // === Eq. 11: Z' = q s (rotated, with 2^-90 <= s: s / sqrt(BLOCK), Eq. 12's factor taken first) ===
  bool fast[N], big[N];
  UNROLL for (int k = 0; k < N; k++) {
    dequant8<FMT>(r[k], v[k]);
    // With 2^-90 <= s <= 2^100 every q s is a multiple of 2^-113 and H(q s) < 2^117: scaling by
    // 1/16 before the transform is exact and gives exactly H(q s) / 16. A huge block (s > 2^100) is
    // transformed in units of 2^64 (its s * 2^-64 is in that range: the same argument), so H cannot
    // overflow. Otherwise (tiny s) the reference's order.
    big[k] = ROT && SCALE && r[k].s > 0x1p100f;
    fast[k] = ROT && SCALE && r[k].s >= 0x1p-90f;
    if (SCALE) {
      const float s = big[k] ? r[k].s * 0x1p-64f : r[k].s;
      const float pre = fast[k] ? s * INV_SQRT_BLOCK : s;
      UNROLL for (int j = 0; j < E; j++) v[k][j] = v[k][j] * pre;
    }
  }
  // === Eq. 12: Y' = H(Z') / sqrt(BLOCK) (the 1 / sqrt(BLOCK) here where it was not taken above) ===
  if (ROT) {
    fwht_wire_to_io<N>(v, sm, lane);
    UNROLL for (int k = 0; k < N; k++) {
      if (!fast[k] || big[k]) {
        const float post = big[k] ? 0x1p64f : INV_SQRT_BLOCK;
        UNROLL for (int j = 0; j < E; j++) v[k][j] = v[k][j] * post;
      }
    }
  }
  // === Eq. 13: G' = Y' * (1 / alpha) ===
  if (p.adaptive) {
    float a[N], ia[N];
    UNROLL for (int k = 0; k < N; k++) a[k] = r[k].alpha;
    lane_spread<N>(1.f / lane_pick<N>(a, lane), ia);
    UNROLL for (int k = 0; k < N; k++)
      UNROLL for (int j = 0; j < E; j++) v[k][j] = v[k][j] * ia[k];
  }
  if (sat) {
    UNROLL for (int k = 0; k < N; k++)
      UNROLL for (int j = 0; j < E; j++) v[k][j] = saturate(v[k][j]);
  }
}

// message i's bytes; the peer pointers are picked with constant indices (an indexed kernel
// parameter would be copied to local memory by every thread)
__device__ __forceinline__ const uint8_t* message(const TacoMsgs& m, long long i, long long S) {
  if (!m.n_ptr) return m.base + i * S;
  const uint8_t* q = m.ptr[0];
  UNROLL for (int k = 1; k < TACO_MAX_PEERS; k++) q = i == k ? m.ptr[k] : q;
  return q;
}

// INT6 decodes faster without the prefetch (docs/KERNELS.md)
template <int FMT>
__host__ __device__ constexpr bool decode_ahead() { return FMT != TACO_INT6; }

// --- kernels: grid (groups of WARPS * GROUP blocks, messages), capped: each warp strides over groups,
// issuing the next group's loads before this group's math (not INT6 decode) -----------------------

// 4 warps per CTA and at most 72 registers a thread (ENC_CTAS), so that 7 CTAs (28 warps) fit on an SM: the
// next group's input waits in shared memory (dynamic: 8 or 16 KB per CTA), not in registers
template <int FMT, bool ROT, bool SCALE>
__global__ void __launch_bounds__(32 * EW, ENC_CTAS) encode_kernel(const void* x, int dt, long long n,
                                                                     TacoParams p, uint8_t* out) {
  __shared__ __align__(16) float smem[EW][GROUP][SMW];
  extern __shared__ __align__(16) uint4 staged_input[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nbs = (int)(p.L / BLOCK), step = gridDim.x * EW * GROUP;
  int first = (blockIdx.x * EW + warp) * GROUP;
  if (first >= nbs) return;                    // the whole warp: no lane waits at a __syncwarp
  const long long msg = blockIdx.y, base = msg * p.L;   // the message's first element
  uint8_t* const m = out + msg * p.S;
  // groups first + GROUP <= whole lie inside x, and are staged when x is 16-byte aligned
  const int whole = (reinterpret_cast<uintptr_t>(x) & 15) ? 0 : whole_blocks(n - base, nbs);
  const bool f32 = dt == TACO_F32;
  uint4* const st = staged_input + warp * GROUP * (f32 ? 64 : 32);
  bool staged = false;                         // the first group is loaded directly, the next ones staged
  for (;;) {
    const int nk = min(GROUP, nbs - first);
    float v[GROUP][E];
    unsigned after = 0u;
    if (staged) {
      after = unstage_group(st, lane, dt, v);
    } else if (!f32 && first + GROUP <= whole) {     // 16-bit, a whole group: GROUP loads from one address
      const uint4* q = reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(x) + base +
                                                      (long long)first * BLOCK + lane * E);
      uint4 u[GROUP];
      UNROLL for (int k = 0; k < GROUP; k++) u[k] = __ldg(q + k * (BLOCK / 8));
      unpack_group<GROUP>(u, dt, v);
    } else {
      UNROLL for (int k = 0; k < GROUP; k++) {
        if (k < nk) load8(x, dt, n, base + (long long)(first + k) * BLOCK + lane * E, v[k]);
        else
          UNROLL for (int j = 0; j < E; j++) v[k][j] = 0.f;
      }
    }
    const bool more = first < nbs - step;
    const int next = first + (more ? step : 0);
    staged = more && next + GROUP <= whole;
    if (staged) {
      if (f32) stage_group<true>(st, lane, after, x, base + (long long)next * BLOCK);
      else stage_group<false>(st, lane, after, x, base + (long long)next * BLOCK);
    }
    encode_blocks<FMT, ROT, SCALE, GROUP>(v, nk, lane, p, m, first, nbs, smem[warp]);
    if (!more) break;
    first = next;
    __syncwarp();                              // this group's shared-memory reads are done
  }
}

template <int FMT, bool ROT, bool SCALE>
__global__ void __launch_bounds__(32 * WARPS) decode_kernel(TacoMsgs buf, TacoParams p, void* out, int dt,
                                                            long long n) {
  __shared__ __align__(16) float smem[WARPS][GROUP][SMW];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nbs = (int)(p.L / BLOCK), step = gridDim.x * WARPS * GROUP;
  const long long msg = blockIdx.y, rem = n - msg * p.L;   // rem: elements of out from this message's start
  // blocks below `touched` hold elements < n (the others are not decoded); groups first + GROUP <= whole
  // lie inside out, and with a 16-byte aligned out so is every lane's first element
  const int touched = touched_blocks(rem, nbs);
  const int whole = (reinterpret_cast<uintptr_t>(out) & 15) ? 0 : whole_blocks(rem, nbs);
  int first = (blockIdx.x * WARPS + warp) * GROUP;
  if (first >= touched) return;
  int nk = min(GROUP, touched - first);
  const uint8_t* m = message(buf, msg, p.S);
  Raw r[GROUP];
  load_group<FMT>(r, m, first, nk, nbs, lane, p);
  for (;;) {
    const bool more = first < touched - step;  // false unless the grid was capped (decode_ahead)
    const int next = first + (more ? step : 0), nk_next = more ? min(GROUP, touched - next) : 0;
    Raw rn[GROUP];
    if (decode_ahead<FMT>() && more) load_group<FMT>(rn, m, next, nk_next, nbs, lane, p);
    float v[GROUP][E];
    decode_blocks<FMT, ROT, SCALE, GROUP>(r, v, lane, p, smem[warp], dt == TACO_F32);
    const long long i0 = msg * p.L + (long long)first * BLOCK + lane * E;   // this lane's first element
    store_group<GROUP>(out, dt, first + GROUP <= whole, n, i0, nk, lane, v);
    if (!more) break;
    if (decode_ahead<FMT>()) {
      UNROLL for (int k = 0; k < GROUP; k++) r[k] = rn[k];
    } else {
      load_group<FMT>(r, m, next, nk_next, nbs, lane, p);
    }
    first = next;
    nk = nk_next;
    __syncwarp();                              // this group's shared-memory reads are done
  }
}

// acc += r's blocks decoded up to the inverse rotation (v: room for them)
template <int FMT, bool SCALE>
__device__ __forceinline__ void add_decoded(const Raw (&r)[RGROUP], float (&v)[RGROUP][E], float (&acc)[RGROUP][E],
                                            int lane, const TacoParams& p) {
  decode_blocks<FMT, false, SCALE, RGROUP>(r, v, lane, p, nullptr, false);
  UNROLL for (int k = 0; k < RGROUP; k++)
    UNROLL for (int j = 0; j < E; j++) acc[k][j] = acc[k][j] + v[k][j];
}

// The sum is taken in the rotated domain (taco.Codec.reduce_encode): each message decoded up to, not
// through, the inverse rotation, the sum encoded from the absmax scale on. So no Walsh-Hadamard
// transform here, and one kernel per (format, block scale) serves rotated and unrotated codecs. Past
// RED_CTAS_PER_SM CTAs per SM the grid is capped and each warp takes groups of RGROUP blocks in turn, so
// that its setup is paid once for them.
template <int FMT, bool SCALE>
__global__ void __launch_bounds__(32 * WARPS) reduce_encode_kernel(TacoMsgs buf, int P, TacoParams p, uint8_t* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nbs = (int)(p.L / BLOCK), step = gridDim.x * WARPS * RGROUP;
  int first = (blockIdx.x * WARPS + warp) * RGROUP;
  if (first >= nbs) return;
  float acc[RGROUP][E], v[RGROUP][E];
  Raw r[RGROUP];
  for (; first < nbs; first += step) {
    const int nk = min(RGROUP, nbs - first);
    Raw next[RGROUP];
    load_group<FMT, RGROUP, false, false>(r, message(buf, 0, p.S), first, nk, nbs, lane, p);
    if (P > 1)                                // before the math
      load_group<FMT, RGROUP, false, false>(next, message(buf, 1, p.S), first, nk, nbs, lane, p);
    decode_blocks<FMT, false, SCALE, RGROUP>(r, acc, lane, p, nullptr, false);
    for (int i = 1; i < P; i++) {             // fp32 sum in message order 0, 1, ..., P-1
      UNROLL for (int k = 0; k < RGROUP; k++) r[k] = next[k];
      if (i + 1 < P) load_group<FMT, RGROUP, false, false>(next, message(buf, i + 1, p.S), first, nk, nbs, lane, p);
      add_decoded<FMT, SCALE>(r, v, acc, lane, p);
    }
    encode_blocks<FMT, false, SCALE, RGROUP>(acc, nk, lane, p, out, first, nbs, nullptr);
  }
}

// One codec's kernels: encode and decode per (code format, rotation, block scale), reduce-encode per
// (format, block scale), as it never rotates; the adaptive scale and the dtype are branches inside
struct Kernels {
  void (*encode)(const void* x, int dt, long long n, TacoParams p, uint8_t* out);
  void (*decode)(TacoMsgs buf, TacoParams p, void* out, int dt, long long n);
  void (*reduce_encode)(TacoMsgs buf, int P, TacoParams p, uint8_t* out);
  bool decode_ahead;
  int* per_sm;            // encode's CTAs per SM [16-bit input, fp32 input] (resident), asked on first use
};

template <int FMT, bool ROT, bool SCALE>
Kernels kernels_of() {
  static int per_sm[2] = {};
  return {encode_kernel<FMT, ROT, SCALE>, decode_kernel<FMT, ROT, SCALE>, reduce_encode_kernel<FMT, SCALE>,
          decode_ahead<FMT>(), per_sm};
}

// The codecs of taco.CODECS that the kernels cover (taco_ext.supports says the same): rotated
// with a block scale in every format; E4M3 also rotated without a scale (ash), and unrotated with
// (ds) or without (fp8) a block scale. All null: not built.
Kernels kernels(const TacoParams& p) {
  const bool rot = p.rotate, scale = p.scale_block;
  if (p.L / BLOCK >= (1LL << 30)) return {};       // block indices are 32-bit (taco_ext.params refuses it)
  if (p.fmt == TACO_E4M3) {
    if (rot) return scale ? kernels_of<TACO_E4M3, true, true>() : kernels_of<TACO_E4M3, true, false>();
    return scale ? kernels_of<TACO_E4M3, false, true>() : kernels_of<TACO_E4M3, false, false>();
  }
  if (!rot || !scale) return {};
  switch (p.fmt) {
    case TACO_E5M2: return kernels_of<TACO_E5M2, true, true>();
    case TACO_INT8: return kernels_of<TACO_INT8, true, true>();
    case TACO_INT6: return kernels_of<TACO_INT6, true, true>();
    default: return {};
  }
}

}  // namespace

bool taco_encode(const void* x, int xdt, long long n, int M, TacoParams p, uint8_t* out, cudaStream_t st) {
  const Kernels k = kernels(p);
  const bool empty = M == 0 || p.L == 0;
  if (empty || !k.encode) return empty;                             // nothing to do: done; no kernel: refused
  const bool f32 = xdt == TACO_F32;
  const int staged = EW * GROUP * 32 * (f32 ? 32 : 16);                 // bytes of dynamic shared memory
  if (!k.per_sm[f32] && !capturing(st)) k.per_sm[f32] = resident(k.encode, 32 * EW, staged);
  const int cap = 2 * (k.per_sm[f32] ? k.per_sm[f32] : ENC_CTAS);   // ~2 waves
  k.encode<<<dim3(grid(p.L / BLOCK, GROUP, true, cap, M, EW), M), 32 * EW, staged, st>>>(x, xdt, n, p, out);
  return true;
}

bool taco_decode(TacoMsgs buf, int M, TacoParams p, void* out, int odt, long long n, cudaStream_t st) {
  const Kernels k = kernels(p);
  const bool empty = M == 0 || p.L == 0 || n == 0;
  if (empty || !k.decode) return empty;
  k.decode<<<dim3(grid(p.L / BLOCK, GROUP, k.decode_ahead, 8, M), M), 32 * WARPS, 0, st>>>(buf, p, out, odt, n);
  return true;
}

bool taco_reduce_encode(TacoMsgs buf, int P, TacoParams p, uint8_t* out, cudaStream_t st) {
  const Kernels k = kernels(p);
  const bool empty = p.L / BLOCK == 0;
  if (empty || !k.reduce_encode) return empty;
  k.reduce_encode<<<grid(p.L / BLOCK, RGROUP, true, RED_CTAS_PER_SM), 32 * WARPS, 0, st>>>(buf, P, p, out);
  return true;
}
