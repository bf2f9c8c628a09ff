// taco_binding.cpp — the only file that includes PyTorch's headers (slow to compile, rarely
// changes): unpacks tensors into pointers and launches taco_kernels.cu on the current stream.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "taco_kernels.h"

namespace {

// ip = [fmt, adaptive, rotate, scale_block, nmeta, L, S], fp = [tau, eps, c, qmax]
TacoParams params(const std::vector<int64_t>& ip, const std::vector<double>& fp) {
  TORCH_CHECK(ip.size() == 7 && fp.size() == 4, "taco: bad codec parameters");
  return TacoParams{(int)ip[0], (int)ip[1], (int)ip[2], (int)ip[3], (int)ip[4],
                    (float)fp[0], (float)fp[1], (float)fp[2], (float)fp[3], ip[5], ip[6]};
}

int dtype_code(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat32) return TACO_F32;
  if (t.scalar_type() == torch::kBFloat16) return TACO_BF16;
  TORCH_CHECK(t.scalar_type() == torch::kFloat16, "taco kernels take float32, bfloat16 or float16, got ",
              t.scalar_type());
  return TACO_F16;
}

void check(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "taco: ", what, " must be a contiguous CUDA tensor");
}

torch::Tensor encode(torch::Tensor x, int64_t M, std::vector<int64_t> ip, std::vector<double> fp) {
  check(x, "input");
  const c10::cuda::CUDAGuard guard(x.device());
  TacoParams p = params(ip, fp);
  auto out = torch::empty({M, p.S}, x.options().dtype(torch::kUInt8));
  taco_encode(x.data_ptr(), dtype_code(x), x.numel(), (int)M, p, out.data_ptr<uint8_t>(),
              c10::cuda::getCurrentCUDAStream());
  return out;
}

torch::Tensor decode(torch::Tensor buf, torch::Tensor out, std::vector<int64_t> ip, std::vector<double> fp) {
  check(buf, "buffer");
  check(out, "output");
  const c10::cuda::CUDAGuard guard(buf.device());
  taco_decode(buf.data_ptr<uint8_t>(), (int)buf.size(0), params(ip, fp), out.data_ptr(), dtype_code(out),
              out.numel(), c10::cuda::getCurrentCUDAStream());
  return out;
}

torch::Tensor reduce_encode(torch::Tensor buf, std::vector<int64_t> ip, std::vector<double> fp) {
  check(buf, "buffer");
  const c10::cuda::CUDAGuard guard(buf.device());
  TacoParams p = params(ip, fp);
  auto out = torch::empty({p.S}, buf.options());
  taco_reduce_encode(buf.data_ptr<uint8_t>(), (int)buf.size(0), p, out.data_ptr<uint8_t>(),
                     c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode", &encode, "fused compress of M messages");
  m.def("decode", &decode, "fused decompress into out");
  m.def("reduce_encode", &reduce_encode, "fused decompress-reduce-compress");
}
