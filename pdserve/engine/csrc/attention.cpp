// Paged attention that reads K/V in place from the block-major KV cache.
//
//   kv_cache[block, layer, 0 = K | 1 = V, kv head, slot (block_size), row]
//
// (a row: head_dim float32 / bfloat16 values, or head_dim int8 values and their scale,
// kv_rows.h; anything but float32 is widened to float32 as it is read).
// (heads outside slots: one head's keys of a block are contiguous, and so is any range
// of heads -- what a tensor-parallel KV hand-off moves).
//
// One call covers a whole step: decodes (1 query token, attending to the whole
// context) and prefill chunks (n query tokens at positions ctx-n .. ctx-1, each
// attending causally to the cached prefix and to the chunk). For sequence s:
//
//   queries  q[q_start[s] : q_start[s] + q_len[s]]           (this step's tokens)
//   context  ctx_len[s] tokens in blocks block_table[seq_row[s], 0 .. ]
//
// The K/V of this step's tokens are already in the cache (written before the call).
// Work is split into tasks (sequence, tile of up to kTileQ query tokens, range of kv
// heads); a task holds the tile's queries of those heads and walks the context block
// by block (the heads' keys of a block, then their values, read in order while the
// next block's are prefetched), keeping an online softmax per query row, so nothing
// is gathered and memory use is O(tile) whatever the context length. A task takes
// every kv head, unless the step has fewer tiles than threads: then a tile whose
// context is long (kSplitContext) is one task per kv head, so that a single long
// sequence's decode uses every thread, not one while the others wait. Threads take
// the tasks one at a time, longest first (query tokens x context x kv heads): split
// into equal runs in order, a causal prefill's first half of tiles (contexts 16 ..
// 512 of 1,024) went to one thread and the three times longer second half to the
// other. Which thread runs a task never changes its rows' bits.
//
// Rows of a task: r = (kv head, query token, head in the group), so each kv head's
// rows are contiguous. Every row goes through the same operations in the same order
// (attend_tile), whatever step it comes in: a decode, a speculative verification, a
// prefill tile of any size, beside any other sequences. So a token's output bits are
// a function of its query, its position and the cache only -- prefill KV equals
// decode KV, chunked prefill equals unchunked. Rows are paired only to share loads.
// head_dim is a template parameter so that the per-row accumulators stay in
// registers.
//
// That is this file's family (float32 FMA, every cache dtype). The bfloat16 dot
// products' (attention_bf16.cpp, a bfloat16 cache: AVX512-BF16 or the tile unit) run
// the same tasks with their own operations; the caller picks one family per engine
// (`family`), so every row of every step goes through the same one.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "attention.h"
#include "kv_rows.h"

namespace pdk {
namespace {

constexpr int kTileQ = 8;       // query tokens per task
constexpr int kChunkSlots = 32; // slots per softmax update
// Context (tokens) from which a tile is split by kv head when the step has fewer tiles
// than threads. SmolLM2-135M (3 kv heads: at best 2/3 of the time on two threads), one
// decoding sequence, bf16, two threads, AMX Xeon, three runs each: attention took
// 5.3-5.7 -> 4.5-4.8 ms of a step at 1,024 tokens, 10.1-12.7 -> 8.9-9.2 at 2,048,
// 27.4-28.9 -> 19.8-24.1 at 6,000. Split at every length, the step at 128 tokens
// (attention ~1.6 ms in 30 calls) was ~5% slower: each call became a parallel region.
// From 512 rather than 1,024 tokens (2026-12-05, same machine, the fused decoder, the
// two thresholds toggled in one process, contexts 512-900): int4 1.60 -> 1.45 ms a
// token, bf16 4.27 -> 4.03; from 256, contexts 100-480 were level to 4% slower.
constexpr int64_t kSplitContext = 512;
// A task prefetches the next chunk's blocks into L1 and, for each kv head, the blocks
// 8 chunks (256 slots) ahead into L2: a decode at 7,680 tokens of context, whose KV
// (177 MB) comes from DRAM, read it at 5-8 GB/s with the next chunk alone (AVX512-BF16
// class, bf16 cache, 30 layers' attention: 22.5-24.9 -> 17.1-20.1 ms on two threads,
// 31.4-34.4 -> 29.0-31.2 on one); prefill level.
constexpr int kFarChunks = 8;



// The widest part of a row, at most 8 vectors, that divides D.
constexpr int pv_chunk(int D) {
  for (int c = 64; c > 8; c -= 8)
    if (D % c == 0) return c;
  return 8;
}

// The 8 horizontal sums of a0..a7 as one vector (lane j = sum of aj).
inline __m256 reduce8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of one query row against 8 keys (float32 rows of D values).
template <int D>
inline __m256 qk8(const float* q, const float* const* k) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 qv = load8(q + d);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k[j] + d), acc[j]);
  }
  return reduce8(acc);
}

// O_r = O_r * corr + sum_{j < limit} P[j] V[j], 8 vectors of the row at a time.
template <int D>
inline void accumulate_pv(float* orow, const float* P, int limit, const float* const* V,
                          float corr) {
  constexpr int kChunk = pv_chunk(D);
  const __m256 cv = _mm256_set1_ps(corr);
  for (int d0 = 0; d0 < D; d0 += kChunk) {
    __m256 acc[kChunk / 8];
    for (int i = 0; i < kChunk / 8; ++i) acc[i] = _mm256_mul_ps(load8(orow + d0 + 8 * i), cv);
    for (int j = 0; j < limit; ++j) {
      const __m256 p = _mm256_set1_ps(P[j]);
      const float* vj = V[j] + d0;
      for (int i = 0; i < kChunk / 8; ++i) acc[i] = _mm256_fmadd_ps(p, load8(vj + 8 * i), acc[i]);
    }
    for (int i = 0; i < kChunk / 8; ++i) store8(orow + d0 + 8 * i, acc[i]);
  }
}

// Scores of two query rows against 4 keys: s0[j], s1[j] in the order of qk8 (each
// key's 8 lane sums, then the same tree: ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))), with
// each key's vector loaded once for both rows.
inline __m128 reduce4(const __m256 a[4]) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

template <int D>
inline void qk4x2(const float* q0, const float* q1, const float* const* k, float* s0, float* s1) {
  __m256 a0[4], a1[4];
  for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 x0 = load8(q0 + d), x1 = load8(q1 + d);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8(k[j] + d);
      a0[j] = _mm256_fmadd_ps(x0, kv, a0[j]);
      a1[j] = _mm256_fmadd_ps(x1, kv, a1[j]);
    }
  }
  _mm_storeu_ps(s0, reduce4(a0));
  _mm_storeu_ps(s1, reduce4(a1));
}

// accumulate_pv for two rows at once (each V vector loaded once for both): the same
// operations per row, in the same order, so a row's bits do not depend on its partner.
template <int D>
inline void accumulate_pv2(float* o0, float* o1, const float* P0, const float* P1, int lim0,
                           int lim1, const float* const* V, float c0, float c1) {
  constexpr int kChunk = D % 32 == 0 ? 32 : 16;
  constexpr int NV = kChunk / 8;
  const __m256 cv0 = _mm256_set1_ps(c0), cv1 = _mm256_set1_ps(c1);
  const int both = std::min(lim0, lim1);
  for (int d0 = 0; d0 < D; d0 += kChunk) {
    __m256 a0[NV], a1[NV];
    for (int i = 0; i < NV; ++i) {
      a0[i] = _mm256_mul_ps(load8(o0 + d0 + 8 * i), cv0);
      a1[i] = _mm256_mul_ps(load8(o1 + d0 + 8 * i), cv1);
    }
    int j = 0;
    for (; j < both; ++j) {
      const __m256 p0 = _mm256_set1_ps(P0[j]), p1 = _mm256_set1_ps(P1[j]);
      const float* vj = V[j] + d0;
      for (int i = 0; i < NV; ++i) {
        const __m256 v = load8(vj + 8 * i);
        a0[i] = _mm256_fmadd_ps(p0, v, a0[i]);
        a1[i] = _mm256_fmadd_ps(p1, v, a1[i]);
      }
    }
    for (int j0 = j; j0 < lim0; ++j0) {
      const __m256 p0 = _mm256_set1_ps(P0[j0]);
      for (int i = 0; i < NV; ++i) a0[i] = _mm256_fmadd_ps(p0, load8(V[j0] + d0 + 8 * i), a0[i]);
    }
    for (int j1 = j; j1 < lim1; ++j1) {
      const __m256 p1 = _mm256_set1_ps(P1[j1]);
      for (int i = 0; i < NV; ++i) a1[i] = _mm256_fmadd_ps(p1, load8(V[j1] + d0 + 8 * i), a1[i]);
    }
    for (int i = 0; i < NV; ++i) {
      store8(o0 + d0 + 8 * i, a0[i]);
      store8(o1 + d0 + 8 * i, a1[i]);
    }
  }
}


// One row's online-softmax update over a chunk's scores sr[0 .. limit): sr becomes
// P (lanes past the limit 0), returns the factor the row's output is scaled by first.
// Every exp is exp8's, lane by lane, so a value's bits do not depend on its lane.
inline float softmax_update(float* sr, int limit, float& m, float& l) {
  const int full = limit / 8 * 8;
  __m256 mx8 = _mm256_set1_ps(kNegInf);
  for (int j = 0; j < full; j += 8) mx8 = _mm256_max_ps(mx8, load8(sr + j));
  float mx = hmax(mx8);  // a max is exact in any order
  for (int j = full; j < limit; ++j) mx = std::max(mx, sr[j]);
  const float m_new = std::max(m, mx);
  alignas(32) float e[8];
  store8(e, exp8(_mm256_set1_ps(m - m_new)));  // exp(-inf) = 0: a row's first chunk
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum8 = _mm256_setzero_ps();
  for (int j = 0; j < full; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(load8(sr + j), mv));
    store8(sr + j, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  if (full < limit) {  // the last, partial group: lanes past the limit count as 0
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 live = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(limit - full)), _CMP_LT_OQ);
    const __m256 p = _mm256_and_ps(live, exp8(_mm256_sub_ps(load8(sr + full), mv)));
    store8(sr + full, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  l = l * e[0] + hsum(sum8);
  m = m_new;
  return e[0];
}

// Every query row, whatever step it comes in (a decode, a verification, a prefill
// tile of any size, beside other sequences), goes through the same operations in the
// same order: the context in chunks of CS slots from position 0; per chunk, scores as
// qk8 computes them, one softmax_update, accumulate_pv. Rows are paired only to share
// loads. So a token's output bits depend on its own query, position and context only.
template <typename T, int D>
void attend_tile(const float* q, int64_t q_row_stride, float* out, int64_t out_row_stride,
                 const T* cache, const Geometry& g, const int32_t* blocks, int64_t ctx,
                 int64_t first_pos, int nq, float scale) {
  const int G = g.G, KVH = g.KVH, BS = g.BS;
  const int per_kvh = nq * G;  // rows of one kv head
  const int rows = per_kvh * KVH;
  std::vector<float> Qb(static_cast<size_t>(rows) * D), Ob(static_cast<size_t>(rows) * D, 0.f);
  const int CS = std::max(BS, kChunkSlots);  // slots per chunk (a multiple of BS)
  std::vector<float> mrow(rows, kNegInf), lrow(rows, 0.f), Sb(static_cast<size_t>(rows) * CS);
  std::vector<float> Kb, Vb;  // widened bfloat16 / int8 keys and values of a chunk
  if constexpr (!std::is_same_v<T, float>) {
    Kb.resize(static_cast<size_t>(CS) * D);
    Vb.resize(static_cast<size_t>(CS) * D);
  }
  const float* kp[kChunkSlots + kMaxBlock];
  const float* vp[kChunkSlots + kMaxBlock];
  // Row r = (kvh * nq + qi) * G + gi holds head kvh * G + gi of query token qi.
  const __m256 sv = _mm256_set1_ps(scale);
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int qi = 0; qi < nq; ++qi)
      for (int gi = 0; gi < G; ++gi) {
        const float* src = q + qi * q_row_stride + (kvh * G + gi) * D;
        float* dst = Qb.data() + ((kvh * nq + qi) * G + gi) * D;
        for (int d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(load8(src + d), sv));
      }
  const int64_t nblocks = (first_pos + nq - 1) / BS + 1;
  const int per_chunk = std::max(1, kChunkSlots / BS);
  // A row's slots in a chunk at c0 (its causal limit; <= 0: all in its future).
  auto row_limit = [&](int rr, int64_t c0, int cslots) {
    return static_cast<int>(std::min<int64_t>(cslots, first_pos + rr / G - c0 + 1));
  };
  for (int64_t b0 = 0; b0 < nblocks; b0 += per_chunk) {
    const int64_t b1 = std::min<int64_t>(nblocks, b0 + per_chunk);
    const int64_t c0 = b0 * BS;  // position of the chunk's first slot
    const int cslots = static_cast<int>(std::min<int64_t>(ctx, b1 * BS) - c0);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t nb = b + per_chunk;
      if (nb < nblocks) prefetch_kv(cache, g, blocks[nb]);
    }
    for (int kvh = 0; kvh < KVH; ++kvh) {
      const int64_t far = kFarChunks * per_chunk;
      for (int64_t b = b0 + far; b < std::min(nblocks, b1 + far); ++b) {
        const T* k = cache + static_cast<int64_t>(blocks[b]) * g.block_stride + kvh * g.head_stride;
        prefetch_region_l2(k, g.head_stride * static_cast<int64_t>(sizeof(T)));
        prefetch_region_l2(k + g.kv_stride, g.head_stride * static_cast<int64_t>(sizeof(T)));
      }
      float* S = Sb.data() + static_cast<size_t>(kvh) * per_kvh * CS;
      const float* Q = Qb.data() + static_cast<size_t>(kvh) * per_kvh * D;
      float* O = Ob.data() + static_cast<size_t>(kvh) * per_kvh * D;
      // Row pointers of the chunk's keys and values: float32 read in place,
      // bfloat16 / int8 widened once here (each is read by every row of the group).
      // A block's slots are taken 8 at a time; slots past the context are masked.
      int padded = 0;
      for (int64_t b = b0; b < b1; ++b) {
        const T* kb = cache + static_cast<int64_t>(blocks[b]) * g.block_stride +
                      kvh * g.head_stride;
        const int off = static_cast<int>((b - b0) * BS);
        const int nslots = static_cast<int>(std::min<int64_t>(BS, ctx - b * BS));
        const int n8 = (nslots + 7) / 8 * 8;
        for (int j = 0; j < n8; ++j) {
          const T* kj = kb + j * g.slot_stride;
          if constexpr (std::is_same_v<T, float>) {
            kp[off + j] = kj;
            vp[off + j] = kj + g.kv_stride;
          } else {
            float* kd = Kb.data() + (off + j) * D;
            float* vd = Vb.data() + (off + j) * D;
            widen_row(kj, kd, D);
            widen_row(kj + g.kv_stride, vd, D);
            kp[off + j] = kd;
            vp[off + j] = vd;
          }
        }
        padded = off + n8;
      }
      // Scores, up to each row's limit rounded up to 8 (the rest is never read).
      int rr = 0;
      for (; rr + 2 <= per_kvh; rr += 2) {
        const int lim = std::max(row_limit(rr, c0, cslots), row_limit(rr + 1, c0, cslots));
        const int n4 = std::min(padded, (lim + 3) / 4 * 4);
        for (int j = 0; j < n4; j += 4)
          qk4x2<D>(Q + rr * D, Q + (rr + 1) * D, kp + j, S + rr * CS + j, S + (rr + 1) * CS + j);
      }
      for (; rr < per_kvh; ++rr) {
        const int n8 = std::min(padded, (row_limit(rr, c0, cslots) + 7) / 8 * 8);
        for (int j = 0; j < n8; j += 8) store8(S + rr * CS + j, qk8<D>(Q + rr * D, kp + j));
      }
      // Softmax, then P V (rows in pairs where both attend to some of the chunk).
      int lims[2], pend = 0, prow[2];
      float corrs[2];
      for (rr = 0; rr < per_kvh; ++rr) {
        const int limit = row_limit(rr, c0, cslots);
        if (limit <= 0) continue;  // the whole chunk is in this row's future
        const int r = kvh * per_kvh + rr;
        corrs[pend] = softmax_update(S + rr * CS, limit, mrow[r], lrow[r]);
        lims[pend] = limit;
        prow[pend++] = rr;
        if (pend == 2) {
          accumulate_pv2<D>(O + prow[0] * D, O + prow[1] * D, S + prow[0] * CS, S + prow[1] * CS,
                            lims[0], lims[1], vp, corrs[0], corrs[1]);
          pend = 0;
        }
      }
      if (pend == 1) accumulate_pv<D>(O + prow[0] * D, S + prow[0] * CS, lims[0], vp, corrs[0]);
    }
  }
  write_rows<D>(out, out_row_stride, Ob.data(), lrow.data(), KVH, nq, G);
}

template <typename T>
TileFn<T> tile_fn(int64_t D) {
  return by_head_dim(D, [](auto d) -> TileFn<T> { return attend_tile<T, decltype(d)::value>; });
}

}  // namespace

bool attention_supports_head_dim(int64_t D) {
  return D == 16 || D == 32 || D == 64 || D == 80 || D == 96 || D == 128 || D == 256;  // by_head_dim's
}

void paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                     const at::Tensor& block_table, const at::Tensor& seq_rows,
                     const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& ctx_len, double scale, at::Tensor& out, int64_t family) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 &&
              q.stride(1) == q.size(2), "q must be float32 [T, H, D] with contiguous heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out must be a contiguous float32 tensor shaped like q");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [blocks, layers, 2, kv_heads, block_size, row]");
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t L = kv_cache.size(1), KVH = kv_cache.size(3), BS = kv_cache.size(4);
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  const int64_t row_w = int8 ? D + kKvScaleBytes : D;
  TORCH_CHECK(kv_cache.size(5) == row_w, "head_dim of q and kv_cache differ");
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(attention_supports_head_dim(D), "head_dim ", D, " is not supported");
  TORCH_CHECK(BS % 8 == 0 && BS <= kMaxBlock, "block_size must be a multiple of 8, at most 64");
  TORCH_CHECK(0 <= layer && layer < L, "layer out of range");
  TORCH_CHECK(family == kAvx2 || family == kAvx512 || family == kAmx,
              "unknown attention family ", family);
  const bool amx = family == kAmx, bf16 = family != kAvx2;
  TORCH_CHECK(!bf16 || kv_cache.scalar_type() == at::kBFloat16,
              "the bfloat16 attention families need a bfloat16 KV cache");
  TORCH_CHECK(!amx || amx_ready(), "amx: Linux did not grant this process the tile registers");
  const int tile_q = bf16 ? kBf16TileQ : kTileQ;
  for (const auto* t : {&block_table, &seq_rows, &q_start, &q_len, &ctx_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata must be contiguous int32");
  TORCH_CHECK(block_table.dim() == 2, "block_table must be [rows, max_blocks]");
  const int64_t S = seq_rows.numel();
  const int32_t* rows = seq_rows.data_ptr<int32_t>();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ql = q_len.data_ptr<int32_t>();
  const int32_t* cl = ctx_len.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1), num_blocks = kv_cache.size(0);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  struct Task {
    int32_t s, t0, h0, nh;  // sequence, first query of the tile, kv heads h0 .. h0 + nh
  };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ql[s] >= 1 && ql[s] <= cl[s] && (cl[s] + BS - 1) / BS <= max_blocks &&
                qs[s] >= 0 && qs[s] + ql[s] <= q.size(0) && rows[s] >= 0 && rows[s] < block_table.size(0),
                "bad attention metadata for sequence ", s);
    const int32_t* row = bt + static_cast<int64_t>(rows[s]) * max_blocks;
    for (int64_t b = 0; b < (cl[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(0 <= row[b] && row[b] < num_blocks, "block id out of range for sequence ", s);
    for (int32_t t0 = 0; t0 < ql[s]; t0 += tile_q)
      tasks.push_back({static_cast<int32_t>(s), t0, 0, static_cast<int32_t>(KVH)});
  }
  if (static_cast<int64_t>(tasks.size()) < at::get_num_threads() && KVH > 1) {
    std::vector<Task> split;
    for (const Task& t : tasks) {
      if (cl[t.s] < kSplitContext) {
        split.push_back(t);
        continue;
      }
      for (int32_t h = 0; h < KVH; ++h) split.push_back({t.s, t.t0, h, 1});
    }
    tasks.swap(split);
  }
  auto work = [&](const Task& t) {
    return static_cast<int64_t>(std::min(tile_q, ql[t.s] - t.t0)) * (cl[t.s] - ql[t.s] + t.t0 + 1) * t.nh;
  };
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const Task& a, const Task& b) { return work(a) > work(b); });
  Geometry g;
  g.slot_stride = row_w;
  g.head_stride = BS * row_w;
  g.kv_stride = KVH * g.head_stride;
  g.block_stride = L * 2 * g.kv_stride;
  g.KVH = static_cast<int>(KVH);
  g.G = static_cast<int>(H / KVH);
  g.BS = static_cast<int>(BS);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](const auto* cache) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cache)>>;
    TileFn<T> fn = tile_fn<T>(D);
    if constexpr (std::is_same_v<T, bf16_t>)
      if (bf16) fn = bf16_tile_fn(D, amx);
    std::atomic<int64_t> next{0};  // the next task any thread takes
    // (one task: on this thread, no parallel region: a parallel region per call took a
    // single int4 stream 2% longer a token)
    const int64_t takers = std::min<int64_t>(at::get_num_threads(), tasks.size());
    at::parallel_for(0, takers, 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
        const auto [s, t0, h0, nh] = tasks[i];
        const int nq = std::min(tile_q, ql[s] - t0);
        const int64_t tok = qs[s] + t0, head = static_cast<int64_t>(h0) * g.G * D;
        Geometry gt = g;
        gt.KVH = nh;
        fn(qp + tok * q.stride(0) + head, q.stride(0), op + tok * H * D + head, H * D,
           cache + layer * 2 * g.kv_stride + h0 * g.head_stride, gt,
           bt + static_cast<int64_t>(rows[s]) * max_blocks, cl[s], cl[s] - ql[s] + t0, nq,
           static_cast<float>(scale));
      }
    });
  };
  if (kv_cache.scalar_type() == at::kFloat) {
    run(kv_cache.data_ptr<float>());
  } else if (int8) {
    run(kv_cache.data_ptr<int8_t>());
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "kv_cache must be float32, bfloat16 or int8");
    run(reinterpret_cast<const bf16_t*>(kv_cache.data_ptr<at::BFloat16>()));
  }
}

}  // namespace pdk
