// What the paged attention's kernel families share (attention.cpp: the float32 one
// and the dispatcher; attention_bf16.cpp: the bfloat16 dot products', for bfloat16
// caches): the cache's geometry, a task's signature and its last step.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <c10/util/Exception.h>

#include "families.h"
#include "vec.h"

namespace pdk {

constexpr int kMaxBlock = 64;   // slots per KV block the kernel handles
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Geometry {  // of one layer's cache, as a task sees it (KVH: the task's kv heads)
  int64_t slot_stride, head_stride, kv_stride, block_stride;  // elements
  int KVH, G, BS;
};

// Loads the keys and values of the task's kv heads in cache block `block` (a task's
// cache pointer is at its first head's keys; values are kv_stride after them).
template <typename T>
inline void prefetch_kv(const T* cache, const Geometry& g, int32_t block) {
  const T* k = cache + static_cast<int64_t>(block) * g.block_stride;
  const int64_t bytes = g.KVH * g.head_stride * static_cast<int64_t>(sizeof(T));
  prefetch_region(k, bytes);
  prefetch_region(k + g.kv_stride, bytes);
}

// out[qi, head] = O[row] / l[row] for a task's rows r = (kvh * nq + qi) * G + gi
// (head kvh * G + gi of query token qi); rows that attended to nothing are zeros.
template <int D>
inline void write_rows(float* out, int64_t out_row_stride, const float* O, const float* l,
                       int KVH, int nq, int G) {
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int qi = 0; qi < nq; ++qi)
      for (int gi = 0; gi < G; ++gi) {
        const int r = (kvh * nq + qi) * G + gi;
        float* dst = out + qi * out_row_stride + (kvh * G + gi) * D;
        const __m256 iv = _mm256_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
        for (int d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(load8(O + r * D + d), iv));
      }
}

// A tile of nq query tokens at positions first_pos .. of one sequence whose context
// is ctx tokens in blocks `blocks`: out[qi, head] for every head (q and out rows
// q_row_stride / out_row_stride apart; q float32, already rotated).
template <typename T>
using TileFn = void (*)(const float* q, int64_t q_row_stride, float* out, int64_t out_row_stride,
                        const T* cache, const Geometry& g, const int32_t* blocks, int64_t ctx,
                        int64_t first_pos, int nq, float scale);

// pick(std::integral_constant<int, D>) for a head_dim D the kernels support (each
// family's task is a template of D, so that a row's accumulators stay in registers).
template <typename Pick>
auto by_head_dim(int64_t D, Pick pick) {
  switch (D) {
    case 16: return pick(std::integral_constant<int, 16>{});
    case 32: return pick(std::integral_constant<int, 32>{});
    case 64: return pick(std::integral_constant<int, 64>{});
    case 80: return pick(std::integral_constant<int, 80>{});
    case 96: return pick(std::integral_constant<int, 96>{});
    case 128: return pick(std::integral_constant<int, 128>{});
    case 256: return pick(std::integral_constant<int, 256>{});
    default: TORCH_CHECK(false, "head_dim ", D, " is not supported by the CPU attention kernel");
  }
}

// paged_attention's kernel families (families.h): float32 FMA (kAvx2: attend_tile,
// every cache) and the bfloat16 dot products' (a bfloat16 cache): AVX512-BF16's
// (kAvx512) and the tile unit's (kAmx).

// The bfloat16 families (attention_bf16.cpp) for head_dim D: the tile unit's (amx)
// or AVX512-BF16's; and the query tokens one of their tasks holds (a chunk's keys are
// transposed once per task: 64 tokens share that cost four times as widely as 16 did,
// a 7,680-token prompt's attention 0.84x the time; a 512-token step is still 8 tasks).
TileFn<bf16_t> bf16_tile_fn(int64_t D, bool amx);
constexpr int kBf16TileQ = 64;

}  // namespace pdk
