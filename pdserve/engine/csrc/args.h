// Argument checks shared by the linear kernels (gemm.cpp, linear.cpp, w8a8.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace pdk {

// The bias as a float32 pointer (nullptr without one), checked against N outputs.
inline const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              "bias must be a contiguous float32 [N] tensor");
  return bias->data_ptr<float>();
}

}  // namespace pdk
