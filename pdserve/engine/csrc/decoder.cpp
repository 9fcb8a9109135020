// All decoder layers of a step in one call: LlamaModel.forward's loop (engine/model.py)
// moved here for the C++ kernels, the same calls in the same order, so the same bits.
// What it saves is per layer ~10 Python frames and binding crossings (argument
// conversion, the GIL handed back and forth), ~1 ms of a 5 ms single-stream step.
#include "decoder.h"

#include <ATen/ops/add.h>

#include <utility>

namespace pdk {

// The kernels' entry points (their own files).
at::Tensor gemm(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const c10::optional<at::Tensor>&);
at::Tensor gemm_silu_mul(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                         const c10::optional<at::Tensor>&, bool);
at::Tensor quant_gemm(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                      const c10::optional<at::Tensor>&);
at::Tensor w8a8_gemm(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     int64_t, const c10::optional<at::Tensor>&);
at::Tensor w8a8_gemm_silu_mul(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, int64_t, const c10::optional<at::Tensor>&);
at::Tensor add_rms_norm(const at::Tensor&, at::Tensor&, const at::Tensor&, double, bool);
at::Tensor silu_mul(const at::Tensor&);
at::Tensor attention_step(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, int64_t, int64_t, double, int64_t);

at::Tensor LinearOp::operator()(const at::Tensor& x) const {
  switch (kind) {
    case kDense: return gemm(x, packed, n, family, bias);
    case kQuantized: return quant_gemm(x, packed, n, bits, family, bias);
    case kW8A8: return w8a8_gemm(x, packed, scale, colsum, family, bias);
  }
  TORCH_CHECK(false, "unknown linear kind ", kind);
}

at::Tensor LinearOp::silu_mul(const at::Tensor& x, bool bf16_out) const {
  if (!fuses_silu_mul) return pdk::silu_mul((*this)(x));
  if (kind == kW8A8) return w8a8_gemm_silu_mul(x, packed, scale, colsum, family, bias);
  TORCH_CHECK(kind == kDense, "only dense and W8A8 layers fuse silu_mul");
  return gemm_silu_mul(x, packed, n, family, bias, bf16_out);
}

Decoder::Decoder(std::vector<DecoderLayer> layers, at::Tensor cos, at::Tensor sin,
                 int64_t num_heads, int64_t num_kv_heads, double scale, int64_t attn_family,
                 double eps)
    : layers_(std::move(layers)), cos_(std::move(cos)), sin_(std::move(sin)),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), attn_family_(attn_family),
      scale_(scale), eps_(eps) {
  TORCH_CHECK(!layers_.empty(), "a decoder needs layers");
}

at::Tensor Decoder::forward(const at::Tensor& x_in, at::Tensor& residual, at::Tensor& kv_cache,
                            const at::Tensor& positions, const at::Tensor& slots,
                            const at::Tensor& block_table, const at::Tensor& seq_rows,
                            const at::Tensor& q_start, const at::Tensor& q_len,
                            const at::Tensor& ctx_len) const {
  at::Tensor x = x_in;
  const int64_t n = static_cast<int64_t>(layers_.size());
  for (int64_t i = 0;; ++i) {
    const DecoderLayer& l = layers_[i];
    at::Tensor qkv = l.qkv(x);
    at::Tensor o = attention_step(qkv, positions, cos_, sin_, kv_cache, i, slots, block_table,
                                  seq_rows, q_start, q_len, ctx_len, num_heads_, num_kv_heads_,
                                  scale_, attn_family_);
    x = add_rms_norm(l.o(o), residual, l.post_norm, eps_, l.gate_up_bf16);
    at::Tensor d = l.down(l.gate_up.silu_mul(x, l.down_bf16));
    if (i + 1 == n) return at::add(residual, d);  // (the constructor refuses no layers)
    const DecoderLayer& next = layers_[i + 1];
    x = add_rms_norm(d, residual, next.input_norm, eps_, next.qkv_bf16);
  }
}

}  // namespace pdk
