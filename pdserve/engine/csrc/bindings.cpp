// Python bindings of pdserve's CPU kernels (module pdserve_kernels). Every entry
// releases the GIL while it runs.
#include <torch/extension.h>

#include "decoder.h"
#include "families.h"

namespace pdk {
at::Tensor pack_quantized(const at::Tensor&, int64_t, int64_t);
at::Tensor quant_gemm(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                      const c10::optional<at::Tensor>&);
at::Tensor pack_weight(const at::Tensor&, int64_t);
double family_peak(int64_t);
bool amx_ready();
at::Tensor pack_w8(const at::Tensor&, int64_t);
int64_t w8a8_group(int64_t);
double w8a8_peak(int64_t);
at::Tensor w8a8_gemm(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                     const c10::optional<at::Tensor>&);
at::Tensor w8a8_gemm_silu_mul(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, int64_t, const c10::optional<at::Tensor>&);
at::Tensor gemm(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const c10::optional<at::Tensor>&);
at::Tensor gemm_silu_mul(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                         const c10::optional<at::Tensor>&, bool);
bool attention_supports_head_dim(int64_t);
void paged_attention(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, double, at::Tensor&, int64_t);
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double, bool);
at::Tensor add_rms_norm(const at::Tensor&, at::Tensor&, const at::Tensor&, double, bool);
void rope_write_kv(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                   int64_t, const at::Tensor&, int64_t, int64_t);
at::Tensor silu_mul(const at::Tensor&);
at::Tensor argmax_rows(const at::Tensor&);
at::Tensor inverse_cdf_rows(const at::Tensor&, const at::Tensor&);
void apply_token_bitmask(at::Tensor&, const at::Tensor&, const at::Tensor&);

// One layer's attention for a step: rotary on q/k in the fused qkv, K/V into their
// slots, paged attention; returns [T, H * D]. (One call instead of two + views.)
at::Tensor attention_step(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                          const at::Tensor& sin, at::Tensor& kv_cache, int64_t layer,
                          const at::Tensor& slots, const at::Tensor& block_table,
                          const at::Tensor& seq_rows, const at::Tensor& q_start,
                          const at::Tensor& q_len, const at::Tensor& ctx_len, int64_t num_heads,
                          int64_t num_kv_heads, double scale, int64_t family) {
  rope_write_kv(qkv, positions, cos, sin, kv_cache, layer, slots, num_heads, num_kv_heads);
  const int64_t T = qkv.size(0), D = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  auto q = qkv.view({T, -1, D}).narrow(1, 0, num_heads);
  auto out = at::empty({T, num_heads, D}, qkv.options());
  paged_attention(q, kv_cache, layer, block_table, seq_rows, q_start, q_len, ctx_len, scale, out,
                  family);
  return out.view({T, num_heads * D});
}

// torch's intra-op thread count for the calling thread, fixed in this library too. A
// library keeps its own per-thread flag "this thread has its count" (at::parallel_for's
// lazy_init_num_threads, inline): a thread's first parallel_for here would otherwise
// give it the count some other thread set last (kernels.set_num_threads).
void set_num_threads(int64_t n) {
  at::set_num_threads(static_cast<int>(n));
  at::internal::lazy_init_num_threads();
}
}  // namespace pdk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("set_num_threads", &pdk::set_num_threads);
  m.def("pack_quantized", &pdk::pack_quantized, nogil);
  m.def("quant_gemm", &pdk::quant_gemm, nogil);
  m.def("pack_weight", &pdk::pack_weight, nogil);
  m.def("gemm", &pdk::gemm, nogil);
  m.def("gemm_silu_mul", &pdk::gemm_silu_mul, py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("family"), py::arg("bias"), py::arg("bf16_out") = false, nogil);
  m.def("family_peak", &pdk::family_peak, nogil);
  m.def("amx_ready", &pdk::amx_ready);
  m.def("pack_w8", &pdk::pack_w8, nogil);
  m.def("w8a8_gemm", &pdk::w8a8_gemm, nogil);
  m.def("w8a8_gemm_silu_mul", &pdk::w8a8_gemm_silu_mul, nogil);
  m.def("w8a8_group", &pdk::w8a8_group);
  m.def("w8a8_peak", &pdk::w8a8_peak, nogil);
  m.def("paged_attention", &pdk::paged_attention, nogil);
  m.def("attention_supports_head_dim", &pdk::attention_supports_head_dim);
  m.def("rms_norm", &pdk::rms_norm, py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("bf16_out") = false, nogil);
  m.def("add_rms_norm", &pdk::add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("w"),
        py::arg("eps"), py::arg("bf16_out") = false, nogil);
  m.def("rope_write_kv", &pdk::rope_write_kv, nogil);
  m.def("silu_mul", &pdk::silu_mul, nogil);
  m.def("argmax_rows", &pdk::argmax_rows, nogil);
  m.def("inverse_cdf_rows", &pdk::inverse_cdf_rows, nogil);
  m.def("attention_step", &pdk::attention_step, nogil);
  m.def("apply_token_bitmask", &pdk::apply_token_bitmask, nogil);
  // Each family's id by the name each kind of kernel knows it by (families.h)
  py::dict family_ids;
  family_ids["avx2"] = static_cast<int64_t>(pdk::kAvx2);
  family_ids["avx512bf16"] = static_cast<int64_t>(pdk::kAvx512);
  family_ids["avx512vnni"] = static_cast<int64_t>(pdk::kAvx512);
  family_ids["amx"] = static_cast<int64_t>(pdk::kAmx);
  m.attr("FAMILY_IDS") = family_ids;
  m.attr("LINEAR_DENSE") = static_cast<int64_t>(pdk::LinearOp::kDense);
  m.attr("LINEAR_QUANTIZED") = static_cast<int64_t>(pdk::LinearOp::kQuantized);
  m.attr("LINEAR_W8A8") = static_cast<int64_t>(pdk::LinearOp::kW8A8);
  py::class_<pdk::LinearOp>(m, "LinearOp")
      .def(py::init([](int64_t kind, at::Tensor packed, int64_t n, int64_t family,
                       c10::optional<at::Tensor> bias, int64_t bits,
                       c10::optional<at::Tensor> scale, c10::optional<at::Tensor> colsum,
                       bool fuses_silu_mul) {
             TORCH_CHECK(kind >= pdk::LinearOp::kDense && kind <= pdk::LinearOp::kW8A8,
                         "unknown linear kind ", kind);
             TORCH_CHECK(kind != pdk::LinearOp::kW8A8 || (scale && colsum),
                         "a W8A8 layer needs its scale and colsum");
             return pdk::LinearOp{kind, n, family, bits, std::move(packed),
                                  scale.value_or(at::Tensor()), colsum.value_or(at::Tensor()),
                                  std::move(bias), fuses_silu_mul};
           }),
           py::arg("kind"), py::arg("packed"), py::arg("n"), py::arg("family"), py::arg("bias"),
           py::arg("bits") = 0, py::arg("scale") = py::none(), py::arg("colsum") = py::none(),
           py::arg("fuses_silu_mul") = false);
  py::class_<pdk::DecoderLayer>(m, "DecoderLayer")
      .def(py::init<pdk::LinearOp, pdk::LinearOp, pdk::LinearOp, pdk::LinearOp, at::Tensor,
                    at::Tensor, bool, bool, bool>());
  py::class_<pdk::Decoder>(m, "Decoder")
      .def(py::init<std::vector<pdk::DecoderLayer>, at::Tensor, at::Tensor, int64_t, int64_t,
                    double, int64_t, double>())
      .def("forward", &pdk::Decoder::forward, nogil);
}
