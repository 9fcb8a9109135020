// AVX2 + FMA + F16C helpers shared by the kernels: loads that widen bf16 / fp16 /
// fp32 to 8 fp32 lanes, a vectorised exp, horizontal sums, bf16 rounding stores.
// Every x86-64 CPU pdserve targets (Haswell / Zen and newer, AVX-512 parts included)
// runs these; the build compiles with -mavx2 -mfma -mf16c.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pdk {

// X(0) ... X(11): twelve independent register chains in the peak loops (gemm.cpp,
// w8a8.cpp), named variables so that the compiler keeps each in a register.
#define PDK_REP12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

using bf16_t = uint16_t;  // raw bfloat16 bits (c10::BFloat16 has the same layout)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const bf16_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// x float32 [count] -> bfloat16, round to nearest even (VCVTNEPS2BF16, which reads and
// writes subnormals as zero). gemm.cpp; callable on AVX512-BF16 CPUs only.
void to_bf16(const float* x, int64_t count, bf16_t* out);

// Round to nearest even, as torch's float -> bfloat16 conversion (NaNs stay NaNs
// because their exponent bits are kept; the mantissa rounding cannot carry them to inf).
inline void store8(bf16_t* p, __m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  __m256i hi = _mm256_srli_epi32(rounded, 16);
  // pack 8 x u32 (each < 65536) to 8 x u16
  __m128i lo128 = _mm256_castsi256_si128(hi);
  __m128i hi128 = _mm256_extracti128_si256(hi, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo128, hi128));
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_float(float v, float* out) { *out = v; }
inline void from_float(float v, bf16_t* out) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  *out = static_cast<bf16_t>(u >> 16);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 lanes: range reduction x = n ln2 + r, |r| <= ln2/2, degree-6
// polynomial (Cephes expf), relative error ~2e-7. exp(-inf) = 0; inputs below
// -87.3 flush to 0, above 88.3 saturate.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 lo = _mm256_set1_ps(-87.3365478515625f);
  __m256 below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(below, out);
}

// Asks for every cache line of [p, p + bytes) ahead of its use.
inline void prefetch_region(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// The same into L2 only.
inline void prefetch_region_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

}  // namespace pdk
