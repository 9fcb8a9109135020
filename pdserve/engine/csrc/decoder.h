// All decoder layers of a step in one call (engine/model.py's loop, the same kernels
// in the same order): decoder.cpp.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace pdk {

// One linear layer's kernel, called as its engine/linear.py object calls it.
struct LinearOp {
  enum Kind : int64_t { kDense = 0, kQuantized = 1, kW8A8 = 2 };
  int64_t kind, n, family, bits;  // bits: kQuantized's
  at::Tensor packed, scale, colsum;  // scale, colsum: kW8A8's
  c10::optional<at::Tensor> bias;
  bool fuses_silu_mul;  // a gate/up layer whose family writes silu(gate) * up itself

  at::Tensor operator()(const at::Tensor& x) const;
  // silu(gate) * up of this gate/up layer's [gate | up] output (Linear.silu_mul)
  at::Tensor silu_mul(const at::Tensor& x, bool bf16_out) const;
};

struct DecoderLayer {
  LinearOp qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;
  bool qkv_bf16, gate_up_bf16, down_bf16;  // the layers that take bfloat16 rows
};

class Decoder {
 public:
  Decoder(std::vector<DecoderLayer> layers, at::Tensor cos, at::Tensor sin, int64_t num_heads,
          int64_t num_kv_heads, double scale, int64_t attn_family, double eps);
  // x: the first layer's normed input, residual: the embeddings (updated in place);
  // returns the residual stream after the last layer.
  at::Tensor forward(const at::Tensor& x, at::Tensor& residual, at::Tensor& kv_cache,
                     const at::Tensor& positions, const at::Tensor& slots,
                     const at::Tensor& block_table, const at::Tensor& seq_rows,
                     const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& ctx_len) const;

 private:
  std::vector<DecoderLayer> layers_;
  at::Tensor cos_, sin_;
  int64_t num_heads_, num_kv_heads_, attn_family_;
  double scale_, eps_;
};

}  // namespace pdk
