// Weight-only quantized linear layers, GGUF blocks x activations quantized to int8
// (as llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0), y float32, for every M:
//
//   int4  Q4_1: W[n, b] = d[n, b] * q[n, b] + mn[n, b]   q in 0..15, per block b of 32
//   int8  Q8_0: W[n, b] = d[n, b] * q[n, b]              q in -128..127
//   x[m, b] ~ dx[m, b] * qx[m, b]            quantize.h, blocks of 32, qx in -127..127
//   sx[m, b] = dx[m, b] * float(sum of qx[m, b])
//   y[m, n] = (sum over b, in order, of  ((float(dot_b) * dx) * d) [+ mn * sx])  + bias[n]
//
// dot_b = sum over the block of q * qx is an integer, exact in any order; the float
// part is the same operations in the same order in every family and tile. So a
// row's result is bit-identical however it is batched and on every CPU class, and
// quant.quantized_reference equals it bit for bit (tests/engine/test_gemm.py).
//
// Weights are repacked at load (pack_quantized) from the GGUF rows into groups of
// outputs, each group one contiguous stream:
//
//   int4 group (w outputs), per block: [4 steps of 8 inputs][w outputs][4 bytes],
//        byte j = q[8 s + j] | q[8 s + 4 + j] << 4; then d[w], mn[w] (fp16): 20 bytes
//        per 32 weights, as Q4_1
//   int8 group, per block: [8 steps of 4 inputs][w outputs][4 bytes] (int8), then
//        d[w] (fp16) and the block's sum of q[w] (int16, for VNNI's offset): 36 bytes
//
// so one register of 4-byte lanes holds 8 or 16 outputs' next 4 inputs (int4: a
// mask, and a shift and mask, give two such registers from 8 nibbles), each against
// 4 bytes of x broadcast.
//
//   avx2        groups of 32 outputs, 8 per register, vpmaddubsw (unsigned x signed
//               bytes, pairs summed to int16): int4 sums its 8 per block in int16 (at
//               most 8 * 2 * 15 * 127 = 30480), int8 takes |q| and x with q's sign
//               (at most 2 * 128 * 127 per pair); then vpmaddwd by 1 to int32.
//   avx512vnni  groups of 64 outputs, 16 per register, vpdpbusd (4 products summed
//               into int32 per instruction): int4 nibbles are its unsigned operand;
//               for int8, x + 128 is, and 128 * the block's sum of q is taken off.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <vector>

#include "args.h"
#include "families.h"
#include "quantize.h"
#include "vec.h"

namespace pdk {
namespace {

constexpr int64_t kChunkM = 128;  // rows of x per cache chunk

// Per output and block of 32: weight bytes, and those plus the two 16-bit scales.
template <int BITS> constexpr int64_t weight_bytes() { return BITS == 4 ? 16 : 32; }
template <int BITS> constexpr int64_t block_bytes() { return weight_bytes<BITS>() + 4; }
int64_t block_bytes(int64_t bits) { return bits == 4 ? block_bytes<4>() : block_bytes<8>(); }
int64_t gguf_block_bytes(int64_t bits) { return bits == 4 ? 20 : 34; }  // Q4_1, Q8_0

int64_t group_of(int64_t family) { return family == kAvx2 ? 32 : 64; }

int64_t padded16(int64_t N) { return (N + 15) / 16 * 16; }

// A group's first row tile streams its weights from memory (a decode step reads each
// weight once; later tiles find the group in cache): each block of it prefetches the
// block kPrefetchBlocks ahead, past the group's end into the thread's next group.
// The hardware prefetcher alone left one decode row at 13.6 GB/s of 22 on two threads
// (AMX-class Xeon, int4); 4 blocks ahead took the matmuls of a step ~28% (avx2) and
// 10-24% (avx512vnni) faster. Results are unchanged: it only loads lines early.
constexpr int64_t kPrefetchBlocks = 4;

// Rows [0, MR) of x against NP registers of 8 outputs from column `col` of a group
// of w outputs (P: the group's first block).
template <int BITS, int MR, int NP>
void avx2_tile(const int8_t* x, int64_t K, const uint8_t* P, int64_t w, int64_t col,
               const float* dx, const float* sx, const float* bias, float* y, int64_t N,
               int64_t n0, bool pf) {
  constexpr int64_t WB = weight_bytes<BITS>(), BB = block_bytes<BITS>();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const auto* x4 = reinterpret_cast<const int32_t*>(x);
  const int64_t nb = K / 32, K4 = K / 4;
  __m256 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = P + b * w * BB;
    if (pf) prefetch_region(blk + kPrefetchBlocks * w * BB, w * BB);
    __m256i t[MR][NP];  // int4: int16 pair sums; int8: int32 sums
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < NP; ++p) t[m][p] = _mm256_setzero_si256();
    if constexpr (BITS == 4) {
      for (int s = 0; s < 4; ++s) {
        __m256i lo[NP], hi[NP];
        for (int p = 0; p < NP; ++p) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + (s * w + col + p * 8) * 4));
          lo[p] = _mm256_and_si256(v, low);
          hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i xl = _mm256_set1_epi32(x4[m * K4 + b * 8 + 2 * s]);
          const __m256i xh = _mm256_set1_epi32(x4[m * K4 + b * 8 + 2 * s + 1]);
          for (int p = 0; p < NP; ++p)
            t[m][p] = _mm256_add_epi16(t[m][p], _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xl),
                                                                  _mm256_maddubs_epi16(hi[p], xh)));
        }
      }
      for (int m = 0; m < MR; ++m)
        for (int p = 0; p < NP; ++p) t[m][p] = _mm256_madd_epi16(t[m][p], ones);
    } else {
      for (int s = 0; s < 8; ++s) {
        __m256i v[NP], mag[NP];
        for (int p = 0; p < NP; ++p) {
          v[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (s * w + col + p * 8) * 4));
          mag[p] = _mm256_abs_epi8(v[p]);  // |q| as unsigned (|-128| = 128)
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i xb = _mm256_set1_epi32(x4[m * K4 + b * 8 + s]);
          for (int p = 0; p < NP; ++p)
            t[m][p] = _mm256_add_epi32(t[m][p], _mm256_madd_epi16(
                _mm256_maddubs_epi16(mag[p], _mm256_sign_epi8(xb, v[p])), ones));
        }
      }
    }
    for (int p = 0; p < NP; ++p) {
      const int64_t c = col + p * 8;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + w * WB + c * 2)));
      for (int m = 0; m < MR; ++m) {
        const __m256 f = _mm256_cvtepi32_ps(t[m][p]);
        acc[m][p] = _mm256_add_ps(acc[m][p], _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(dx[m * nb + b])), d));
      }
      if constexpr (BITS == 4) {
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + w * (WB + 2) + c * 2)));
        for (int m = 0; m < MR; ++m)
          acc[m][p] = _mm256_add_ps(acc[m][p], _mm256_mul_ps(mn, _mm256_set1_ps(sx[m * nb + b])));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) {
      const int64_t n = n0 + p * 8;
      if (n >= N) continue;
      alignas(32) float out[8];
      store8(out, acc[m][p]);
      for (int64_t i = 0; i < std::min<int64_t>(8, N - n); ++i)
        y[m * N + n + i] = bias ? out[i] + bias[n + i] : out[i];
    }
}

// One group (w = 16 or 32 outputs) for M rows: tiles of 2 rows x 2 registers.
template <int BITS>
void avx2_group(const int8_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t w,
                const float* dx, const float* sx, const float* bias, float* y, int64_t N,
                int64_t n0) {
  const int64_t nb = K / 32;
  for (int64_t col = 0; col < w; col += 16) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2)
      avx2_tile<BITS, 2, 2>(x + m * K, K, P, w, col, dx + m * nb, sx + m * nb, bias, y + m * N,
                            N, n0 + col, m == 0 && col == 0);
    if (m < M)
      avx2_tile<BITS, 1, 2>(x + m * K, K, P, w, col, dx + m * nb, sx + m * nb, bias, y + m * N,
                            N, n0 + col, m == 0 && col == 0);
  }
}

}  // namespace

// Compiled for AVX512 here only; called only where the CPU has AVX512-VNNI. Nothing
// in this region is a template or inline function another file could instantiate.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace {

template <int BITS, int MR, int NP>
void vnni_tile(const uint8_t* x, int64_t K, const uint8_t* P, int64_t w, const float* dx,
               const float* sx, const float* bias, float* y, int64_t N, int64_t n0, bool pf) {
  constexpr int64_t WB = weight_bytes<BITS>(), BB = block_bytes<BITS>();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const auto* x4 = reinterpret_cast<const int32_t*>(x);
  const int64_t nb = K / 32, K4 = K / 4;
  __m512 acc[MR][NP];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = P + b * w * BB;
    if (pf) prefetch_region(blk + kPrefetchBlocks * w * BB, w * BB);
    __m512i t[MR][NP];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) t[m][p] = _mm512_setzero_si512();
    if constexpr (BITS == 4) {  // nibbles unsigned, x signed
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        __m512i lo[NP], hi[NP];
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) {
          const __m512i v = _mm512_loadu_si512(blk + (s * w + p * 16) * 4);
          lo[p] = _mm512_and_si512(v, low);
          hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          const __m512i xl = _mm512_set1_epi32(x4[m * K4 + b * 8 + 2 * s]);
          const __m512i xh = _mm512_set1_epi32(x4[m * K4 + b * 8 + 2 * s + 1]);
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p)
            t[m][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t[m][p], lo[p], xl), hi[p], xh);
        }
      }
    } else {  // x + 128 unsigned, weights signed; 128 * sum(q) taken off after
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        __m512i v[NP];
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) v[p] = _mm512_loadu_si512(blk + (s * w + p * 16) * 4);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          const __m512i xb = _mm512_set1_epi32(x4[m * K4 + b * 8 + s]);
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p) t[m][p] = _mm512_dpbusd_epi32(t[m][p], xb, v[p]);
        }
      }
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        const __m512i off = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(blk + w * (WB + 2) + p * 32))), 7);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) t[m][p] = _mm512_sub_epi32(t[m][p], off);
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + w * WB + p * 32)));
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m512 f = _mm512_cvtepi32_ps(t[m][p]);
        acc[m][p] = _mm512_add_ps(acc[m][p], _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(dx[m * nb + b])), d));
      }
      if constexpr (BITS == 4) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + w * (WB + 2) + p * 32)));
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m)
          acc[m][p] = _mm512_add_ps(acc[m][p], _mm512_mul_ps(mn, _mm512_set1_ps(sx[m * nb + b])));
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const int64_t n = n0 + p * 16;
      if (n >= N) continue;
      const __mmask16 mask = N - n >= 16 ? static_cast<__mmask16>(0xFFFF)
                                         : static_cast<__mmask16>((1u << (N - n)) - 1);
      __m512 v = acc[m][p];
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n));
      _mm512_mask_storeu_ps(y + m * N + n, mask, v);
    }
}

template <int BITS, int NP>
void vnni_group(const uint8_t* x, int64_t M, int64_t K, const uint8_t* P, const float* dx,
                const float* sx, const float* bias, float* y, int64_t N, int64_t n0) {
  constexpr int64_t w = NP * 16;
  const int64_t nb = K / 32;
  int64_t m = 0;
  for (; m + 2 <= M; m += 2)
    vnni_tile<BITS, 2, NP>(x + m * K, K, P, w, dx + m * nb, sx + m * nb, bias, y + m * N, N, n0,
                           m == 0);
  if (m < M)
    vnni_tile<BITS, 1, NP>(x + m * K, K, P, w, dx + m * nb, sx + m * nb, bias, y + m * N, N, n0,
                           m == 0);
}

template <int BITS>
void vnni_groups(const uint8_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t n_pad,
                 const float* dx, const float* sx, const float* bias, float* y, int64_t N,
                 int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * 64, width = std::min<int64_t>(64, n_pad - n0);
    const uint8_t* Pg = P + n0 * (K / 32) * block_bytes<BITS>();
    switch (width / 16) {
      case 4: vnni_group<BITS, 4>(x, M, K, Pg, dx, sx, bias, y, N, n0); break;
      case 3: vnni_group<BITS, 3>(x, M, K, Pg, dx, sx, bias, y, N, n0); break;
      case 2: vnni_group<BITS, 2>(x, M, K, Pg, dx, sx, bias, y, N, n0); break;
      default: vnni_group<BITS, 1>(x, M, K, Pg, dx, sx, bias, y, N, n0); break;
    }
  }
}

void vnni_dispatch(int64_t bits, const uint8_t* x, int64_t M, int64_t K, const uint8_t* P,
                   int64_t n_pad, const float* dx, const float* sx, const float* bias, float* y,
                   int64_t N, int64_t g0, int64_t g1) {
  if (bits == 4) vnni_groups<4>(x, M, K, P, n_pad, dx, sx, bias, y, N, g0, g1);
  else vnni_groups<8>(x, M, K, P, n_pad, dx, sx, bias, y, N, g0, g1);
}

}  // namespace
#pragma GCC pop_options

// GGUF blocks (uint8 [N, K / 32 * 20] Q4_1 or [N, K / 32 * 34] Q8_0, quant.py) -> the
// family's packed layout (1-d).
at::Tensor pack_quantized(const at::Tensor& w, int64_t bits, int64_t family) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(family == kAvx2 || family == kAvx512, "unknown integer family ", family);
  const int64_t gb = gguf_block_bytes(bits);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(0) >= 1 && w.size(1) >= gb && w.size(1) % gb == 0,
              "the weight must be contiguous uint8 ", bits == 4 ? "Q4_1" : "Q8_0",
              " blocks [N, K / 32 * ", gb, "]");
  const int64_t N = w.size(0), nb = w.size(1) / gb, n_pad = padded16(N);
  at::Tensor blocks = at::zeros({n_pad, nb, gb}, w.options());
  blocks.narrow(0, 0, N).copy_(w.view({N, nb, gb}));
  at::Tensor packed, second;  // packed [n, b, step, 4 bytes]; second 16-bit value [n, b, 2]
  if (bits == 4) {
    // nibble byte j of a Q4_1 block: q[j] low, q[j + 16] high -> q[0..31] in order
    const at::Tensor nib = blocks.narrow(2, 4, 16);
    const at::Tensor q = at::cat({nib.bitwise_and(0x0F), nib.bitwise_right_shift(4)}, 2);
    // [n, b, step, half, j] -> byte (n, b, step, j) = q[8 step + j] | q[8 step + 4 + j] << 4
    const at::Tensor qs = q.view({n_pad, nb, 4, 2, 4});
    packed = qs.select(3, 0).bitwise_or(qs.select(3, 1).bitwise_left_shift(4));
    second = blocks.narrow(2, 2, 2);  // mn
  } else {
    const at::Tensor q = blocks.narrow(2, 2, 32);
    packed = q.reshape({n_pad, nb, 8, 4});
    second = q.view(at::kChar).sum(2, false, at::kShort).unsqueeze(2).view(at::kByte);
  }
  const int64_t group = group_of(family);
  std::vector<at::Tensor> parts;
  for (int64_t g0 = 0; g0 < n_pad; g0 += group) {
    const int64_t width = std::min(group, n_pad - g0);
    // per block: [step][output][4 bytes], d[output] (2 bytes each), second[output]
    const at::Tensor weights = packed.narrow(0, g0, width).permute({1, 2, 0, 3}).reshape({nb, -1});
    const at::Tensor d = blocks.narrow(0, g0, width).narrow(2, 0, 2).permute({1, 0, 2}).reshape({nb, -1});
    const at::Tensor s2 = second.narrow(0, g0, width).permute({1, 0, 2}).reshape({nb, -1});
    parts.push_back(at::cat({weights, d, s2}, 1).view(-1));
  }
  return at::cat(parts);
}

// y = x @ W^T (+ bias), W packed by pack_quantized for `family` from an [N, K] weight.
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t bits,
                      int64_t family, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(family == kAvx2 || family == kAvx512, "unknown integer family ", family);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), n_pad = padded16(N), bb = block_bytes(bits);
  TORCH_CHECK(K >= 32 && K % 32 == 0, "quantized layers: K must be a multiple of 32, got ", K);
  TORCH_CHECK(N >= 1 && packed.scalar_type() == at::kByte && packed.dim() == 1 &&
                  packed.is_contiguous() && packed.numel() == n_pad * (K / 32) * bb,
              "x has ", K, " columns; the packed weight is not pack_quantized's of an [", N,
              ", ", K, "] int", bits, " weight");
  const float* b = bias_ptr(bias, N);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t nb = K / 32;
  const bool offset = family == kAvx512 && bits == 8;  // x is vpdpbusd's unsigned operand
  std::vector<int8_t> q(M * K);
  std::vector<float> dx(M * nb), sx(M * nb, 0.f);
  quantize_rows(x.data_ptr<float>(), M, K, 32, offset ? QxForm::kU8Offset : QxForm::kS8,
                q.data(), dx.data());
  if (bits == 4)  // the min term's sum of x, from the quantized x
    at::parallel_for(0, M * nb, kQuantizeGrain / 32, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        int32_t s = 0;
        for (int64_t j = 0; j < 32; ++j) s += q[i * 32 + j];
        sx[i] = dx[i] * static_cast<float>(s);
      }
    });
  const uint8_t* P = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t group = group_of(family), groups = (n_pad + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
      const int64_t mm = std::min(kChunkM, M - m0);
      const int8_t* xr = q.data() + m0 * K;
      const float* dxm = dx.data() + m0 * nb;
      const float* sxm = sx.data() + m0 * nb;
      if (family == kAvx512) {
        vnni_dispatch(bits, reinterpret_cast<const uint8_t*>(xr), mm, K, P, n_pad, dxm, sxm, b,
                      yp + m0 * N, N, g0, g1);
        continue;
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * group, width = std::min(group, n_pad - n0);
        const uint8_t* Pg = P + n0 * nb * bb;
        if (bits == 4) avx2_group<4>(xr, mm, K, Pg, width, dxm, sxm, b, yp + m0 * N, N, n0);
        else avx2_group<8>(xr, mm, K, Pg, width, dxm, sxm, b, yp + m0 * N, N, n0);
      }
    }
  });
  return y;
}

}  // namespace pdk
