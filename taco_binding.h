// taco_binding.h — taco_binding.cpp's launchers (each checks its tensors), which taco_symm.cu calls too.
#pragma once
#include <torch/extension.h>
#include "taco_kernels.h"

namespace taco_binding {
constexpr const char* UNSUPPORTED = "taco: no kernel for this codec (taco_ext.supports says which)";
int dtype_code(const torch::Tensor& t);
void check(const torch::Tensor& t, const char* what);
torch::Tensor encode(torch::Tensor x, int64_t M, const TacoParams& p, c10::optional<torch::Tensor> into);
torch::Tensor decode(TacoMsgs msgs, int64_t M, torch::Tensor out, const TacoParams& p);
torch::Tensor reduce_encode(TacoMsgs msgs, int64_t P, torch::Tensor out, const TacoParams& p);
}  // namespace taco_binding
void bind_symm(pybind11::module_& m);     // taco_symm.cu: the symmetric-memory transport's part of the module
