// Weight-only linear layers for decode-sized batches: y[M, N] = x[M, K] @ W^T + b.
//
// Weights stay row-major [N, K] as checkpoints store them, in one of three formats;
// the quantized ones are GGUF's own block layouts, so a GGUF file's tensors are used
// as they are (one contiguous stream per row, scales next to their weights):
//
//   dense  W[N][K]                  float32 or bfloat16
//   int8   Q8_0 blocks [N][K / 32]  34 bytes: d (fp16), q[32] (int8)     w = d * q
//   int4   Q4_1 blocks [N][K / 32]  20 bytes: d, m (fp16), 16 bytes of nibbles
//          (byte j: weight j in the low nibble, weight j + 16 in the high)   w = d * q + m
//
// A coarser quantization group (int8 per output channel, int4 groups of 64/128) is
// the same layout with the scales repeated in each block.
//
// Small M (decode): each weight is read once from memory and used for all M rows
// of x; rows of W are processed R at a time so that R*M accumulators live in
// registers. Large M (prefill): a panel of rows of W is widened to float32 once
// (in cache) and multiplied with the BLAS; see widened_linear().
//
// x is float32 [M, K] contiguous; y float32 [M, N]. K must be a multiple of 16
// (quantized: of 32).
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
    // bf16: prefetch the next pass's rows (contiguous after these) as this pass goes
    // (measured: 12.9 -> 15.5 GB/s at 1 row); float32 rows are long enough for the
    // hardware prefetcher, and prefetching them cost 18 -> 14 GB/s.
    const char* next = reinterpret_cast<const char*>(W + (n + RR) * K);
    constexpr int64_t kStep = 16 * RR * static_cast<int64_t>(sizeof(T));  // bytes per k step
    for (int64_t k = 0; k < K; k += 16) {
      if constexpr (sizeof(T) == 2)
        for (int64_t off = (k / 16) * kStep; off < (k / 16 + 1) * kStep; off += 64)
          _mm_prefetch(next + off, _MM_HINT_T0);
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

// ------------------------------------------------------ int8 / int4 weights
// Quantized weights meet x quantized to int16 per 32 values (scale sx = max|x| /
// 32767, so x keeps ~15 bits: the result matches the dequantized weights' matmul to
// float rounding): 16-bit products summed pairwise into int32 (no overflow:
// 2 * 128 * 32767 < 2^31), then scaled in float by sx * d. The int4 min term
// m * sum(x) uses the sum of the quantized x, so that the error stays that of
// centred weights.
constexpr int64_t kQ8Block = 34, kQ4Block = 20;

struct QuantizedX {
  std::vector<int16_t> q;   // [M][K]
  std::vector<float> scale; // [M][K / 32]
  std::vector<float> sum;   // [M][K / 32]: sx * sum(q)
};

QuantizedX quantize_x(const float* x, int64_t M, int64_t K) {
  QuantizedX out;
  out.q.resize(M * K);
  out.scale.resize(M * (K / 32));
  out.sum.resize(M * (K / 32));
  const __m256 sign_mask = _mm256_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* xb = x + m * K + b * 32;
      __m256 v[4], mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = load8(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign_mask, v[i]));
      }
      const float amax = hmax(mx);
      const float sx = amax / 32767.f;
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
      __m256i i32[4];
      __m256i isum = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest even
        isum = _mm256_add_epi32(isum, i32[i]);
      }
      out.scale[m * (K / 32) + b] = sx;
      out.sum[m * (K / 32) + b] = sx * hsum(_mm256_cvtepi32_ps(isum));
      // 32 x int32 -> 32 x int16; packs work per 128-bit lane, a permute restores order
      int16_t* dst = out.q.data() + m * K + b * 32;
      for (int i = 0; i < 4; i += 2) {
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[i], i32[i + 1]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * i), p);
      }
    }
  return out;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 16 nibble bytes of a Q4_1 block as 32 unsigned bytes 0..15, in weight order.
inline __m256i unpack32_u4(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// 32 weights (int16, two registers) . 32 quantized x (int16) -> 8 float partial sums.
inline __m256 dot32(const __m256i w[2], const int16_t* xq) {
  const __m256i a = _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  const __m256i b = _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
}

template <int M>
constexpr int int_rows_per_pass() { return M <= 2 ? 4 : (M <= 4 ? 2 : 1); }

// xq / sx / xs: x quantized (rows of K, K / 32, K / 32 values), see quantize_x.
// Q4 selects the format: false = Q8_0 blocks, true = Q4_1 blocks.
template <bool Q4, int M>
void quant_small(const int16_t* xq, const float* sx_, const float* xs_, int64_t K,
                 const uint8_t* W, int64_t n0, int64_t n1, float* y, int64_t N,
                 const float* bias) {
  constexpr int R = int_rows_per_pass<M>();
  constexpr int64_t BLK = Q4 ? kQ4Block : kQ8Block;
  const int64_t nb = K / 32, row_bytes = nb * BLK;
  auto pass = [&](int64_t n, auto rows_tag) {
    constexpr int RR = decltype(rows_tag)::value;
    __m256 acc[RR][M];
    float mins[RR][M];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m) { acc[r][m] = _mm256_setzero_ps(); mins[r][m] = 0.f; }
    // The next pass's rows (contiguous after these) are prefetched as this pass goes:
    // quantized rows are short streams the hardware prefetcher does not ramp up on.
    const uint8_t* next = W + (n + RR) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t off = b * RR * BLK; off < (b + 1) * RR * BLK; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
      __m256i w[RR][2];
      float dr[RR], mr[RR];
      for (int r = 0; r < RR; ++r) {
        const uint8_t* blk = W + (n + r) * row_bytes + b * BLK;
        // d (and m) are the block's first fp16 values: one 4-byte load, one convert
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(blk)));
        dr[r] = _mm_cvtss_f32(dm);
        if constexpr (Q4) {
          mr[r] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
          // each 16-bit lane holds one nibble byte: low nibble = weight j, high = j + 16
          const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
          w[r][0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
          w[r][1] = _mm256_srli_epi16(v, 4);
        } else {
          w[r][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
          w[r][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
        }
      }
      for (int m = 0; m < M; ++m) {
        const float sx = sx_[m * nb + b];
        for (int r = 0; r < RR; ++r) {
          acc[r][m] = _mm256_fmadd_ps(dot32(w[r], xq + m * K + b * 32), _mm256_set1_ps(dr[r] * sx), acc[r][m]);
          if constexpr (Q4) mins[r][m] += mr[r] * xs_[m * nb + b];
        }
      }
    }
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = hsum(acc[r][m]) + mins[r][m] + (bias ? bias[n + r] : 0.f);
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
template <int M> struct Int8F { template <typename... A> static void run(A... a) { quant_small<false, M>(a...); } };
template <int M> struct Int4F { template <typename... A> static void run(A... a) { quant_small<true, M>(a...); } };

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

// int8 (Q8_0 blocks, [N, K / 32 * 34] uint8) or int4 (Q4_1 blocks, [N, K / 32 * 20]).
at::Tensor quant_linear_small(const at::Tensor& x, const at::Tensor& w, int64_t bits,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t blk = bits == 4 ? kQ4Block : kQ8Block;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % blk == 0,
              "quantized weight must be contiguous uint8 [N, K / 32 * ", blk, "]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1) / blk * 32;
  check_x(x, K);
  auto y = at::empty({M, N}, x.options());
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K);
  float* yp = y.data_ptr<float>();
  const float* b = bias_ptr(bias, N);
  const uint8_t* W = w.data_ptr<uint8_t>();
  for_row_blocks(M, N, [&](int64_t n0, int64_t n1, int64_t m0, int64_t mm) {
    const int16_t* q = xq.q.data() + m0 * K;
    const float* sx = xq.scale.data() + m0 * (K / 32);
    const float* xs = xq.sum.data() + m0 * (K / 32);
    if (bits == 4) by_m<Int4F>(mm, q, sx, xs, K, W, n0, n1, yp + m0 * N, N, b);
    else by_m<Int8F>(mm, q, sx, xs, K, W, n0, n1, yp + m0 * N, N, b);
  });
  return y;
}

// ------------------------------------------------------------ large M
namespace {

// Rows [n0, n0 + rows) of a weight, widened to float32 into out[rows][K].
// bits: 16 = bfloat16, 8 = Q8_0 blocks, 4 = Q4_1 blocks.
void widen_rows(const at::Tensor& w, int64_t bits, int64_t n0, int64_t rows, int64_t K, float* out) {
  if (bits == 16) {
    const bf16_t* W = reinterpret_cast<const bf16_t*>(w.data_ptr<at::BFloat16>()) + n0 * K;
    for (int64_t i = 0; i < rows * K; i += 8) store8(out + i, load8(W + i));
    return;
  }
  const int64_t blk = bits == 4 ? kQ4Block : kQ8Block, row_bytes = K / 32 * blk;
  const uint8_t* W = w.data_ptr<uint8_t>() + n0 * row_bytes;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* p = W + r * row_bytes + b * blk;
      const __m256 dv = _mm256_set1_ps(half_at(p));
      float* o = out + r * K + b * 32;
      if (bits == 8) {
        for (int j = 0; j < 4; ++j)
          store8(o + 8 * j, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + 8 * j))))));
      } else {
        const __m256 mv = _mm256_set1_ps(half_at(p + 2));
        const __m256i q = unpack32_u4(p + 4);
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; ++j)
          store8(o + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), dv, mv));
      }
    }
}

}  // namespace

// y = x @ W^T (+ bias) for any M: panels of `panel` rows of W are widened to
// float32 (they stay in cache) and multiplied with the BLAS (MKL / OpenBLAS sgemm,
// itself multi-threaded). bits as in widen_rows.
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& w, int64_t bits,
                          const c10::optional<at::Tensor>& bias, int64_t panel) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be contiguous 2-d");
  int64_t K = w.size(1);
  if (bits == 16) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "bits=16 takes a bfloat16 weight");
  } else {
    TORCH_CHECK((bits == 4 || bits == 8) && w.scalar_type() == at::kByte, "bits must be 16, 8 or 4");
    const int64_t blk = bits == 4 ? kQ4Block : kQ8Block;
    TORCH_CHECK(K % blk == 0, "quantized weight rows must be whole blocks");
    K = K / blk * 32;
  }
  check_x(x, K);
  const int64_t M = x.size(0), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  auto buf = at::empty({std::min(panel, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += panel) {
    const int64_t rows = std::min(panel, N - n0);
    auto wp = buf.narrow(0, 0, rows);
    widen_rows(w, bits, n0, rows, K, wp.data_ptr<float>());
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
