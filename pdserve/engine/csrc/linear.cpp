// int8 weight-only linear layers: y[M, N] = x[M, K] @ W^T + b, for every M.
// (Dense float32 / bfloat16 weights are gemm.cpp's, int4 int4.cpp's.)
//
// Weights stay row-major [N, K] as checkpoints store them, in GGUF's own block
// layout, so a GGUF file's tensors are used as they are (one contiguous stream
// per row, scales next to their weights):
//
//   int8   Q8_0 blocks [N][K / 32]  34 bytes: d (fp16), q[32] (int8)     w = d * q
//
// A per-output-channel scale is the same layout with the scale repeated in each block.
//
// Rows of W are processed R at a time against up to 8 rows of x, so that R*M
// accumulators live in registers; each output element is summed over K in the
// same order whatever M is and wherever its row lands (batch invariance by
// construction). For large M, chunks of x and of W's rows are taken so that both
// stay in cache (for_row_blocks).
//
// x is float32 [M, K] contiguous; y float32 [M, N]. K must be a multiple of 32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "args.h"
#include "vec.h"

namespace pdk {
namespace {

constexpr int64_t kRowGrain = 16;  // rows of W per parallel task (at least)

// ------------------------------------------------------------ int8 weights
// The weights meet x quantized to int16 per 32 values (scale sx = max|x| / 32767,
// so x keeps ~15 bits: the result matches the dequantized weights' matmul to float
// rounding): 16-bit products summed pairwise into int32 (no overflow:
// 2 * 128 * 32767 < 2^31), then scaled in float by sx * d.
constexpr int64_t kQ8Block = 34;

struct QuantizedX {
  std::vector<int16_t> q;   // [M][K]
  std::vector<float> scale; // [M][K / 32]
};

QuantizedX quantize_x(const float* x, int64_t M, int64_t K) {
  QuantizedX out;
  out.q.resize(M * K);
  out.scale.resize(M * (K / 32));
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
      for (int i = 0; i < 4; ++i)
        i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest even
      out.scale[m * (K / 32) + b] = sx;
      // 32 x int32 -> 32 x int16; packs work per 128-bit lane, a permute restores order
      int16_t* dst = out.q.data() + m * K + b * 32;
      for (int i = 0; i < 4; i += 2) {
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[i], i32[i + 1]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * i), p);
      }
    }
  return out;
}

// 32 weights (int16, two registers) . 32 quantized x (int16) -> 8 float partial sums.
inline __m256 dot32(const __m256i w[2], const int16_t* xq) {
  const __m256i a = _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  const __m256i b = _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
}

template <int M>
constexpr int int_rows_per_pass() { return M <= 2 ? 4 : (M <= 4 ? 2 : 1); }

// xq / sx_: x quantized (rows of K and K / 32 values), see quantize_x.
template <int M>
void q8_small(const int16_t* xq, const float* sx_, int64_t K, const uint8_t* W, int64_t n0,
              int64_t n1, float* y, int64_t N, const float* bias) {
  constexpr int R = int_rows_per_pass<M>();
  constexpr int64_t BLK = kQ8Block;
  const int64_t nb = K / 32, row_bytes = nb * BLK;
  auto pass = [&](int64_t n, auto rows_tag) {
    constexpr int RR = decltype(rows_tag)::value;
    __m256 acc[RR][M];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    // The next pass's rows (contiguous after these) are prefetched as this pass goes:
    // quantized rows are short streams the hardware prefetcher does not ramp up on.
    const uint8_t* next = W + (n + RR) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t off = b * RR * BLK; off < (b + 1) * RR * BLK; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
      __m256i w[RR][2];
      float dr[RR];
      for (int r = 0; r < RR; ++r) {
        const uint8_t* blk = W + (n + r) * row_bytes + b * BLK;
        // d is the block's first fp16 value
        dr[r] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int16_t*>(blk))));
        w[r][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
        w[r][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
      }
      for (int m = 0; m < M; ++m) {
        const float sx = sx_[m * nb + b];
        for (int r = 0; r < RR; ++r)
          acc[r][m] = _mm256_fmadd_ps(dot32(w[r], xq + m * K + b * 32), _mm256_set1_ps(dr[r] * sx), acc[r][m]);
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

template <int M> struct Int8F { template <typename... A> static void run(A... a) { q8_small<M>(a...); } };

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got ", K);
}

// Runs fn(rows [n0, n1), m0, mlen) over chunks of at most kMaxSmallM rows of x,
// rows of W split across threads; x is taken kChunkM rows and W kChunkN rows at a
// time so that both stay in cache while the other streams past.
constexpr int64_t kChunkM = 128, kChunkN = 64;

template <typename Fn>
void for_row_blocks(int64_t M, int64_t N, Fn fn) {
  at::parallel_for(0, N, kRowGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t mc = 0; mc < M; mc += kChunkM)
      for (int64_t nc = n0; nc < n1; nc += kChunkN)
        for (int64_t m0 = mc; m0 < std::min(M, mc + kChunkM); m0 += kMaxSmallM)
          fn(nc, std::min(n1, nc + kChunkN), m0, std::min<int64_t>(kMaxSmallM, M - m0));
  });
}

}  // namespace

// int8: Q8_0 blocks, [N, K / 32 * 34] uint8.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(1) % kQ8Block == 0,
              "int8: the weight must be contiguous uint8 Q8_0 blocks [N, K / 32 * 34]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1) / kQ8Block * 32;
  check_x(x, K);
  auto y = at::empty({M, N}, x.options());
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K);
  float* yp = y.data_ptr<float>();
  const float* b = bias_ptr(bias, N);
  const uint8_t* W = w.data_ptr<uint8_t>();
  for_row_blocks(M, N, [&](int64_t n0, int64_t n1, int64_t m0, int64_t mm) {
    const int16_t* q = xq.q.data() + m0 * K;
    const float* sx = xq.scale.data() + m0 * (K / 32);
    by_m<Int8F>(mm, q, sx, K, W, n0, n1, yp + m0 * N, N, b);
  });
  return y;
}

}  // namespace pdk
