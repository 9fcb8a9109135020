// The activation quantizer shared by the integer kernels (w8a8.cpp, quant_gemm.cpp): rows
// of float32 x, per row and group of G values (G a multiple of 16),
//
//   sx[m][g] = max|x[m, g]| / 127,   q = round(x * (127 / max|x|)), in -127..127
//
// rounded to nearest even (the default MXCSR mode, as torch.round); clamping before
// rounding equals clamping after, 127 being whole. quant.quantize_rows is the same
// arithmetic in torch. q is written in the form the kernel's multiply wants.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace pdk {

// Values of x a thread quantizes at least (a decode step's few rows stay on one).
constexpr int64_t kQuantizeGrain = 32768;

enum class QxForm {
  kU8Offset,  // uint8 q + 128 (vpdpbusd's unsigned operand, against int8 weights)
  kS8,        // int8 q (the signed operand of vpdpbusd / vpmaddubsw: against nibbles or |qw|)
};

// Rows are shared among the threads (each row's arithmetic is its own). On one thread
// while the others waited, a 1,024-token prefill took 1.10x (W8A8) and 1.06x (int4)
// as long (AMX Xeon, two threads, alternated in one process).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, QxForm form,
                          void* q, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.f), lo = _mm256_set1_ps(-127.f),
               hi = _mm256_set1_ps(127.f);
  const __m256i offset = _mm256_set1_epi16(128);
  const int64_t ng = K / G;
  at::parallel_for(0, M, std::max<int64_t>(1, kQuantizeGrain / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < ng; ++g) {
        const float* r = x + m * K + g * G;
        __m256 mx = _mm256_setzero_ps();
        for (int64_t k = 0; k < G; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(r + k)));
        const float amax = hmax(mx);
        sx[m * ng + g] = amax / 127.f;
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        const int64_t i0 = m * K + g * G;
        for (int64_t k = 0; k < G; k += 16) {
          const __m256i a = _mm256_cvtps_epi32(
              _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(load8(r + k), inv))));
          const __m256i b = _mm256_cvtps_epi32(
              _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(load8(r + k + 8), inv))));
          // 16 x int16 in order (packs works per 128-bit lane; the permute restores it)
          const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
          const __m256i p8 = form == QxForm::kS8
              ? _mm256_permute4x64_epi64(_mm256_packs_epi16(p16, p16), 0x08)
              : _mm256_permute4x64_epi64(_mm256_packus_epi16(_mm256_add_epi16(p16, offset),
                                                             _mm256_add_epi16(p16, offset)), 0x08);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(q) + i0 + k),
                           _mm256_castsi256_si128(p8));
        }
      }
  });
}

}  // namespace pdk
