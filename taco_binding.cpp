// taco_binding.cpp — the only file that includes PyTorch's headers (slow to compile, rarely
// changes): unpacks tensors into pointers and launches taco_kernels.cu on the current stream.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "taco_kernels.h"

namespace {

constexpr const char* UNSUPPORTED = "taco: no kernel for this codec (taco.kernels_support says which)";

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

TacoMsgs contiguous(const torch::Tensor& buf) {
  check(buf, "buffer");
  return TacoMsgs{buf.data_ptr<uint8_t>(), {}, 0};
}

// message m at address ptrs[m]: buffers in the peers' symmetric memory (the caller keeps them alive)
TacoMsgs scattered(const std::vector<int64_t>& ptrs) {
  TORCH_CHECK(!ptrs.empty() && ptrs.size() <= TACO_MAX_PEERS, "taco: 1 to ", TACO_MAX_PEERS, " message pointers");
  TacoMsgs m{nullptr, {}, (int)ptrs.size()};
  for (size_t i = 0; i < ptrs.size(); i++) m.ptr[i] = reinterpret_cast<const uint8_t*>(ptrs[i]);
  return m;
}

torch::Tensor encode(torch::Tensor x, int64_t M, std::vector<int64_t> ip, std::vector<double> fp,
                     c10::optional<torch::Tensor> into) {
  check(x, "input");
  const c10::cuda::CUDAGuard guard(x.device());
  TacoParams p = params(ip, fp);
  torch::Tensor out;
  if (into) {                                   // e.g. this rank's symmetric-memory buffer
    out = *into;
    check(out, "output");
    TORCH_CHECK(out.scalar_type() == torch::kUInt8 && out.numel() == M * p.S, "taco: encode output must be ",
                M * p.S, " bytes");
  } else {
    out = torch::empty({M, p.S}, x.options().dtype(torch::kUInt8));
  }
  TORCH_CHECK(taco_encode(x.data_ptr(), dtype_code(x), x.numel(), (int)M, p, out.data_ptr<uint8_t>(),
                          c10::cuda::getCurrentCUDAStream()), UNSUPPORTED);
  return out;
}

torch::Tensor decode(TacoMsgs msgs, int64_t M, torch::Tensor out, std::vector<int64_t> ip, std::vector<double> fp) {
  check(out, "output");
  const c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(taco_decode(msgs, (int)M, params(ip, fp), out.data_ptr(), dtype_code(out), out.numel(),
                          c10::cuda::getCurrentCUDAStream()), UNSUPPORTED);
  return out;
}

torch::Tensor reduce_encode(TacoMsgs msgs, int64_t P, torch::Tensor out, std::vector<int64_t> ip,
                            std::vector<double> fp) {
  check(out, "output");
  const c10::cuda::CUDAGuard guard(out.device());
  TacoParams p = params(ip, fp);
  TORCH_CHECK(out.scalar_type() == torch::kUInt8 && out.numel() == p.S, "taco: reduce_encode output must be ",
              p.S, " bytes");
  TORCH_CHECK(taco_reduce_encode(msgs, (int)P, p, out.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream()),
              UNSUPPORTED);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode", &encode, "fused compress of M messages (into a given (M*S)-byte buffer, or a new one)",
        py::arg("x"), py::arg("M"), py::arg("ip"), py::arg("fp"), py::arg("into") = py::none());
  m.def("decode", [](torch::Tensor buf, torch::Tensor out, std::vector<int64_t> ip, std::vector<double> fp) {
    return decode(contiguous(buf), buf.size(0), out, ip, fp);
  }, "fused decompress of an (M, S) buffer into out");
  m.def("decode_peers", [](std::vector<int64_t> ptrs, torch::Tensor out, std::vector<int64_t> ip,
                           std::vector<double> fp) { return decode(scattered(ptrs), ptrs.size(), out, ip, fp); },
        "fused decompress of messages at the given device addresses into out");
  m.def("reduce_encode", [](torch::Tensor buf, std::vector<int64_t> ip, std::vector<double> fp) {
    auto out = torch::empty({params(ip, fp).S}, buf.options());
    return reduce_encode(contiguous(buf), buf.size(0), out, ip, fp);
  }, "fused decompress-reduce-compress of a (P, S) buffer");
  m.def("reduce_encode_peers", [](std::vector<int64_t> ptrs, torch::Tensor out, std::vector<int64_t> ip,
                                  std::vector<double> fp) {
    return reduce_encode(scattered(ptrs), ptrs.size(), out, ip, fp);
  }, "fused decompress-reduce-compress of messages at the given device addresses, into out");
}
