// Weight-only linear layers for decode-sized batches: y[M, N] = x[M, K] @ W^T + b.
//
// Weights stay row-major [N, K] as checkpoints store them, in one of three formats:
//
//   dense  W[N][K]            float32 or bfloat16
//   int8   q[N][K] int8,      scale[N][K/G] float32          w = scale * q
//   int4   p[N][K/2] uint8,   d[N][K/G], m[N][K/G] float16   w = d * q + m,  q in 0..15
//          nibble order per 32 weights (GGUF's Q4_0/Q4_1 order): byte j of a
//          32-weight chunk holds weight j in its low nibble and weight j + 16 in its
//          high nibble.
//
// Small M (decode): each weight is read once from memory and used for all M rows
// of x; rows of W are processed R at a time so that R*M accumulators live in
// registers. Large M (prefill): a panel of rows of W is widened to float32 once
// (in cache) and multiplied with the BLAS; see large_linear().
//
// x is float32 [M, K] contiguous; y float32 [M, N]. K must be a multiple of 16
// (int4 / grouped int8: of the group size, itself a multiple of 32).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>

#include "vec.h"

namespace pdk {
namespace {

constexpr int64_t kRowGrain = 16;  // rows of W per parallel task (at least)

template <int M>
constexpr int rows_per_pass() { return M <= 3 ? 4 : (M <= 6 ? 2 : 1); }

// ---------------------------------------------------------------- dense
// 16 weights of a row per step. bf16 is widened with unpacks against zero, which
// leaves the 16 values in the order (0-3, 8-11) (4-7, 12-15); x is permuted the
// same way once per call (permute_x), so every dot product still pairs w_k with x_k.
inline void load16(const float* p, __m256& a, __m256& b) { a = load8(p); b = load8(p + 8); }
inline void load16(const bf16_t* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

// x rows in the order load16 produces weights (bf16 only; float32 keeps x as is).
void permute_x(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 16) {
      const float* s = x + m * K + k;
      float* d = out + m * K + k;
      for (int i = 0; i < 4; ++i) {
        d[i] = s[i]; d[4 + i] = s[8 + i]; d[8 + i] = s[4 + i]; d[12 + i] = s[12 + i];
      }
    }
}

template <typename T, int M>
void dense_small(const float* x, int64_t K, const T* W, int64_t n0, int64_t n1, float* y,
                 int64_t N, const float* bias) {
  constexpr int R = rows_per_pass<M>();
  auto pass = [&](int64_t n, auto rows_tag) {
    constexpr int RR = decltype(rows_tag)::value;
    __m256 acc[RR][M];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m256 xa[M], xb[M];
      for (int m = 0; m < M; ++m) { xa[m] = load8(x + m * K + k); xb[m] = load8(x + m * K + k + 8); }
      for (int r = 0; r < RR; ++r) {
        __m256 wa, wb;
        load16(W + (n + r) * K + k, wa, wb);
        for (int m = 0; m < M; ++m) {
          acc[r][m] = _mm256_fmadd_ps(wa, xa[m], acc[r][m]);
          acc[r][m] = _mm256_fmadd_ps(wb, xb[m], acc[r][m]);
        }
      }
    }
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = hsum(acc[r][m]) + (bias ? bias[n + r] : 0.f);
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) pass(n, std::integral_constant<int, R>{});
  for (; n < n1; ++n) pass(n, std::integral_constant<int, 1>{});
}

// ----------------------------------------------------------------- int8
inline __m256 load8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int M>
void int8_small(const float* x, int64_t K, const int8_t* Q, const float* S, int64_t G,
                int64_t n0, int64_t n1, float* y, int64_t N, const float* bias) {
  constexpr int R = rows_per_pass<M>();
  const int64_t ng = K / G;
  auto pass = [&](int64_t n, auto rows_tag) {
    constexpr int RR = decltype(rows_tag)::value;
    __m256 tot[RR][M];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m) tot[r][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m256 acc[RR][M];
      for (int r = 0; r < RR; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
        __m256 xv[M];
        for (int m = 0; m < M; ++m) xv[m] = load8(x + m * K + k);
        for (int r = 0; r < RR; ++r) {
          __m256 w = load8_i8(Q + (n + r) * K + k);
          for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(w, xv[m], acc[r][m]);
        }
      }
      for (int r = 0; r < RR; ++r) {
        __m256 s = _mm256_set1_ps(S[(n + r) * ng + g]);
        for (int m = 0; m < M; ++m) tot[r][m] = _mm256_fmadd_ps(s, acc[r][m], tot[r][m]);
      }
    }
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = hsum(tot[r][m]) + (bias ? bias[n + r] : 0.f);
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) pass(n, std::integral_constant<int, R>{});
  for (; n < n1; ++n) pass(n, std::integral_constant<int, 1>{});
}

// ----------------------------------------------------------------- int4
// 32 weights of one row from 16 bytes, as 4 x 8 float lanes in weight order.
inline void load32_u4(const uint8_t* p, __m256 out[4]) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(v, mask);                     // weights 0..15
  __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);  // weights 16..31
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// xsum[m * ng + g] = sum of x[m, g*G : (g+1)*G] (the min term of w = d*q + m).
void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* xsum) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, load8(x + m * K + k));
      xsum[m * ng + g] = hsum(s);
    }
}

template <int M>
void int4_small(const float* x, const float* xsum, int64_t K, const uint8_t* P,
                const uint16_t* D, const uint16_t* Mn, int64_t G, int64_t n0, int64_t n1,
                float* y, int64_t N, const float* bias) {
  constexpr int R = rows_per_pass<M>();
  const int64_t ng = K / G;
  auto pass = [&](int64_t n, auto rows_tag) {
    constexpr int RR = decltype(rows_tag)::value;
    __m256 tot[RR][M];
    float mins[RR][M];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m) { tot[r][m] = _mm256_setzero_ps(); mins[r][m] = 0.f; }
    for (int64_t g = 0; g < ng; ++g) {
      __m256 acc[RR][M];
      for (int r = 0; r < RR; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        for (int r = 0; r < RR; ++r) {
          __m256 w[4];
          load32_u4(P + (n + r) * (K / 2) + k / 2, w);
          for (int m = 0; m < M; ++m) {
            const float* xm = x + m * K + k;
            __m256 a = acc[r][m];
            a = _mm256_fmadd_ps(w[0], load8(xm), a);
            a = _mm256_fmadd_ps(w[1], load8(xm + 8), a);
            a = _mm256_fmadd_ps(w[2], load8(xm + 16), a);
            a = _mm256_fmadd_ps(w[3], load8(xm + 24), a);
            acc[r][m] = a;
          }
        }
      }
      for (int r = 0; r < RR; ++r) {
        const float d = half_to_float(D[(n + r) * ng + g]);
        const float mn = half_to_float(Mn[(n + r) * ng + g]);
        __m256 dv = _mm256_set1_ps(d);
        for (int m = 0; m < M; ++m) {
          tot[r][m] = _mm256_fmadd_ps(dv, acc[r][m], tot[r][m]);
          mins[r][m] += mn * xsum[m * ng + g];
        }
      }
    }
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = hsum(tot[r][m]) + mins[r][m] + (bias ? bias[n + r] : 0.f);
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) pass(n, std::integral_constant<int, R>{});
  for (; n < n1; ++n) pass(n, std::integral_constant<int, 1>{});
}

// -------------------------------------------------------------- dispatch
constexpr int kMaxSmallM = 8;

template <template <int> class F, typename... A>
void by_m(int64_t M, A&&... args) {
  switch (M) {
    case 1: F<1>::run(args...); break;
    case 2: F<2>::run(args...); break;
    case 3: F<3>::run(args...); break;
    case 4: F<4>::run(args...); break;
    case 5: F<5>::run(args...); break;
    case 6: F<6>::run(args...); break;
    case 7: F<7>::run(args...); break;
    case 8: F<8>::run(args...); break;
    default: TORCH_CHECK(false, "small-batch kernel takes 1..8 rows, got ", M);
  }
}

template <int M> struct DenseF32 { template <typename... A> static void run(A... a) { dense_small<float, M>(a...); } };
template <int M> struct DenseBF16 { template <typename... A> static void run(A... a) { dense_small<bf16_t, M>(a...); } };
template <int M> struct Int8F { template <typename... A> static void run(A... a) { int8_small<M>(a...); } };
template <int M> struct Int4F { template <typename... A> static void run(A... a) { int4_small<M>(a...); } };

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16, got ", K);
}

const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              "bias must be a contiguous float32 [N] tensor");
  return bias->data_ptr<float>();
}

// Runs fn(rows [n0, n1), m0, mlen) over chunks of at most kMaxSmallM rows of x,
// rows of W split across threads.
template <typename Fn>
void for_row_blocks(int64_t M, int64_t N, Fn fn) {
  at::parallel_for(0, N, kRowGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxSmallM) fn(n0, n1, m0, std::min<int64_t>(kMaxSmallM, M - m0));
  });
}

}  // namespace

at::Tensor dense_linear_small(const at::Tensor& x, const at::Tensor& w,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be contiguous [N, K]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_x(x, K);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* b = bias_ptr(bias, N);
  if (w.scalar_type() == at::kFloat) {
    const float* W = w.data_ptr<float>();
    for_row_blocks(M, N, [&](int64_t n0, int64_t n1, int64_t m0, int64_t mm) {
      by_m<DenseF32>(mm, xp + m0 * K, K, W, n0, n1, yp + m0 * N, N, b);
    });
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "dense weight must be float32 or bfloat16");
    const bf16_t* W = reinterpret_cast<const bf16_t*>(w.data_ptr<at::BFloat16>());
    std::vector<float> xperm(M * K);
    permute_x(xp, M, K, xperm.data());
    for_row_blocks(M, N, [&](int64_t n0, int64_t n1, int64_t m0, int64_t mm) {
      by_m<DenseBF16>(mm, xperm.data() + m0 * K, K, W, n0, n1, yp + m0 * N, N, b);
    });
  }
  return y;
}

at::Tensor int8_linear_small(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                             int64_t group, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  check_x(x, K);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  TORCH_CHECK(group % 8 == 0 && K % group == 0, "group must be a multiple of 8 dividing K");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
              scale.numel() == N * (K / group), "scale must be float32 [N, K / group]");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* b = bias_ptr(bias, N);
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  for_row_blocks(M, N, [&](int64_t n0, int64_t n1, int64_t m0, int64_t mm) {
    by_m<Int8F>(mm, xp + m0 * K, K, Q, S, group, n0, n1, yp + m0 * N, N, b);
  });
  return y;
}

at::Tensor int4_linear_small(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                             const at::Tensor& mins, int64_t group,
                             const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = packed.size(0), K = packed.size(1) * 2;
  check_x(x, K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  for (const auto* t : {&d, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == N * (K / group),
                "scales and mins must be float16 [N, K / group]");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(M * (K / group));
  group_sums(xp, M, K, group, xsum.data());
  float* yp = y.data_ptr<float>();
  const float* b = bias_ptr(bias, N);
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const uint16_t* D = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* Mn = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  for_row_blocks(M, N, [&](int64_t n0, int64_t n1, int64_t m0, int64_t mm) {
    by_m<Int4F>(mm, xp + m0 * K, xsum.data() + m0 * (K / group), K, P, D, Mn, group, n0, n1,
                yp + m0 * N, N, b);
  });
  return y;
}

// ------------------------------------------------------------ large M
namespace {

// Rows [n0, n0 + rows) of a weight, widened to float32 into out[rows][K].
void widen_rows(const at::Tensor& w, const at::Tensor* s, const at::Tensor* mn, int64_t group,
                int64_t n0, int64_t rows, int64_t K, float* out) {
  if (w.scalar_type() == at::kBFloat16) {
    const bf16_t* W = reinterpret_cast<const bf16_t*>(w.data_ptr<at::BFloat16>()) + n0 * K;
    for (int64_t i = 0; i < rows * K; i += 8) store8(out + i, load8(W + i));
  } else if (w.scalar_type() == at::kChar) {
    const int8_t* Q = w.data_ptr<int8_t>() + n0 * K;
    const float* S = s->data_ptr<float>() + n0 * (K / group);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; k += 8)
        store8(out + r * K + k,
               _mm256_mul_ps(load8_i8(Q + r * K + k), _mm256_set1_ps(S[r * (K / group) + k / group])));
  } else {
    const uint8_t* P = w.data_ptr<uint8_t>() + n0 * (K / 2);
    const uint16_t* D = reinterpret_cast<const uint16_t*>(s->data_ptr<at::Half>()) + n0 * (K / group);
    const uint16_t* Mn = reinterpret_cast<const uint16_t*>(mn->data_ptr<at::Half>()) + n0 * (K / group);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; k += 32) {
        __m256 q[4];
        load32_u4(P + r * (K / 2) + k / 2, q);
        const int64_t gi = r * (K / group) + k / group;
        __m256 dv = _mm256_set1_ps(half_to_float(D[gi])), mv = _mm256_set1_ps(half_to_float(Mn[gi]));
        for (int j = 0; j < 4; ++j) store8(out + r * K + k + 8 * j, _mm256_fmadd_ps(q[j], dv, mv));
      }
  }
}

}  // namespace

// y = x @ W^T (+ bias) for any M: panels of `panel` rows of W are widened to
// float32 (they stay in cache) and multiplied with the BLAS (MKL / OpenBLAS sgemm,
// itself multi-threaded). Format as in the small kernels: bf16 (scale, mins unset),
// int8 (scale), int4 (scale = d, mins).
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& scale,
                          const c10::optional<at::Tensor>& mins, int64_t group,
                          const c10::optional<at::Tensor>& bias, int64_t panel) {
  const bool int4 = w.scalar_type() == at::kByte;
  const int64_t N = w.size(0), K = int4 ? w.size(1) * 2 : w.size(1);
  check_x(x, K);
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || scale.has_value(), "quantized weights need scales");
  TORCH_CHECK(!int4 || mins.has_value(), "int4 weights need mins");
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  auto buf = at::empty({std::min(panel, N), K}, x.options());
  const at::Tensor* s = scale.has_value() ? &*scale : nullptr;
  const at::Tensor* mn = mins.has_value() ? &*mins : nullptr;
  for (int64_t n0 = 0; n0 < N; n0 += panel) {
    const int64_t rows = std::min(panel, N - n0);
    auto wp = buf.narrow(0, 0, rows);
    widen_rows(w, s, mn, group, n0, rows, K, wp.data_ptr<float>());
    auto out = y.narrow(1, n0, rows);
    if (bias.has_value()) {
      at::addmm_out(out, bias->narrow(0, n0, rows), x, wp.t());
    } else {
      at::mm_out(out, x, wp.t());
    }
  }
  return y;
}

}  // namespace pdk
