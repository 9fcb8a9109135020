// Helpers shared by the linear kernels (gemm.cpp, quant_gemm.cpp, w8a8.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>

namespace pdk {

// The bias as a float32 pointer (nullptr without one), checked against N outputs.
inline const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              "bias must be a contiguous float32 [N] tensor");
  return bias->data_ptr<float>();
}

// Best of three runs of a register-only peak loop: `loop(iters)` returns the
// operations it did; the result is operations per second on one thread.
template <typename Loop>
double peak_rate(Loop loop) {
  constexpr int64_t kIters = 1 << 22;
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    const double ops = loop(kIters);
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best = std::max(best, ops / dt.count());
  }
  return best;
}

}  // namespace pdk
