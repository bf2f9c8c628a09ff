// taco_kernels.h — the interface between taco_kernels.cu (plain CUDA) and its PyTorch callers
// (taco_binding.cpp, taco_symm.cu): only plain C types, so the kernels compile without PyTorch's headers.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

// the code format; taco_binding.cpp exposes it to Python as ext.Fmt, by taco.CodecSpec.fmt's names
enum TacoFmt { TACO_E4M3, TACO_E5M2, TACO_INT8, TACO_INT6 };
enum TacoDType { TACO_F32, TACO_BF16, TACO_F16 };

// A codec's parameters for messages of L elements. taco_binding.cpp exposes it as ext.Params with
// these field names, and taco_ext.params() fills it by name from a taco.Codec.
struct TacoParams {
  TacoFmt fmt;        // the codes
  bool adaptive;      // alpha = tau / rms per block (Eq. 6-7)
  bool rotate;        // Walsh-Hadamard per block (Eq. 8)
  bool scale_block;   // per-block absmax scale (Eq. 9); false = no scale
  int nmeta;          // fp32 metadata words per block: [alpha][s]
  float tau, eps, inv_sqrt_block, qmax;   // 1/sqrt(block) rounded to fp32 (the kernels: a constant)
  long long L;        // elements per message, a multiple of 256
  long long S;        // bytes per message, a multiple of 16
};

// Where message m of a batch starts: base + m * S (one contiguous (M, S) buffer), or, when n_ptr > 0,
// ptr[m]: the messages sit in different buffers, e.g. in the peers' symmetric memory (read over NVLink).
#define TACO_MAX_PEERS 8
struct TacoMsgs {
  const uint8_t* base;
  const uint8_t* ptr[TACO_MAX_PEERS];
  int n_ptr;
};

// Each returns false, launching nothing, for a codec the kernels are not built for.
// x: n elements of dtype xdt; message m encodes x[m*L, (m+1)*L) (zeros past n) into out[m*S, (m+1)*S)
bool taco_encode(const void* x, int xdt, long long n, int M, TacoParams p, uint8_t* out, cudaStream_t st);
// the first n elements of M messages -> out (dtype odt)
bool taco_decode(TacoMsgs buf, int M, TacoParams p, void* out, int odt, long long n, cudaStream_t st);
// decode P messages, sum in fp32 in order 0..P-1, re-encode into one message
bool taco_reduce_encode(TacoMsgs buf, int P, TacoParams p, uint8_t* out, cudaStream_t st);
