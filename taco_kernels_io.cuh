// taco_kernels_io.cuh — how bytes move, for taco_kernels.cu: loads of 8 consecutive elements, encode's
// input staged through shared memory (cp.async), conversions, stores, and the host's questions (grid,
// occupancy, CUDA-graph capture). It stands alone: it includes what it uses and owns the constants of the
// work split that both files read; the dtype of a call is a warp-uniform branch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "taco_kernels.h"

#define UNROLL _Pragma("unroll")   // unroll the loop that follows on the same line

namespace {

constexpr int BLOCK = 256;             // elements per codec block: the block size the kernels are built for
constexpr int E = 8;                   // elements per lane (BLOCK / 32)
constexpr int GROUP = 4;               // blocks per warp in encode / decode (a group)
constexpr int WARPS = 8;               // warps per CTA (decode, reduce-encode)
constexpr unsigned FULL = 0xffffffffu; // every lane of a warp

// 8 consecutive 16-bit elements as raw bits (zeros past n), and their values
__device__ __forceinline__ uint4 fetch16(const void* x, long long n, long long i0) {
  const unsigned short* p = static_cast<const unsigned short*>(x) + i0;
  if (i0 + E <= n && (reinterpret_cast<uintptr_t>(p) & 15) == 0) return __ldg(reinterpret_cast<const uint4*>(p));
  unsigned w[4];
  UNROLL for (int k = 0; k < 4; k++) {
    const unsigned lo = i0 + 2 * k < n ? p[2 * k] : 0u, hi = i0 + 2 * k + 1 < n ? p[2 * k + 1] : 0u;
    w[k] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void unpack16(uint4 u, int dt, float v[E]) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
  UNROLL for (int k = 0; k < 4; k++) {
    if (dt == TACO_BF16) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    } else {
      float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  }
}

template <int N>
__device__ __forceinline__ void unpack_group(const uint4 (&u)[N], int dt, float (&v)[N][E]) {
  if (dt == TACO_BF16) {
    UNROLL for (int k = 0; k < N; k++) unpack16(u[k], TACO_BF16, v[k]);
  } else {
    UNROLL for (int k = 0; k < N; k++) unpack16(u[k], TACO_F16, v[k]);
  }
}

__device__ __forceinline__ void load8(const void* x, int dt, long long n, long long i0, float v[E]) {
  if (dt != TACO_F32) return unpack16(fetch16(x, n, i0), dt, v);
  const float* p = static_cast<const float*>(x) + i0;
  if (i0 + E <= n && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    UNROLL for (int j = 0; j < E; j++) v[j] = i0 + j < n ? p[j] : 0.f;
  }
}

// Encode's input, copied into shared memory while the group before computes (cp.async: no registers
// held, not through L1), from a 16-byte aligned x and whole blocks. Slots of 16 bytes, per warp and
// block 32 (16-bit input: lane t copies the 16 bytes it will read, its 8 elements) or 64 (fp32: chunk
// c of the block by lane c % 32, so that each copy instruction covers 512 contiguous bytes, into slot
// c ^ ((c >> 3) & 1), so that a lane's reads of chunks 2t, 2t + 1 meet no bank conflict). `after`: a
// zero computed from the values this warp last read from the slots: no copy is issued before those
// reads have returned.
__device__ __forceinline__ int f32_slot(int c) { return c ^ ((c >> 3) & 1); }

template <bool F32>
__device__ __forceinline__ void stage_group(uint4* st, int lane, unsigned after, const void* x, long long g0) {
  const unsigned dst = (unsigned)__cvta_generic_to_shared(st) + after;
  UNROLL for (int k = 0; k < GROUP; k++) {
    UNROLL for (int r = 0; r < (F32 ? 2 : 1); r++) {
      const int c = lane + 32 * r;
      const long long e = g0 + k * BLOCK + (F32 ? 4 : 8) * c;                 // the chunk's first element
      const char* src = static_cast<const char*>(x) + (F32 ? 4 : 2) * e;
      const int slot = F32 ? k * 64 + f32_slot(c) : k * 32 + c;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 16 * slot), "l"(src) : "memory");
    }
  }
}

// the staged group's values, layout io; returns `after`
__device__ __forceinline__ unsigned unstage_group(const uint4* st, int lane, int dt, float (&v)[GROUP][E]) {
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncwarp();                                  // fp32: the chunks other lanes copied
  unsigned after = 0u;
  if (dt == TACO_F32) {
    UNROLL for (int k = 0; k < GROUP; k++) {
      const uint4 a = st[k * 64 + f32_slot(2 * lane)], b = st[k * 64 + f32_slot(2 * lane + 1)];
      const unsigned w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      UNROLL for (int j = 0; j < E; j++) v[k][j] = __uint_as_float(w[j]);
      after |= a.x | b.x;
    }
  } else {
    uint4 u[GROUP];
    UNROLL for (int k = 0; k < GROUP; k++) {
      u[k] = st[k * 32 + lane];
      after |= u[k].x;
    }
    unpack_group<GROUP>(u, dt, v);
  }
  return after & (unsigned)(dt >> 2);            // dt < 4: a zero the compiler cannot see
}

// --- conversions and stores ----------------------------------------------------------------------

// round to nearest even, a low; saturating: a value past the type's largest, Inf included, becomes
// it, NaN stays NaN (the reference clamps to the largest finite value before its cast)
__device__ __forceinline__ unsigned pack2(float a, float b, int dt) {
  unsigned d;
  if (dt == TACO_BF16) asm("cvt.rn.satfinite.bf16x2.f32 %0, %2, %1;" : "=r"(d) : "f"(a), "f"(b));
  else asm("cvt.rn.satfinite.f16x2.f32 %0, %2, %1;" : "=r"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ float saturate(float v) {     // to fp32's largest finite value; NaN stays NaN
  float d;
  asm("max.NaN.f32 %0, %1, 0fFF7FFFFF;\n\tmin.NaN.f32 %0, %0, 0f7F7FFFFF;" : "=f"(d) : "f"(v));
  return d;
}

// 8 values to out's elements i0 .. i0 + 7, those below n
__device__ __forceinline__ void store8(void* out, int dt, long long n, long long i0, const float v[E]) {
  if (dt == TACO_F32) {
    float* p = static_cast<float*>(out) + i0;
    if (i0 + E <= n && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      UNROLL for (int j = 0; j < E; j++)
        if (i0 + j < n) p[j] = v[j];
    }
  } else {
    unsigned w[4];
    UNROLL for (int k = 0; k < 4; k++) w[k] = pack2(v[2 * k], v[2 * k + 1], dt);
    unsigned short* p = static_cast<unsigned short*>(out) + i0;
    if (i0 + E <= n && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      UNROLL for (int j = 0; j < E; j++)
        if (i0 + j < n) p[j] = (unsigned short)(w[j / 2] >> (16 * (j & 1)));
    }
  }
}

__device__ __forceinline__ uint4 pick(bool c, uint4 a, uint4 b) { return c ? a : b; }

__device__ __forceinline__ void st16(void* p, uint4 v) { *static_cast<uint4*>(p) = v; }   // one 16-byte store

// N blocks' values from this lane's element i0 on, nk of them real; whole: the group lies inside the
// tensor and out is 16-byte aligned (the caller's one test per group, see whole_blocks): stores from one
// address
template <int N>
__device__ __forceinline__ void store_group(void* out, int dt, bool whole, long long n, long long i0, int nk,
                                            int lane, const float (&v)[N][E]) {
  if (!whole) {
    UNROLL for (int k = 0; k < N; k++)
      if (k < nk) store8(out, dt, n, i0 + k * BLOCK, v[k]);
  } else if (dt == TACO_F32) {
    // A lane's 8 values fill one 32-byte sector, but a store moves 16 bytes per lane: lanes 2i and 2i + 1
    // swap halves first, so that each store writes whole sectors (the even lane's, then the odd's).
    const bool odd = lane & 1;
    float* p = static_cast<float*>(out) + i0 - 4 * odd;
    UNROLL for (int k = 0; k < N; k++) {
      const uint4 lo = make_uint4(__float_as_uint(v[k][0]), __float_as_uint(v[k][1]), __float_as_uint(v[k][2]),
                                  __float_as_uint(v[k][3]));
      const uint4 hi = make_uint4(__float_as_uint(v[k][4]), __float_as_uint(v[k][5]), __float_as_uint(v[k][6]),
                                  __float_as_uint(v[k][7]));
      const uint4 s = pick(odd, lo, hi);             // the even lane sends its high half, the odd its low
      const uint4 r = make_uint4(__shfl_xor_sync(FULL, s.x, 1), __shfl_xor_sync(FULL, s.y, 1),
                                 __shfl_xor_sync(FULL, s.z, 1), __shfl_xor_sync(FULL, s.w, 1));
      st16(p + k * BLOCK, pick(odd, r, lo));
      st16(p + k * BLOCK + E, pick(odd, hi, r));
    }
  } else {
    uint4* p = reinterpret_cast<uint4*>(static_cast<unsigned short*>(out) + i0);
    UNROLL for (int k = 0; k < N; k++)
      p[k * (BLOCK / 8)] = make_uint4(pack2(v[k][0], v[k][1], dt), pack2(v[k][2], v[k][3], dt),
                                  pack2(v[k][4], v[k][5], dt), pack2(v[k][6], v[k][7], dt));
  }
}

// --- the host's questions ---------------------------------------------------------------------------

// CTAs of `warps` warps for `blocks` blocks in groups of per_warp per warp: one group per warp, or, when
// the warps loop over groups, at most per_sm CTAs per SM over the M messages (~2 waves for encode and
// decode, ~4 for reduce-encode)
unsigned grid(long long blocks, int per_warp, bool loop, long long per_sm, int M = 1, int warps = WARPS) {
  const long long all = (blocks + warps * per_warp - 1) / (warps * per_warp);
  if (!loop) return (unsigned)all;
  static int sms[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 64 && !sms[dev]) cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev);
  return (unsigned)max(1LL, min(all, (dev < 64 && sms[dev] ? sms[dev] : 132) * per_sm / M));
}

// CTAs of `kernel` an SM holds at once, with `smem` bytes of dynamic shared memory: the grid caps are
// multiples of it, so that no wave runs part-empty. Asked once, outside a CUDA-graph capture (see
// capturing); the grid does not change the results.
template <typename Kernel>
int resident(Kernel kernel, int threads, int smem) {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
  return n > 0 ? n : 1;
}

// Whether st is being captured into a CUDA graph: then the launches ask the driver nothing (occupancy,
// attributes) and take defaults until a launch outside a capture has asked.
bool capturing(cudaStream_t st) {
  cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(st, &s) != cudaSuccess || s != cudaStreamCaptureStatusNone;
}

}  // namespace
