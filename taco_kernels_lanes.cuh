// taco_kernels_lanes.cuh — how a warp holds a block, for taco_kernels.cu: the Walsh-Hadamard transform's
// butterflies inside a lane and its layout changes through shared memory, and the warp's reductions (absmax, the
// sum of squares in the reference's order, one lane's per-block scalars for all). It stands alone beside
// taco_kernels_io.cuh (BLOCK, E, FULL, UNROLL come from there).
//
// Where each lane keeps its 8 elements of a block (an element's index in the block is b7..b0):
//   layout io:   lane = b7..b3,          register = b2 b1 b0   (8 consecutive elements: the tensor's I/O)
//   layout mid:  lane = b7 b6 | b2 b1 b0, register = b5 b4 b3
//   layout wire: lane = b4..b0,          register = b7 b6 b5   (a rotated block's codes: the wire's order)
// The Walsh-Hadamard butterflies run in the reference's orders, every one between two registers of
// one lane: encode io -> wire, strides 1, 2, 4 in io, 8, 16, 32 in mid, 64, 128 in wire; decode wire -> io,
// strides 128, 64, 32 in wire, 16, 8 in mid, 4, 2, 1 in io. The layouts change through a per-block shared-memory
// buffer, padded so that no access has a bank conflict. A rotated block's codes are stored in layout
// wire's order (taco.lane_order: lane u's 8 codes side by side), so encode ends and decode starts there
// with no third trip through shared memory.
#pragma once
#include "taco_kernels_io.cuh"

namespace {

constexpr int SMW = BLOCK + BLOCK / 8;   // shared words per block: 4 padding words after every 32
constexpr int MID_STRIDE = 64 + 64 / 8;  // shared words from one 64-element row of a block to the next (with padding)

// --- the Walsh-Hadamard transform: butterflies inside a lane, layout changes through shared memory -

// the butterflies whose partners differ in register bit BIT: (a, b) -> (a + b, a - b)
template <int BIT>
__device__ __forceinline__ void butterflies(float v[E]) {
  UNROLL for (int j = 0; j < E; j++) {
    if (!(j & BIT)) {
      float a = v[j], b = v[j + BIT];
      v[j] = a + b;
      v[j + BIT] = a - b;
    }
  }
}

// Shared word of layout-io element j of lane t: 8t + j plus 4 padding words per 32 (= 4 (t >> 2)).
// Two 16-byte stores per lane; with the padding, each 8-lane phase covers the 32 banks once.
__device__ __forceinline__ float* io_slot(float* sm, int lane) { return sm + 8 * lane + 4 * (lane >> 2); }

__device__ __forceinline__ void put_io(const float v[E], float* sm, int lane) {
  float4* w = reinterpret_cast<float4*>(io_slot(sm, lane));
  w[0] = make_float4(v[0], v[1], v[2], v[3]);
  w[1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ void get_io(float v[E], const float* sm, int lane) {
  const float4* w = reinterpret_cast<const float4*>(io_slot(const_cast<float*>(sm), lane));
  float4 a = w[0], b = w[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// layout mid from layout io in shared memory: lane t reads idx = (t >> 3) * 64 + 8 j + (t & 7);
// padded word idx + 4 (idx >> 5): one bank per lane for every j
__device__ __forceinline__ void get_mid(float v[E], const float* sm, int lane) {
  const float* p = sm + (lane >> 3) * MID_STRIDE + (lane & 7);
  UNROLL for (int j = 0; j < E; j++) v[j] = p[8 * j + 4 * (j >> 2)];
}

// layout mid -> shared memory, lane-major with the registers in the order 0 4 1 5 2 6 3 7, so that
// the two elements a layout-wire lane needs from one mid lane (b5 = 0, 1) sit side by side
__device__ __forceinline__ void put_mid(const float v[E], float* sm, int lane) {
  float4* w = reinterpret_cast<float4*>(io_slot(sm, lane));
  w[0] = make_float4(v[0], v[4], v[1], v[5]);
  w[1] = make_float4(v[2], v[6], v[3], v[7]);
}

// layout wire: lane u, register m <- idx = u + 32 m, held by mid lane (u & 7) + 8 (m >> 1) in
// slot 2 (u >> 3) + (m & 1): one 8-byte load per pair of registers
__device__ __forceinline__ void get_wire(float v[E], const float* sm, int lane) {
  const float* p = sm + 8 * (lane & 7) + 4 * ((lane & 7) >> 2) + 2 * (lane >> 3);
  UNROLL for (int k = 0; k < 4; k++) {
    float2 f = *reinterpret_cast<const float2*>(p + MID_STRIDE * k);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
}

// decode runs the two layout changes backwards: each "unget" stores to the words its "get" loads,
// each "unput" loads the words its "put" stored (the same bank pattern, so no conflicts either)
__device__ __forceinline__ void unget_wire(const float v[E], float* sm, int lane) {
  float* p = sm + 8 * (lane & 7) + 4 * ((lane & 7) >> 2) + 2 * (lane >> 3);
  UNROLL for (int k = 0; k < 4; k++)
    *reinterpret_cast<float2*>(p + MID_STRIDE * k) = make_float2(v[2 * k], v[2 * k + 1]);
}

__device__ __forceinline__ void unput_mid(float v[E], const float* sm, int lane) {
  const float4* w = reinterpret_cast<const float4*>(io_slot(const_cast<float*>(sm), lane));
  float4 a = w[0], b = w[1];
  v[0] = a.x; v[4] = a.y; v[1] = a.z; v[5] = a.w; v[2] = b.x; v[6] = b.y; v[3] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void unget_mid(const float v[E], float* sm, int lane) {
  float* p = sm + (lane >> 3) * MID_STRIDE + (lane & 7);
  UNROLL for (int j = 0; j < E; j++) p[8 * j + 4 * (j >> 2)] = v[j];
}

// H (unnormalised) of the N blocks in v, layout io in, layout wire out. sm: N buffers of SMW words.
template <int N>
__device__ __forceinline__ void fwht_io_to_wire(float (&v)[N][E], float (*sm)[SMW], int lane) {
  UNROLL for (int k = 0; k < N; k++) {
    butterflies<1>(v[k]); butterflies<2>(v[k]); butterflies<4>(v[k]);   // strides 1, 2, 4
    put_io(v[k], sm[k], lane);
  }
  __syncwarp();
  UNROLL for (int k = 0; k < N; k++) {
    get_mid(v[k], sm[k], lane);
    butterflies<1>(v[k]); butterflies<2>(v[k]); butterflies<4>(v[k]);   // strides 8, 16, 32
  }
  __syncwarp();                                                         // all reads of io's words done
  UNROLL for (int k = 0; k < N; k++) put_mid(v[k], sm[k], lane);
  __syncwarp();
  UNROLL for (int k = 0; k < N; k++) {
    get_wire(v[k], sm[k], lane);
    butterflies<2>(v[k]); butterflies<4>(v[k]);                         // strides 64, 128
  }
}

// H of the N blocks in v in the decode order, layout wire in, layout io out
template <int N>
__device__ __forceinline__ void fwht_wire_to_io(float (&v)[N][E], float (*sm)[SMW], int lane) {
  UNROLL for (int k = 0; k < N; k++) {
    butterflies<4>(v[k]); butterflies<2>(v[k]); butterflies<1>(v[k]);   // strides 128, 64, 32
    unget_wire(v[k], sm[k], lane);
  }
  __syncwarp();
  UNROLL for (int k = 0; k < N; k++) {
    unput_mid(v[k], sm[k], lane);
    butterflies<2>(v[k]); butterflies<1>(v[k]);                         // strides 16, 8
  }
  __syncwarp();                                                         // all reads of wire's words done
  UNROLL for (int k = 0; k < N; k++) unget_mid(v[k], sm[k], lane);
  __syncwarp();
  UNROLL for (int k = 0; k < N; k++) {
    get_io(v[k], sm[k], lane);
    butterflies<4>(v[k]); butterflies<2>(v[k]); butterflies<1>(v[k]);   // strides 4, 2, 1
  }
}

// --- warp reductions ------------------------------------------------------------------------------

__device__ __forceinline__ float max_nan(float a, float b) {   // NaN-propagating, like torch.amax
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// max |v| over the block as bits: NaN > Inf > finite in integer order, so one test finds both
__device__ __forceinline__ unsigned absmax_bits(const float v[E]) {
  float m01 = max_nan(fabsf(v[0]), fabsf(v[1])), m23 = max_nan(fabsf(v[2]), fabsf(v[3]));
  float m45 = max_nan(fabsf(v[4]), fabsf(v[5])), m67 = max_nan(fabsf(v[6]), fabsf(v[7]));
  float m = max_nan(max_nan(m01, m23), max_nan(m45, m67));
  return __reduce_max_sync(FULL, __float_as_uint(m));
}

// The sums over the warp of each lane's x[k], folded in the reference's order (lane i adds lane
// i ^ 16, then i ^ 8, ...), N blocks at once: at each of the first log2(N) steps a lane keeps the half
// of its blocks whose index bit matches its lane bit and adds its partner's copies, sending the other
// half, so N - 1 + 5 - log2(N) shuffles in all instead of 5 N. Returns the sum of block
// lane / (32 / N), as every lane holding it has it.
template <int N>
__device__ __forceinline__ float block_sums(const float (&x)[N], int lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N: a power of two");
  float t[N];
  UNROLL for (int k = 0; k < N; k++) t[k] = x[k];
  UNROLL for (int m = 16, c = N; m >= 1; m >>= 1, c = c > 1 ? c / 2 : 1) {
    if (c > 1) {
      const bool up = lane & m;
      UNROLL for (int i = 0; i < c / 2; i++) {
        const float keep = up ? t[i + c / 2] : t[i], send = up ? t[i] : t[i + c / 2];
        t[i] = keep + __shfl_xor_sync(FULL, send, m);
      }
    } else {
      t[0] = t[0] + __shfl_xor_sync(FULL, t[0], m);
    }
  }
  return t[0];
}

// Per-block scalars (alpha, s, 1/s: IEEE sqrt and divisions, a dozen instructions each) are
// computed once per block, not by all 32 lanes: lane k takes block k's, then a shuffle per block
// gives every lane the values.
template <int N>
__device__ __forceinline__ float lane_pick(const float (&x)[N], int lane) {   // lane k < N: x[k]
  float r = x[0];
  UNROLL for (int k = 1; k < N; k++) r = lane == k ? x[k] : r;
  return r;
}

template <int N>
__device__ __forceinline__ void lane_spread(float mine, float (&x)[N]) {      // x[k] = lane k's value
  UNROLL for (int k = 0; k < N; k++) x[k] = __shfl_sync(FULL, mine, k);
}

}  // namespace
