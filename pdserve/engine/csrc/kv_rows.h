// One row of the KV cache (one token's key or value for one kv head), written from
// and widened to float32. float32 / bfloat16 rows are head_dim values; an int8 row is
// head_dim int8 values and then the row's float32 scale (4 bytes):
//
//   scale = max|x| / 127,  q = round_half_even(x * (127 / max|x|)),  x ~ q * scale
//
// bit for bit as pdserve/engine/kv_cache.py computes it (the torch reference).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace pdk {

constexpr int kKvScaleBytes = 4;

template <typename T>
inline void write_row(T* dst, const float* x, int64_t D) {
  for (int64_t i = 0; i < D; i += 8) store8(dst + i, load8(x + i));
}

inline void write_row(int8_t* dst, const float* x, int64_t D) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(x + i)));
  const float amax = hmax(mx);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const float scale = amax / 127.f;
  const __m256 iv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int64_t i = 0; i < D; i += 8) {
    // nearest even under the default rounding mode, as torch.round
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + i), iv));
    q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(w, w));
  }
  std::memcpy(dst + D, &scale, sizeof(float));
}

template <typename T>
inline void widen_row(const T* row, float* out, int64_t D) {
  for (int64_t i = 0; i < D; i += 8) store8(out + i, load8(row + i));
}

inline void widen_row(const int8_t* row, float* out, int64_t D) {
  float scale;
  std::memcpy(&scale, row + D, sizeof(float));
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < D; i += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i));
    store8(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv));
  }
}

}  // namespace pdk
