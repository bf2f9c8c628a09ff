// taco_kernels.cu — fused TACO codec kernels: compress, decompress, decompress-reduce-compress.
//
// One warp owns one block of B = 256 elements; lane t holds the 8 consecutive elements
// [8t, 8t+8) in registers, so a block is read from memory once and written once:
//
//   load (16 B per lane for bf16) -> [sum of squares -> alpha] -> Walsh-Hadamard (3 in-register
//   butterfly stages + 5 xor-shuffle stages) -> absmax (integer max + warp redux) -> scale
//   -> codes -> 8 B (6 B for INT6) per lane + one lane writes the block's fp32 (alpha, s)
//
// Each warp takes K = 4 consecutive blocks and issues their loads before computing; the grid is
// (blocks per message / (8 warps * K), messages). Measured on H200 (README): 39% of copy bandwidth
// for compress, 50% for decompress, issue-bound (ncu: ~380 warp instructions per block, the
// Hadamard's 40 shuffles the largest share).
//
// The arithmetic is the reference's (taco.py), operation for operation and in the same order:
// fp32 products and sums built without FMA contraction (build with -fmad=false; the one explicit
// FMA multiplies by +-1, which is exact), the sum of squares folded in the reference's order, IEEE
// division and sqrt. That is what makes the codes bit-identical to the PyTorch reference.
//
// Plain CUDA: no PyTorch headers, so an edit here recompiles in a couple of seconds.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "taco_kernels.h"

namespace {

constexpr int B = 256;          // block size the kernels are built for
constexpr int E = 8;            // elements per lane
constexpr int WARPS = 8;        // warps (data blocks) per CTA
constexpr unsigned FULL = 0xffffffffu;
constexpr unsigned CANONICAL_NAN = 0x7fc00000u;   // what torch.tensor(float("nan")) stores

// --- loads and stores of 8 consecutive elements ------------------------------------------------

__device__ __forceinline__ float bits_to_float(unsigned short b, int dt) {
  return dt == TACO_BF16 ? __uint_as_float(((unsigned)b) << 16) : __half2float(__ushort_as_half(b));
}

template <int DT>
__device__ __forceinline__ void load8(const void* x, long long n, long long i0, float v[E]) {
  if (DT == TACO_F32) {
    const float* p = static_cast<const float*>(x) + i0;
    if (i0 + E <= n && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
      for (int j = 0; j < E; j++) v[j] = i0 + j < n ? p[j] : 0.f;
    }
  } else {
    const unsigned short* p = static_cast<const unsigned short*>(x) + i0;
    if (i0 + E <= n && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
      unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int k = 0; k < 4; k++) {
        v[2 * k] = bits_to_float(w[k] & 0xffffu, DT);
        v[2 * k + 1] = bits_to_float(w[k] >> 16, DT);
      }
    } else {
#pragma unroll
      for (int j = 0; j < E; j++) v[j] = i0 + j < n ? bits_to_float(p[j], DT) : 0.f;
    }
  }
}

__device__ __forceinline__ unsigned short float_to_bits(float f, int dt) {
  return dt == TACO_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(f)) : __half_as_ushort(__float2half_rn(f));
}

template <int DT>
__device__ __forceinline__ void store8(void* out, long long n, long long i0, const float v[E]) {
  if (DT == TACO_F32) {
    float* p = static_cast<float*>(out) + i0;
    if (i0 + E <= n && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
#pragma unroll
      for (int j = 0; j < E; j++)
        if (i0 + j < n) p[j] = v[j];
    }
  } else {
    unsigned short* p = static_cast<unsigned short*>(out) + i0;
    if (i0 + E <= n && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      unsigned w[4];
#pragma unroll
      for (int k = 0; k < 4; k++) w[k] = float_to_bits(v[2 * k], DT) | ((unsigned)float_to_bits(v[2 * k + 1], DT) << 16);
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
      for (int j = 0; j < E; j++)
        if (i0 + j < n) p[j] = float_to_bits(v[j], DT);
    }
  }
}

// --- warp-level building blocks ------------------------------------------------------------------

// sum over the warp, folding lanes i and i^16, then ^8, ... (the reference's block_sumsq order)
__device__ __forceinline__ float warp_sum(float a) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) a = a + __shfl_xor_sync(FULL, a, m);
  return a;
}

// unnormalised Walsh-Hadamard over the warp's 256 elements, butterfly strides 1, 2, ..., 128
__device__ __forceinline__ void fwht(float v[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {          // strides 1, 2, 4: inside the lane
#pragma unroll
    for (int j = 0; j < E; j++) {
      if (!(j & h)) {
        float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {         // strides 8 ... 128: lane t pairs with lane t^m
    const float sign = (lane & m) ? -1.f : 1.f;
#pragma unroll
    for (int j = 0; j < E; j++) {
      // lower lane: a + b = p + v;  upper lane: a - b = p - v (a is the lower lane's value).
      // sign * v is exact, so one fused multiply-add rounds exactly like the reference's add/sub.
      float p = __shfl_xor_sync(FULL, v[j], m);
      v[j] = __fmaf_rn(sign, v[j], p);
    }
  }
}

// --- codes ---------------------------------------------------------------------------------------

__device__ __forceinline__ int quant(float y, const TacoParams& p) {   // y finite
  y = fminf(fmaxf(y, -p.qmax), p.qmax);
  switch (p.fmt) {
    case TACO_E4M3: return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
    case TACO_E5M2: return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E5M2);
    default: return __float2int_rn(y);     // round half to even, like torch.round
  }
}

__device__ __forceinline__ float dequant(int code, const TacoParams& p) {
  switch (p.fmt) {
    case TACO_E4M3: return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3)));
    case TACO_E5M2: return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E5M2)));
    case TACO_INT8: return (float)(signed char)code;
    default: return (float)(((code & 63) ^ 32) - 32);   // sign-extend 6 bits
  }
}

__device__ __forceinline__ int payload_bytes(const TacoParams& p) { return p.fmt == TACO_INT6 ? 192 : 256; }

__device__ __forceinline__ void write_codes(uint8_t* blk, int lane, const int q[E], const TacoParams& p) {
  if (p.fmt == TACO_INT6) {                   // 8 codes -> 6 bytes: two groups of w = u0|u1<<6|u2<<12|u3<<18
    unsigned short* dst = reinterpret_cast<unsigned short*>(blk + 6 * lane);
    unsigned w0 = (q[0] & 63) | ((q[1] & 63) << 6) | ((q[2] & 63) << 12) | ((q[3] & 63) << 18);
    unsigned w1 = (q[4] & 63) | ((q[5] & 63) << 6) | ((q[6] & 63) << 12) | ((q[7] & 63) << 18);
    dst[0] = w0 & 0xffff;
    dst[1] = (w0 >> 16) | ((w1 & 0xff) << 8);
    dst[2] = w1 >> 8;
  } else {
    unsigned lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      lo |= (unsigned)(q[j] & 255) << (8 * j);
      hi |= (unsigned)(q[j + 4] & 255) << (8 * j);
    }
    *reinterpret_cast<uint2*>(blk + 8 * lane) = make_uint2(lo, hi);
  }
}

__device__ __forceinline__ void read_codes(const uint8_t* blk, int lane, float v[E], const TacoParams& p) {
  int q[E];
  if (p.fmt == TACO_INT6) {
    const unsigned short* src = reinterpret_cast<const unsigned short*>(blk + 6 * lane);
    unsigned a = src[0], b = src[1], c = src[2];
    unsigned w0 = a | ((b & 0xff) << 16), w1 = (b >> 8) | (c << 8);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      q[j] = (w0 >> (6 * j)) & 63;
      q[j + 4] = (w1 >> (6 * j)) & 63;
    }
  } else {
    uint2 u = *reinterpret_cast<const uint2*>(blk + 8 * lane);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      q[j] = (u.x >> (8 * j)) & 255;
      q[j + 4] = (u.y >> (8 * j)) & 255;
    }
  }
#pragma unroll
  for (int j = 0; j < E; j++) v[j] = dequant(q[j], p);
}

// --- one block, encode and decode (shared by the three kernels) ----------------------------------

// msg: start of this message's bytes; lb: block index in the message; nbs: blocks per message
__device__ __forceinline__ void encode_block(float v[E], int lane, const TacoParams& p, uint8_t* msg,
                                             long long lb, long long nbs) {
  // A block is bad (codes 0, metadata NaN) when it holds NaN/Inf or its arithmetic overflows. We
  // test that where it shows anyway instead of scanning the input: a NaN/Inf input makes the sum
  // of squares non-finite (adaptive codecs) and every rotated value non-finite (Hadamard), and
  // the absmax sees it in any case. Same predicate as the reference's, fewer instructions.
  bool bad = false;
  float alpha = 1.f, s = 1.f;
  // === Eq. 6-7: alpha = tau / sqrt(mean(G^2) + eps) ===
  if (p.adaptive) {
    float ss = v[0] * v[0];
#pragma unroll
    for (int j = 1; j < E; j++) ss = ss + v[j] * v[j];
    ss = warp_sum(ss);
    float sigma = sqrtf(ss * (1.0f / B) + p.eps);
    alpha = p.tau / sigma;
    bad = !isfinite(ss);
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = v[j] * alpha;
  }
  // === Eq. 8: Z = H(alpha G) / sqrt(B) ===
  if (p.rotate) {
    fwht(v, lane);
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = v[j] * p.c;
  }
  // === Eq. 9: s = max|Z| / Qmax ===
  if (p.scale_block) {
    // |v| as integer bits is ordered like |v|, and NaN > Inf > finite: one integer max per value
    // and one warp-wide redux give the absmax and the non-finite test together
    unsigned mb = 0;
#pragma unroll
    for (int j = 0; j < E; j++) mb = max(mb, __float_as_uint(v[j]) & 0x7fffffffu);
    mb = __reduce_max_sync(FULL, mb);
    bad |= mb >= 0x7f800000u;
    s = __uint_as_float(mb) / p.qmax;
    const float inv = 1.f / (s > 0.f ? s : 1.f);      // one IEEE division per block
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = v[j] * inv;
  }
  // === Eq. 10: codes (the raw cast, no scale at all: a NaN code per non-finite element) ===
  const bool raw = !p.adaptive && !p.scale_block;
  int q[E];
#pragma unroll
  for (int j = 0; j < E; j++) {
    if (raw) q[j] = isfinite(v[j]) ? quant(v[j], p) : 0x7f;
    else q[j] = bad ? 0 : quant(v[j], p);
  }
  const int pb = payload_bytes(p);
  write_codes(msg + lb * pb, lane, q, p);
  if (lane == 0) {
    float* meta = reinterpret_cast<float*>(msg + nbs * pb) + lb * p.nmeta;
    const float nan = __uint_as_float(CANONICAL_NAN);
    int k = 0;
    if (p.adaptive) meta[k++] = bad ? nan : alpha;
    if (p.scale_block) meta[k] = bad ? nan : s;
    if (lb == nbs - 1) {                      // zero the message's padding to a multiple of 16 bytes
      for (long long i = nbs * (pb + 4 * p.nmeta); i < p.S; i++) msg[i] = 0;
    }
  }
}

struct BlockMeta { float s, inv_alpha; };

__device__ __forceinline__ const uint8_t* message(const TacoMsgs& m, long long i, long long S) {
  return m.n_ptr ? m.ptr[i] : m.base + i * S;
}

// decode, part 1: the loads (codes and metadata) of one block
__device__ __forceinline__ BlockMeta load_block(const uint8_t* msg, long long lb, long long nbs, int lane,
                                                const TacoParams& p, float v[E]) {
  const int pb = payload_bytes(p);
  read_codes(msg + lb * pb, lane, v, p);
  const float* meta = reinterpret_cast<const float*>(msg + nbs * pb) + lb * p.nmeta;
  BlockMeta bm{1.f, 1.f};
  if (p.scale_block) bm.s = meta[p.nmeta - 1];
  if (p.adaptive) bm.inv_alpha = 1.f / meta[0];
  return bm;
}

// decode, part 2: Z' = q s;  Y' = H(Z') / sqrt(B);  G' = Y' * (1 / alpha)
__device__ __forceinline__ void finish_decode(float v[E], BlockMeta bm, int lane, const TacoParams& p) {
  if (p.scale_block) {
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = v[j] * bm.s;
  }
  if (p.rotate) {
    fwht(v, lane);
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = v[j] * p.c;
  }
  if (p.adaptive) {
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = v[j] * bm.inv_alpha;
  }
}

// --- kernels: each warp takes K consecutive blocks and issues all their loads before computing ----

constexpr int K = 4;

// grid: (blocks of a message / (WARPS * K), messages); blockIdx.y is the message, so no division
template <int DT>
__global__ void __launch_bounds__(32 * WARPS) encode_kernel(const void* x, long long n, TacoParams p, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  const long long nbs = p.L / B, msg = blockIdx.y;
  const long long first = ((long long)blockIdx.x * WARPS + (threadIdx.x >> 5)) * K;
  float v[K][E];
#pragma unroll
  for (int k = 0; k < K; k++)                 // lb is the same for the whole warp: no divergence
    if (first + k < nbs) load8<DT>(x, n, msg * p.L + (first + k) * B + lane * E, v[k]);
#pragma unroll
  for (int k = 0; k < K; k++)
    if (first + k < nbs) encode_block(v[k], lane, p, out + msg * p.S, first + k, nbs);
}

template <int DT>
__global__ void __launch_bounds__(32 * WARPS) decode_kernel(TacoMsgs buf, TacoParams p, void* out, long long n) {
  const int lane = threadIdx.x & 31;
  const long long nbs = p.L / B, msg = blockIdx.y;
  const long long first = ((long long)blockIdx.x * WARPS + (threadIdx.x >> 5)) * K;
  float v[K][E];
  BlockMeta bm[K];
#pragma unroll
  for (int k = 0; k < K; k++)                 // skip blocks wholly past n
    if (first + k < nbs && msg * p.L + (first + k) * B < n)
      bm[k] = load_block(message(buf, msg, p.S), first + k, nbs, lane, p, v[k]);
#pragma unroll
  for (int k = 0; k < K; k++) {
    const long long i0 = msg * p.L + (first + k) * B;
    if (first + k < nbs && i0 < n) {
      finish_decode(v[k], bm[k], lane, p);
      store8<DT>(out, n, i0 + lane * E, v[k]);
    }
  }
}

__global__ void __launch_bounds__(32 * WARPS) reduce_encode_kernel(TacoMsgs buf, int P, TacoParams p,
                                                                   uint8_t* out) {
  const int lane = threadIdx.x & 31;
  const long long nbs = p.L / B;
  const long long lb = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (lb >= nbs) return;
  float acc[E], v[E];
  finish_decode(acc, load_block(message(buf, 0, p.S), lb, nbs, lane, p, acc), lane, p);
  for (int r = 1; r < P; r++) {               // fp32 sum in rank order 0, 1, ..., P-1
    finish_decode(v, load_block(message(buf, r, p.S), lb, nbs, lane, p, v), lane, p);
#pragma unroll
    for (int j = 0; j < E; j++) acc[j] = acc[j] + v[j];
  }
  encode_block(acc, lane, p, out, lb, nbs);
}

unsigned grid_for(long long blocks, int per_warp) {
  return (unsigned)((blocks + WARPS * per_warp - 1) / (WARPS * per_warp));
}

}  // namespace

void taco_encode(const void* x, int xdt, long long n, int M, TacoParams p, uint8_t* out, cudaStream_t st) {
  if (M == 0 || p.L == 0) return;
  const dim3 grid(grid_for(p.L / B, K), M);
  if (xdt == TACO_F32) encode_kernel<TACO_F32><<<grid, 32 * WARPS, 0, st>>>(x, n, p, out);
  else if (xdt == TACO_BF16) encode_kernel<TACO_BF16><<<grid, 32 * WARPS, 0, st>>>(x, n, p, out);
  else encode_kernel<TACO_F16><<<grid, 32 * WARPS, 0, st>>>(x, n, p, out);
}

void taco_decode(TacoMsgs buf, int M, TacoParams p, void* out, int odt, long long n, cudaStream_t st) {
  if (M == 0 || p.L == 0 || n == 0) return;
  const dim3 grid(grid_for(p.L / B, K), M);
  if (odt == TACO_F32) decode_kernel<TACO_F32><<<grid, 32 * WARPS, 0, st>>>(buf, p, out, n);
  else if (odt == TACO_BF16) decode_kernel<TACO_BF16><<<grid, 32 * WARPS, 0, st>>>(buf, p, out, n);
  else decode_kernel<TACO_F16><<<grid, 32 * WARPS, 0, st>>>(buf, p, out, n);
}

void taco_reduce_encode(TacoMsgs buf, int P, TacoParams p, uint8_t* out, cudaStream_t st) {
  const long long blocks = p.L / B;
  if (blocks == 0) return;
  reduce_encode_kernel<<<grid_for(blocks, 1), 32 * WARPS, 0, st>>>(buf, P, p, out);
}
