// Python bindings of pdserve's CPU kernels (module pdserve_kernels). Every entry
// releases the GIL while it runs.
#include <torch/extension.h>

namespace pdk {
at::Tensor dense_linear_small(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);
at::Tensor quant_linear_small(const at::Tensor&, const at::Tensor&, int64_t,
                              const c10::optional<at::Tensor>&);
at::Tensor widened_linear(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&,
                          int64_t);
bool attention_supports_head_dim(int64_t);
void paged_attention(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, double, at::Tensor&);
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double);
at::Tensor add_rms_norm(const at::Tensor&, at::Tensor&, const at::Tensor&, double);
void rope_write_kv(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                   int64_t, const at::Tensor&, int64_t, int64_t);
at::Tensor silu_mul(const at::Tensor&);
}  // namespace pdk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("dense_linear_small", &pdk::dense_linear_small, nogil);
  m.def("quant_linear_small", &pdk::quant_linear_small, nogil);
  m.def("widened_linear", &pdk::widened_linear, nogil);
  m.def("paged_attention", &pdk::paged_attention, nogil);
  m.def("attention_supports_head_dim", &pdk::attention_supports_head_dim);
  m.def("rms_norm", &pdk::rms_norm, nogil);
  m.def("add_rms_norm", &pdk::add_rms_norm, nogil);
  m.def("rope_write_kv", &pdk::rope_write_kv, nogil);
  m.def("silu_mul", &pdk::silu_mul, nogil);
}
