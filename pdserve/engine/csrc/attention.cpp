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
// Work is split into tasks (sequence, tile of up to kTileQ query tokens); a task
// holds the tile's queries of every head and walks the context block by block
// (a block's K, then V, of all kv heads is one contiguous region, read in order
// while the next block is prefetched), keeping an online softmax per query row,
// so nothing is gathered and memory use is O(tile) whatever the context length.
//
// Rows of a task: r = (kv head, query token, head in the group), so each kv head's
// rows are contiguous. Few rows per kv head, or a sequence of at most kDotQueries
// query tokens (decodes, speculative verification): one dot product per (row, slot),
// each row on its own, so a query token's result is bit for bit what it would be
// decoding alone. Many (prefill tiles): scores vectorised over rows (attend_rows).
// head_dim is a template parameter so that the per-row accumulators stay in
// registers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_rows.h"
#include "vec.h"

namespace pdk {
namespace {

constexpr int kTileQ = 8;       // query tokens per task
constexpr int kMaxBlock = 64;   // slots per KV block the kernel handles
constexpr int kDotRows = 4;     // rows per kv head up to which scores are dot products
constexpr int kDotQueries = 17; // query tokens of a sequence up to which they are too
constexpr int kChunkSlots = 32; // slots per softmax update
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t slot_stride, head_stride, kv_stride, block_stride;  // elements
  int KVH, G, BS;
};

inline void prefetch_region(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

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

// Many query rows of one kv head (prefill tiles): scores vectorised over rows.
// Q is transposed once per group of up to 8 * NV rows (Qt[d][lane]); each slot's
// key is broadcast against it, so the cache is read in its own layout and the
// online softmax runs on row vectors. P V goes row by row (a broadcast P[r][j]
// times 8 vectors of V[j]).
template <typename T, int D, int NV>
void attend_rows(const float* Q, int nr, const int64_t* row_pos, const T* cache, const Geometry& g,
                 int kvh, const int32_t* blocks, int64_t ctx, float* O, float* lsum) {
  constexpr int W = 8 * NV;  // row lanes
  constexpr int CS = 64;     // slots per softmax update
  alignas(32) float Qt[D * W];
  alignas(32) float St[CS * W];
  alignas(32) float Kc[CS * D];
  alignas(32) float Vc[CS * D];
  alignas(32) float posf[W], corr[W];
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < W; ++r) Qt[d * W + r] = r < nr ? Q[r * D + d] : 0.f;
  int64_t max_pos = 0;
  for (int r = 0; r < W; ++r) {
    posf[r] = r < nr ? static_cast<float>(row_pos[r]) : -1.f;  // padded lanes attend nothing
    if (r < nr) max_pos = std::max(max_pos, row_pos[r]);
  }
  __m256 m[NV], l[NV], pv[NV];
  for (int v = 0; v < NV; ++v) {
    m[v] = _mm256_set1_ps(kNegInf);
    l[v] = _mm256_setzero_ps();
    pv[v] = load8(posf + 8 * v);
  }
  for (int r = 0; r < nr; ++r)
    for (int d = 0; d < D; d += 8) store8(O + r * D + d, _mm256_setzero_ps());
  const int BS = g.BS;
  const int64_t end = std::min<int64_t>(ctx, max_pos + 1);  // slots any row attends
  for (int64_t c0 = 0; c0 < end; c0 += CS) {
    const int cs = static_cast<int>(std::min<int64_t>(CS, end - c0));
    for (int j = 0; j < cs; ++j) {  // widen this chunk's K and V rows
      const int64_t p = c0 + j;
      const T* kj = cache + static_cast<int64_t>(blocks[p / BS]) * g.block_stride +
                    kvh * g.head_stride + (p % BS) * g.slot_stride;
      widen_row(kj, Kc + j * D, D);
      widen_row(kj + g.kv_stride, Vc + j * D, D);
    }
    int j = 0;
    for (; j + 2 <= cs; j += 2) {
      __m256 a0[NV], a1[NV];
      for (int v = 0; v < NV; ++v) a0[v] = a1[v] = _mm256_setzero_ps();
      const float* k0 = Kc + j * D;
      const float* k1 = k0 + D;
      for (int d = 0; d < D; ++d) {
        const __m256 b0 = _mm256_set1_ps(k0[d]), b1 = _mm256_set1_ps(k1[d]);
        for (int v = 0; v < NV; ++v) {
          const __m256 qv = load8(Qt + d * W + 8 * v);
          a0[v] = _mm256_fmadd_ps(qv, b0, a0[v]);
          a1[v] = _mm256_fmadd_ps(qv, b1, a1[v]);
        }
      }
      for (int v = 0; v < NV; ++v) {
        store8(St + j * W + 8 * v, a0[v]);
        store8(St + (j + 1) * W + 8 * v, a1[v]);
      }
    }
    for (; j < cs; ++j) {
      __m256 a0[NV];
      for (int v = 0; v < NV; ++v) a0[v] = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m256 b0 = _mm256_set1_ps(Kc[j * D + d]);
        for (int v = 0; v < NV; ++v) a0[v] = _mm256_fmadd_ps(load8(Qt + d * W + 8 * v), b0, a0[v]);
      }
      for (int v = 0; v < NV; ++v) store8(St + j * W + 8 * v, a0[v]);
    }
    // causal mask, online softmax on row vectors
    const __m256 ninf = _mm256_set1_ps(kNegInf);
    for (int v = 0; v < NV; ++v) {
      __m256 mx = ninf;
      for (int jj = 0; jj < cs; ++jj) {
        const __m256 future = _mm256_cmp_ps(pv[v], _mm256_set1_ps(static_cast<float>(c0 + jj)), _CMP_LT_OQ);
        const __m256 sc = _mm256_blendv_ps(load8(St + jj * W + 8 * v), ninf, future);
        store8(St + jj * W + 8 * v, sc);
        mx = _mm256_max_ps(mx, sc);
      }
      const __m256 m_new = _mm256_max_ps(m[v], mx);
      const __m256 cv = exp8(_mm256_sub_ps(m[v], m_new));
      __m256 sum = _mm256_setzero_ps();
      for (int jj = 0; jj < cs; ++jj) {
        const __m256 p = exp8(_mm256_sub_ps(load8(St + jj * W + 8 * v), m_new));
        store8(St + jj * W + 8 * v, p);
        sum = _mm256_add_ps(sum, p);
      }
      l[v] = _mm256_fmadd_ps(l[v], cv, sum);
      m[v] = m_new;
      store8(corr + 8 * v, cv);
    }
    for (int r = 0; r < nr; ++r) {
      const float* p = St + r;  // P[r][jj] = St[jj * W + r]
      float* orow = O + r * D;
      constexpr int kChunk = pv_chunk(D);
      const __m256 cvr = _mm256_set1_ps(corr[r]);
      for (int d0 = 0; d0 < D; d0 += kChunk) {
        __m256 acc[kChunk / 8];
        for (int i = 0; i < kChunk / 8; ++i) acc[i] = _mm256_mul_ps(load8(orow + d0 + 8 * i), cvr);
        for (int jj = 0; jj < cs; ++jj) {
          const __m256 pj = _mm256_set1_ps(p[jj * W]);
          const float* vj = Vc + jj * D + d0;
          for (int i = 0; i < kChunk / 8; ++i) acc[i] = _mm256_fmadd_ps(pj, load8(vj + 8 * i), acc[i]);
        }
        for (int i = 0; i < kChunk / 8; ++i) store8(orow + d0 + 8 * i, acc[i]);
      }
    }
  }
  alignas(32) float lf[W];
  for (int v = 0; v < NV; ++v) store8(lf + 8 * v, l[v]);
  for (int r = 0; r < nr; ++r) lsum[r] = lf[r];
}

template <typename T, int D>
void attend_tile(const float* q, int64_t q_row_stride, float* out, int64_t out_row_stride,
                 const T* cache, const Geometry& g, const int32_t* blocks, int64_t ctx,
                 int64_t first_pos, int nq, float scale, bool dot) {
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
  if (!dot && per_kvh > kDotRows) {  // prefill tiles: scores vectorised over rows
    int64_t pos[8 * 3];
    for (int kvh = 0; kvh < KVH; ++kvh)
      for (int r0 = 0; r0 < per_kvh; r0 += 24) {
        const int nr = std::min(24, per_kvh - r0);
        for (int i = 0; i < nr; ++i) pos[i] = first_pos + (r0 + i) / G;
        const size_t row = static_cast<size_t>(kvh) * per_kvh + r0;
        float* o = Ob.data() + row * D;
        float* l = lrow.data() + row;
        const float* qr = Qb.data() + row * D;
        switch ((nr + 7) / 8) {
          case 1: attend_rows<T, D, 1>(qr, nr, pos, cache, g, kvh, blocks, ctx, o, l); break;
          case 2: attend_rows<T, D, 2>(qr, nr, pos, cache, g, kvh, blocks, ctx, o, l); break;
          default: attend_rows<T, D, 3>(qr, nr, pos, cache, g, kvh, blocks, ctx, o, l); break;
        }
      }
  } else {  // decodes: few rows per kv head, dot products
    const int64_t nblocks = (first_pos + nq - 1) / BS + 1;
    const int64_t region = g.kv_stride * 2 * static_cast<int64_t>(sizeof(T));  // K + V of a block
    // Blocks are taken kChunkSlots slots at a time: scores and widened V for the whole
    // chunk, then one softmax update and one P V pass per row.
    const int per_chunk = std::max(1, kChunkSlots / BS);
    for (int64_t b0 = 0; b0 < nblocks; b0 += per_chunk) {
      const int64_t b1 = std::min<int64_t>(nblocks, b0 + per_chunk);
      const int64_t c0 = b0 * BS;  // position of the chunk's first slot
      const int cslots = static_cast<int>(std::min<int64_t>(ctx, b1 * BS) - c0);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t nb = b + per_chunk;
        if (nb < nblocks) prefetch_region(cache + static_cast<int64_t>(blocks[nb]) * g.block_stride, region);
      }
      for (int kvh = 0; kvh < KVH; ++kvh) {
        float* S = Sb.data() + static_cast<size_t>(kvh) * per_kvh * CS;
        const float* Q = Qb.data() + static_cast<size_t>(kvh) * per_kvh * D;
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
        for (int rr = 0; rr < per_kvh; ++rr)
          for (int j = 0; j < padded; j += 8) store8(S + rr * CS + j, qk8<D>(Q + rr * D, kp + j));
        // Mask (causal, and slots past the context), online softmax, P V.
        for (int rr = 0; rr < per_kvh; ++rr) {
          const int r = kvh * per_kvh + rr;
          const int64_t pos = first_pos + rr / G;
          float* sr = S + rr * CS;
          const int limit = static_cast<int>(std::min<int64_t>(cslots, pos - c0 + 1));
          if (limit <= 0) continue;  // the whole chunk is in this row's future
          float mx = kNegInf;
          for (int j = 0; j < limit; ++j) mx = std::max(mx, sr[j]);
          const float m_new = std::max(mrow[r], mx);
          const float corr = mrow[r] == kNegInf ? 0.f : std::exp(mrow[r] - m_new);
          const __m256 mv = _mm256_set1_ps(m_new);
          __m256 sum8 = _mm256_setzero_ps();
          int j = 0;
          for (; j + 8 <= limit; j += 8) {
            const __m256 p = exp8(_mm256_sub_ps(load8(sr + j), mv));
            store8(sr + j, p);
            sum8 = _mm256_add_ps(sum8, p);
          }
          float sum = hsum(sum8);
          for (; j < limit; ++j) { sr[j] = std::exp(sr[j] - m_new); sum += sr[j]; }
          lrow[r] = lrow[r] * corr + sum;
          mrow[r] = m_new;
          accumulate_pv<D>(Ob.data() + r * D, sr, limit, vp, corr);
        }
      }
    }
  }
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int qi = 0; qi < nq; ++qi)
      for (int gi = 0; gi < G; ++gi) {
        const int r = (kvh * nq + qi) * G + gi;
        float* dst = out + qi * out_row_stride + (kvh * G + gi) * D;
        const __m256 iv = _mm256_set1_ps(lrow[r] > 0.f ? 1.f / lrow[r] : 0.f);
        for (int d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(load8(Ob.data() + r * D + d), iv));
      }
}

template <typename T>
using TileFn = void (*)(const float*, int64_t, float*, int64_t, const T*, const Geometry&,
                        const int32_t*, int64_t, int64_t, int, float, bool);

template <typename T>
TileFn<T> tile_fn(int64_t D) {
  switch (D) {
    case 16: return attend_tile<T, 16>;
    case 32: return attend_tile<T, 32>;
    case 64: return attend_tile<T, 64>;
    case 80: return attend_tile<T, 80>;
    case 96: return attend_tile<T, 96>;
    case 128: return attend_tile<T, 128>;
    case 256: return attend_tile<T, 256>;
    default: TORCH_CHECK(false, "head_dim ", D, " is not supported by the CPU attention kernel");
  }
}

}  // namespace

bool attention_supports_head_dim(int64_t D) {
  return D == 16 || D == 32 || D == 64 || D == 80 || D == 96 || D == 128 || D == 256;
}

void paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                     const at::Tensor& block_table, const at::Tensor& seq_rows,
                     const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& ctx_len, double scale, at::Tensor& out) {
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
  std::vector<std::pair<int32_t, int32_t>> tasks;  // (sequence, first query of the tile)
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ql[s] >= 1 && ql[s] <= cl[s] && (cl[s] + BS - 1) / BS <= max_blocks &&
                qs[s] >= 0 && qs[s] + ql[s] <= q.size(0) && rows[s] >= 0 && rows[s] < block_table.size(0),
                "bad attention metadata for sequence ", s);
    const int32_t* row = bt + static_cast<int64_t>(rows[s]) * max_blocks;
    for (int64_t b = 0; b < (cl[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(0 <= row[b] && row[b] < num_blocks, "block id out of range for sequence ", s);
    for (int32_t t0 = 0; t0 < ql[s]; t0 += kTileQ) tasks.emplace_back(static_cast<int32_t>(s), t0);
  }
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
    const TileFn<T> fn = tile_fn<T>(D);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const auto [s, t0] = tasks[i];
        const int nq = std::min(kTileQ, ql[s] - t0);
        const int64_t tok = qs[s] + t0;
        fn(qp + tok * q.stride(0), q.stride(0), op + tok * H * D, H * D,
           cache + layer * 2 * g.kv_stride, g, bt + static_cast<int64_t>(rows[s]) * max_blocks,
           cl[s], cl[s] - ql[s] + t0, nq, static_cast<float>(scale), ql[s] <= kDotQueries);
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
