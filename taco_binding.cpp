// taco_binding.cpp — the kernels' PyTorch side (its headers are slow to compile and rarely change,
// so taco_kernels.cu does without them): unpacks tensors into pointers and launches the kernels on
// the current stream. The symmetric-memory transport's own functions are in taco_symm.cu.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "taco_binding.h"

namespace taco_binding {       // also called by taco_symm.cu

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

torch::Tensor encode(torch::Tensor x, int64_t M, const TacoParams& p, c10::optional<torch::Tensor> into) {
  check(x, "input");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor out = into ? *into : torch::empty({M, p.S}, x.options().dtype(torch::kUInt8));
  check(out, "output");
  TORCH_CHECK(out.scalar_type() == torch::kUInt8 && out.numel() == M * p.S, "taco: encode output must be ", M * p.S,
              " bytes");
  TORCH_CHECK(taco_encode(x.data_ptr(), dtype_code(x), x.numel(), (int)M, p, out.data_ptr<uint8_t>(),
                          c10::cuda::getCurrentCUDAStream()), UNSUPPORTED);
  C10_CUDA_KERNEL_LAUNCH_CHECK();               // a refused launch raises: no stale bytes
  return out;
}

torch::Tensor decode(TacoMsgs msgs, int64_t M, torch::Tensor out, const TacoParams& p) {
  check(out, "output");
  const c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(taco_decode(msgs, (int)M, p, out.data_ptr(), dtype_code(out), out.numel(),
                          c10::cuda::getCurrentCUDAStream()), UNSUPPORTED);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor reduce_encode(TacoMsgs msgs, int64_t P, torch::Tensor out, const TacoParams& p) {
  check(out, "output");
  const c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(out.scalar_type() == torch::kUInt8 && out.numel() == p.S, "taco: reduce_encode output must be ",
              p.S, " bytes");
  TORCH_CHECK(taco_reduce_encode(msgs, (int)P, p, out.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream()),
              UNSUPPORTED);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace taco_binding

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace taco_binding;
  py::enum_<TacoFmt>(m, "Fmt")
      .value("e4m3", TACO_E4M3).value("e5m2", TACO_E5M2).value("int8", TACO_INT8).value("int6", TACO_INT6);
#define FIELD(name) .def_readwrite(#name, &TacoParams::name)        // the same name on both sides
  py::class_<TacoParams>(m, "Params").def(py::init<>()) FIELD(fmt) FIELD(adaptive) FIELD(rotate) FIELD(scale_block)
      FIELD(nmeta) FIELD(tau) FIELD(eps) FIELD(inv_sqrt_block) FIELD(qmax) FIELD(L) FIELD(S);
#undef FIELD
  m.def("encode", &encode, "fused compress of M messages (into a given (M*S)-byte buffer, or a new one)",
        py::arg("x"), py::arg("M"), py::arg("p"), py::arg("into") = py::none());
  m.def("decode", [](torch::Tensor buf, torch::Tensor out, const TacoParams& p) {
    return decode(contiguous(buf), buf.size(0), out, p);
  }, "fused decompress of an (M, S) buffer into out");
  m.def("reduce_encode", [](torch::Tensor buf, const TacoParams& p) {
    auto out = torch::empty({p.S}, buf.options());
    return reduce_encode(contiguous(buf), buf.size(0), out, p);
  }, "fused decompress-reduce-compress of a (P, S) buffer");
  bind_symm(m);
}
