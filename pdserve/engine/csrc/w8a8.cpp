// W8A8 linear layers: int8 weights with a scale per output channel x int8
// activations with a scale per row and group of G input values (G = 64 where K
// allows, else 32 or 16: w8a8_group), quantized here on the fly; y float32:
//
//   x[m, g] ~ sx[m, g] * qx[m, g]   sx = max|x[m, g]| / 127, qx = round(x / sx)
//   W[n, :] ~ sw[n] * qw[n, :]       (quant.quantize_w8: per channel, symmetric)
//   y[m, n] = (sum over g, in order, of float(dot_g) * sx[m, g]) * sw[n] + b[n]
//
// dot_g = sum over the group of qx * qw is an integer sum, exact in int32 in any
// order; the float part is the same operations in the same order in every family
// and tile. So a row's result is bit-identical however it is batched, and the same
// on every CPU class; quant.w8a8_reference equals it bit for bit
// (tests/engine/test_gemm.py). One scale per group rather than per row keeps a few
// outlier channels from flattening the rest of the row (default model: +3.9%
// perplexity with per-row scales, docs/quantization.md).
//
// Two families, weights packed at load by pack_w8 into groups of outputs, a group
// one contiguous stream (as gemm.cpp):
//
//   avx2        group [K/4][32][4]: 8 outputs x 4 k (32 bytes) against x's 4 bytes
//               broadcast (int8), vpmaddubsw on |qw| and qx signed by qw, then
//               vpmaddwd by 1 -> 8 int32 (32 multiply-adds per 3 instructions).
//   avx512vnni  group [K/4][64][4]: 16 outputs x 4 k (64 bytes) against x's 4
//               bytes broadcast as unsigned (qx + 128), vpdpbusd -> 16 int32 (64
//               multiply-adds per instruction); 128 * sum over the group of qw
//               (colsum[g][n]) is taken off before scaling.
//   amx         avx512vnni's packing, read as AMX-INT8 B tiles; int8 qx; one
//               TDPBSSD per 16 rows x 16 outputs x one group of G (amx.cpp);
//               fewer than kAmxMinRows rows run avx512vnni's kernel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <vector>

#include "amx.h"
#include "args.h"
#include "families.h"
#include "quantize.h"
#include "vec.h"

namespace pdk {

at::Tensor silu_mul(const at::Tensor& gate_up);  // pointwise.cpp

namespace {


bool known(int64_t family) { return family == kAvx2 || family == kAvx512 || family == kAmx; }
constexpr int64_t kAvx2Group = 32, kVnniGroup = 64;
// Rows of x per pass over the weights: 128 -> 512 took avx512vnni at 1,024 rows from
// 228 to 306-319 GOP/s (one thread, AVX512-BF16 class: fewer passes over weights that
// L2 does not hold); avx2 level.
constexpr int64_t kChunkM = 512;
constexpr int64_t kAmxMinRows = 6;  // fewer rows: amx runs avx512vnni's kernel

// MR rows x NB blocks of 8 outputs; P: the tile's first step of 4 k, ldp bytes per
// step. Per step and block: 8 outputs x 4 k of weights (32 bytes) against the row's
// 4 bytes of qx broadcast: vpmaddubsw(|qw|, qx with qw's sign) -> 16 int16 pair sums
// (each |qw| * |qx| <= 128 * 127: a pair cannot saturate), vpmaddwd by 1 -> 8 int32.
// Only the int32 accumulators live in registers; each group's scaled sum goes into
// ``accf`` (L1) once per G inputs, in group order.
template <int MR, int NB>
void avx2_tile(const int8_t* x, int64_t K, int64_t G, const int8_t* P, int64_t ldp,
               const float* sx, const float* sw, const float* bias, float* y, int64_t N,
               int64_t n0) {
  alignas(32) float accf[MR][NB * 8] = {};
  const __m256i ones = _mm256_set1_epi16(1);
  const auto* x4 = reinterpret_cast<const int32_t*>(x);  // 4 x int8 each
  const int64_t K4 = K / 4, ng = K / G;
  for (int64_t g = 0; g < ng; ++g) {
    __m256i acc[MR][NB];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_si256();
    for (int64_t j = g * G / 4; j < (g + 1) * G / 4; ++j) {
      __m256i w[NB], mag[NB];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        w[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + j * ldp + b * 32));
        mag[b] = _mm256_abs_epi8(w[b]);  // |qw| as unsigned
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256i xb = _mm256_set1_epi32(x4[m * K4 + j]);
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b)
          acc[m][b] = _mm256_add_epi32(acc[m][b], _mm256_madd_epi16(
              _mm256_maddubs_epi16(mag[b], _mm256_sign_epi8(xb, w[b])), ones));
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 s = _mm256_set1_ps(sx[m * ng + g]);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        float* f = accf[m] + b * 8;
        _mm256_store_ps(f, _mm256_add_ps(_mm256_load_ps(f),
                                         _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][b]), s)));
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const int64_t n = n0 + b * 8;
      if (n >= N) continue;
      for (int64_t i = 0; i < std::min<int64_t>(8, N - n); ++i) {
        const float out = accf[m][b * 8 + i];
        y[m * N + n + i] = bias ? out * sw[n + i] + bias[n + i] : out * sw[n + i];
      }
    }
}

// One group of ``width`` (32 or 16) outputs for M rows: tiles of MR rows x 16 outputs.
template <int MR>
void avx2_rows(const int8_t* x, int64_t K, int64_t G, const int8_t* P, int64_t width,
               const float* sx, const float* sw, const float* bias, float* y, int64_t N,
               int64_t n0) {
  for (int64_t h = 0; h < width; h += 16)
    avx2_tile<MR, 2>(x, K, G, P + h * 4, width * 4, sx, sw, bias, y, N, n0 + h);
}

void avx2_group(const int8_t* x, int64_t M, int64_t K, int64_t G, const int8_t* P,
                int64_t width, const float* sx, const float* sw, const float* bias, float* y,
                int64_t N, int64_t n0) {
  constexpr int MR = 4;  // 4 x 2 blocks: 8 int32 accumulators, 2 weights, 2 magnitudes
  const int64_t ng = K / G;
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    avx2_rows<MR>(x + m * K, K, G, P, width, sx + m * ng, sw, bias, y + m * N, N, n0);
  for (; m + 2 <= M; m += 2)
    avx2_rows<2>(x + m * K, K, G, P, width, sx + m * ng, sw, bias, y + m * N, N, n0);
  if (m == M) return;
  if (width == 32)  // one row: the whole group per step (4 weights, 4 accumulators)
    avx2_tile<1, 4>(x + m * K, K, G, P, width * 4, sx + m * ng, sw, bias, y + m * N, N, n0);
  else
    avx2_rows<1>(x + m * K, K, G, P, width, sx + m * ng, sw, bias, y + m * N, N, n0);
}

}  // namespace

// Compiled for AVX512 here only; called only where the CPU has AVX512-VNNI.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace {

template <int MR, int NP>
void vnni_tile(const uint8_t* x, int64_t K, int64_t G, const int8_t* P, int64_t ldp,
               const float* sx, const float* sw, const int32_t* colsum, const float* bias,
               float* y, int64_t N, int64_t n0) {
  __m512 accf[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) accf[m][p] = _mm512_setzero_ps();
  const auto* x4 = reinterpret_cast<const int32_t*>(x);  // 4 bytes of x per step
  const int64_t K4 = K / 4, ng = K / G;
  for (int64_t g = 0; g < ng; ++g) {
    __m512i acc[MR][NP];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_si512();
    for (int64_t j = g * G / 4; j < (g + 1) * G / 4; ++j) {
      __m512i w[NP];
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_si512(P + j * ldp + p * 64);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512i xb = _mm512_set1_epi32(x4[m * K4 + j]);
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbusd_epi32(acc[m][p], xb, w[p]);
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const int64_t n = n0 + p * 16;  // padding outputs: their colsum reads past N
      const __mmask16 mask = n >= N ? static_cast<__mmask16>(0)
                             : N - n >= 16 ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (N - n)) - 1);
      const __m512i off = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, colsum + g * N + n), 7);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][p], off));
        accf[m][p] = _mm512_add_ps(accf[m][p], _mm512_mul_ps(t, _mm512_set1_ps(sx[m * ng + g])));
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const int64_t n = n0 + p * 16;
      if (n >= N) continue;
      const __mmask16 mask = N - n >= 16 ? static_cast<__mmask16>(0xFFFF)
                                         : static_cast<__mmask16>((1u << (N - n)) - 1);
      __m512 v = _mm512_mul_ps(accf[m][p], _mm512_maskz_loadu_ps(mask, sw + n));
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n));
      _mm512_mask_storeu_ps(y + m * N + n, mask, v);
    }
}

// Rows of x (MR at a time) against NB <= 2 blocks of 16 outputs of a packed group (its
// rows ldp bytes apart).
template <int NB>
void vnni_rows(const uint8_t* x, int64_t M, int64_t K, int64_t G, const int8_t* P, int64_t ldp,
               const float* sx, const float* sw, const int32_t* colsum, const float* bias,
               float* y, int64_t N, int64_t n0) {
  constexpr int MR = 6;
  const int64_t ng = K / G;
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    vnni_tile<MR, NB>(x + m * K, K, G, P, ldp, sx + m * ng, sw, colsum, bias, y + m * N, N, n0);
  const uint8_t* xr = x + m * K;
  float* yr = y + m * N;
  const float* sr = sx + m * ng;
  switch (M - m) {
    case 5: return vnni_tile<5, NB>(xr, K, G, P, ldp, sr, sw, colsum, bias, yr, N, n0);
    case 4: return vnni_tile<4, NB>(xr, K, G, P, ldp, sr, sw, colsum, bias, yr, N, n0);
    case 3: return vnni_tile<3, NB>(xr, K, G, P, ldp, sr, sw, colsum, bias, yr, N, n0);
    case 2: return vnni_tile<2, NB>(xr, K, G, P, ldp, sr, sw, colsum, bias, yr, N, n0);
    case 1: return vnni_tile<1, NB>(xr, K, G, P, ldp, sr, sw, colsum, bias, yr, N, n0);
    default: return;
  }
}

// A packed group of NP blocks of 16 outputs, two blocks at a time: 6 rows x 2 blocks
// (12 int32 + 12 float accumulators), and those 32 outputs' weights (K x 32 bytes)
// stay in L1 across the chunk's rows. (3 rows x 4 blocks read twice the weight bytes
// per product, from L2: at 32 rows 309-311 -> 364-365 GOP/s, at 1,024 285 -> 306-319 with
// kChunkM 512; AVX512-BF16 class, one thread.)
template <int NP>
void vnni_group(const uint8_t* x, int64_t M, int64_t K, int64_t G, const int8_t* P,
                const float* sx, const float* sw, const int32_t* colsum, const float* bias,
                float* y, int64_t N, int64_t n0) {
  constexpr int64_t ldp = NP * 64;
  for (int h = 0; h < NP; h += 2) {
    if (NP - h >= 2)
      vnni_rows<2>(x, M, K, G, P + h * 64, ldp, sx, sw, colsum, bias, y, N, n0 + h * 16);
    else
      vnni_rows<1>(x, M, K, G, P + h * 64, ldp, sx, sw, colsum, bias, y, N, n0 + h * 16);
  }
}

void vnni_groups(const uint8_t* x, int64_t M, int64_t K, int64_t G, const int8_t* P,
                 int64_t n_pad, const float* sx, const float* sw, const int32_t* colsum,
                 const float* bias, float* y, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * kVnniGroup, width = std::min(kVnniGroup, n_pad - n0);
    const int8_t* Pg = P + n0 * K;
    switch (width / 16) {
      case 4: vnni_group<4>(x, M, K, G, Pg, sx, sw, colsum, bias, y, N, n0); break;
      case 3: vnni_group<3>(x, M, K, G, Pg, sx, sw, colsum, bias, y, N, n0); break;
      case 2: vnni_group<2>(x, M, K, G, Pg, sx, sw, colsum, bias, y, N, n0); break;
      default: vnni_group<1>(x, M, K, G, Pg, sx, sw, colsum, bias, y, N, n0); break;
    }
  }
}

// Integer ops (2 per multiply-add) of `iters` steps of 12 independent vpdpbusd chains
// (named variables, so that they stay in registers; kept alive past the loop).
double vnni_peak_loop(int64_t iters) {
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
#define PDK_DECL(i) __m512i c##i = _mm512_set1_epi32(i);
  PDK_REP12(PDK_DECL)
#undef PDK_DECL
  for (int64_t t = 0; t < iters; ++t) {
#define PDK_STEP(i) c##i = _mm512_dpbusd_epi32(c##i, a, b);
    PDK_REP12(PDK_STEP)
#undef PDK_STEP
  }
#define PDK_KEEP(i) asm volatile("" : : "v"(c##i));
  PDK_REP12(PDK_KEEP)
#undef PDK_KEEP
  return 2.0 * 64 * 12 * static_cast<double>(iters);
}

}  // namespace
#pragma GCC pop_options

namespace {

// Integer ops of `iters` steps of 12 independent vpmaddwd + vpaddd chains (each
// multiply reads its own chain, so that it cannot be hoisted or folded).
double avx2_peak_loop(int64_t iters) {
  const __m256i b = _mm256_set1_epi16(1);
#define PDK_DECL(i) __m256i c##i = _mm256_set1_epi32(i);
  PDK_REP12(PDK_DECL)
#undef PDK_DECL
  for (int64_t t = 0; t < iters; ++t) {
#define PDK_STEP(i) c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(c##i, b));
    PDK_REP12(PDK_STEP)
#undef PDK_STEP
  }
#define PDK_KEEP(i) asm volatile("" : : "x"(c##i));
  PDK_REP12(PDK_KEEP)
#undef PDK_KEEP
  return 2.0 * 16 * 12 * static_cast<double>(iters);
}

int64_t group_of(int64_t family) { return family == kAvx2 ? kAvx2Group : kVnniGroup; }
int64_t padded16(int64_t N) { return (N + 15) / 16 * 16; }

}  // namespace

// One thread's integer-op peak of a W8A8 family (ops/s, a multiply-add counting 2),
// from a register-only loop: what `make bench` measures the kernels against.
double w8a8_peak(int64_t family) {
  TORCH_CHECK(known(family), "unknown W8A8 family ", family);
  if (family == kAmx) {
    return peak_rate(amx_int8_peak_loop);
  }
  return peak_rate(family == kAvx2 ? avx2_peak_loop : vnni_peak_loop);
}

// qw int8 [N, K] (quant.quantize_w8) -> the family's packed layout (1-d int8).
at::Tensor pack_w8(const at::Tensor& qw, int64_t family) {
  TORCH_CHECK(known(family), "unknown W8A8 family ", family);
  TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kChar && qw.size(0) >= 1,
              "W8A8: the weight must be int8 [N, K]");
  const int64_t N = qw.size(0), K = qw.size(1), n_pad = padded16(N), group = group_of(family);
  const int64_t step = 4;  // k per packed step
  TORCH_CHECK(K % step == 0 && K >= step, "W8A8: K must be a multiple of ", step, ", got ", K);
  at::Tensor padded = at::zeros({n_pad, K}, qw.options());
  padded.narrow(0, 0, N).copy_(qw);
  std::vector<at::Tensor> parts;
  for (int64_t g0 = 0; g0 < n_pad; g0 += group) {
    const int64_t width = std::min(group, n_pad - g0);
    // [width, K / step, step] -> [K / step, width, step]
    parts.push_back(padded.narrow(0, g0, width).view({width, K / step, step})
                        .permute({1, 0, 2}).contiguous().view(-1));
  }
  return at::cat(parts);
}

// The activation group for K input values: 64, else 32, else 16.
int64_t w8a8_group(int64_t K) {
  for (int64_t g : {64, 32, 16})
    if (K % g == 0) return g;
  TORCH_CHECK(false, "W8A8: K must be a multiple of 16, got ", K);
}

namespace {

// x quantized per row and group for `family`'s kernel: qx, its scales and G.
struct QuantizedX {
  at::Tensor q;  // avx2, amx: int8 qx; avx512vnni: qx + 128 (64-byte aligned rows'
                 // start: a 64-byte group is then one cache line, amx's tile rows)
  std::vector<float> sx;  // [M, K / G]
  int64_t G;
};

QuantizedX quantized_x(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sw,
                       const at::Tensor& colsum, int64_t family) {
  TORCH_CHECK(known(family), "unknown W8A8 family ", family);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = sw.numel(), n_pad = padded16(N);
  const int64_t G = w8a8_group(K), ng = K / G;
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sw.is_contiguous() && N >= 1,
              "W8A8: the scales must be contiguous float32 [N]");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() &&
                  colsum.numel() == ng * N,
              "W8A8: colsum must be contiguous int32 [", ng, ", ", N, "]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() == n_pad * K,
              "the packed weight must be pack_w8's of a [", N, ", ", K, "] weight");
  QuantizedX q{at::empty({M * K}, x.options().dtype(at::kByte)), std::vector<float>(M * ng), G};
  quantize_rows(x.data_ptr<float>(), M, K, G,
                family == kAvx512 ? QxForm::kU8Offset : QxForm::kS8, q.q.data_ptr<uint8_t>(),
                q.sx.data());
  return q;
}

}  // namespace

// y = x @ (sw * qw)^T (+ bias), x quantized per row and group; packed by pack_w8 for
// `family`; colsum[g][n] = sum over group g of qw[n, k] (int32; used by avx512vnni).
at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sw,
                     const at::Tensor& colsum, int64_t family,
                     const c10::optional<at::Tensor>& bias) {
  // Every family gives the same bits, so amx hands a few rows (decode) to avx512vnni,
  // which is faster there (one 64-deep step per tile leaves little to amortise the
  // tiles' loads and stores over: 1 row ~0.5x, 6 rows ~1.7x vnni's speed).
  if (family == kAmx && x.dim() == 2 && x.size(0) < kAmxMinRows) family = kAvx512;
  const QuantizedX q = quantized_x(x, packed, sw, colsum, family);
  const int64_t M = x.size(0), K = x.size(1), N = sw.numel(), n_pad = padded16(N);
  const int64_t G = q.G, ng = K / G;
  const float* b = bias_ptr(bias, N);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* q8 = q.q.data_ptr<uint8_t>();
  const int8_t* P = packed.data_ptr<int8_t>();
  const float* swp = sw.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (family == kAmx) {
    amx_w8a8(reinterpret_cast<const int8_t*>(q8), M, K, G, P, n_pad, q.sx.data(), swp, b, yp, N);
    return y;
  }
  const int64_t group = group_of(family), groups = (n_pad + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
      const int64_t mm = std::min(kChunkM, M - m0);
      const float* sxm = q.sx.data() + m0 * ng;
      if (family == kAvx512) {
        vnni_groups(q8 + m0 * K, mm, K, G, P, n_pad, sxm, swp, colsum.data_ptr<int32_t>(), b,
                    yp + m0 * N, N, g0, g1);
        continue;
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * kAvx2Group, width = std::min(kAvx2Group, n_pad - n0);
        const auto* xr = reinterpret_cast<const int8_t*>(q8 + m0 * K);
        avx2_group(xr, mm, K, G, P + n0 * K, width, sxm, swp, b, yp + m0 * N, N, n0);
      }
    }
  });
  return y;
}

// silu(gate) * up from a fused gate/up W8A8 weight (N = 2I outputs: I gates, then
// their ups; I a multiple of 64) on the amx family -> [M, I], the same bits as
// w8a8_gemm then pointwise.cpp's silu_mul.
at::Tensor w8a8_gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sw,
                              const at::Tensor& colsum, int64_t family,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(family == kAmx, "silu_mul is fused into the W8A8 amx family only");
  TORCH_CHECK(sw.numel() % 128 == 0, "a fused silu_mul needs 2 x a multiple of 64 outputs, got ",
              sw.numel());
  // a few rows: w8a8_gemm hands them to avx512vnni (the same bits)
  if (x.dim() == 2 && x.size(0) < kAmxMinRows)
    return silu_mul(w8a8_gemm(x, packed, sw, colsum, family, bias));
  const QuantizedX q = quantized_x(x, packed, sw, colsum, family);
  const int64_t M = x.size(0), K = x.size(1), N = sw.numel(), I = N / 2;
  const float* b = bias_ptr(bias, N);
  auto y = at::empty({M, I}, x.options());
  if (M == 0) return y;
  amx_w8a8_silu_mul(reinterpret_cast<const int8_t*>(q.q.data_ptr<uint8_t>()), M, K, q.G,
                    packed.data_ptr<int8_t>(), q.sx.data(), sw.data_ptr<float>(), b,
                    y.data_ptr<float>(), I);
  return y;
}

}  // namespace pdk
