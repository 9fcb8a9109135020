// Paged attention that reads K/V in place from the block-major KV cache.
//
//   kv_cache[block, layer, 0 = K | 1 = V, slot (block_size), kv head, head dim]
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
// rows are contiguous. Few rows per kv head (decodes): one dot product per
// (row, slot). Many (prefill tiles): the K block is transposed once and scored
// with broadcast FMAs. head_dim is a template parameter so that the per-row
// accumulators stay in registers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace pdk {
namespace {

constexpr int kTileQ = 8;       // query tokens per task
constexpr int kMaxBlock = 64;   // slots per KV block the kernel handles
constexpr int kDotRows = 4;     // rows per kv head up to which scores are dot products
constexpr int kChunkSlots = 64; // slots per softmax update
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t slot_stride, kv_stride, block_stride;  // elements
  int KVH, G, BS;
};

inline void prefetch_region(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// S[r][j] = q_r . k_j for R rows, slots j < nslots, straight from the cache.
template <int D, int R, typename T>
inline void dot_scores_r(const float* Q, const T* kb, int64_t slot_stride, int nslots, float* S,
                         int ld) {
  for (int j = 0; j < nslots; ++j) {
    const T* kj = kb + j * slot_stride;
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      const __m256 k = load8(kj + d);
      for (int r = 0; r < R; ++r) a[r][(d / 8) & 1] = _mm256_fmadd_ps(load8(Q + r * D + d), k, a[r][(d / 8) & 1]);
    }
    for (int r = 0; r < R; ++r) S[r * ld + j] = hsum(_mm256_add_ps(a[r][0], a[r][1]));
  }
}

template <int D, typename T>
inline void dot_scores(const float* Q, int rows, const T* kb, int64_t slot_stride, int nslots,
                       float* S, int ld) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) dot_scores_r<D, 4>(Q + r * D, kb, slot_stride, nslots, S + r * ld, ld);
  switch (rows - r) {
    case 3: dot_scores_r<D, 3>(Q + r * D, kb, slot_stride, nslots, S + r * ld, ld); break;
    case 2: dot_scores_r<D, 2>(Q + r * D, kb, slot_stride, nslots, S + r * ld, ld); break;
    case 1: dot_scores_r<D, 1>(Q + r * D, kb, slot_stride, nslots, S + r * ld, ld); break;
    default: break;
  }
}

// The same for many rows: Kt is the block transposed, [D][BS].
template <int D>
inline void broadcast_scores(const float* Q, int rows, const float* Kt, float* S, int BS, int ld) {
  for (int c = 0; c < BS; c += 8) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int d = 0; d < D; ++d) {
        const __m256 k = load8(Kt + d * BS + c);
        for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(_mm256_set1_ps(Q[(r + i) * D + d]), k, a[i]);
      }
      for (int i = 0; i < 4; ++i) store8(S + (r + i) * ld + c, a[i]);
    }
    for (; r < rows; ++r) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 2) {
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(Q[r * D + d]), load8(Kt + d * BS + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(Q[r * D + d + 1]), load8(Kt + (d + 1) * BS + c), a1);
      }
      store8(S + r * ld + c, _mm256_add_ps(a0, a1));
    }
  }
}

// O_r = O_r * corr + sum_{j < limit} P[j] V[j], 8 vectors of the row at a time.
// The widest part of a row, at most 8 vectors, that divides D.
constexpr int pv_chunk(int D) {
  for (int c = 64; c > 8; c -= 8)
    if (D % c == 0) return c;
  return 8;
}

template <int D>
inline void accumulate_pv(float* orow, const float* P, int limit, const float* V, float corr) {
  constexpr int kChunk = pv_chunk(D);
  const __m256 cv = _mm256_set1_ps(corr);
  for (int d0 = 0; d0 < D; d0 += kChunk) {
    __m256 acc[kChunk / 8];
    for (int i = 0; i < kChunk / 8; ++i) acc[i] = _mm256_mul_ps(load8(orow + d0 + 8 * i), cv);
    for (int j = 0; j < limit; ++j) {
      const __m256 p = _mm256_set1_ps(P[j]);
      const float* vj = V + j * D + d0;
      for (int i = 0; i < kChunk / 8; ++i) acc[i] = _mm256_fmadd_ps(p, load8(vj + 8 * i), acc[i]);
    }
    for (int i = 0; i < kChunk / 8; ++i) store8(orow + d0 + 8 * i, acc[i]);
  }
}

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
  std::vector<float> Kt(static_cast<size_t>(D) * BS), Vb(static_cast<size_t>(CS) * D);
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
      for (int64_t b = b0; b < b1; ++b) {
        const T* kb = cache + static_cast<int64_t>(blocks[b]) * g.block_stride + kvh * D;
        const T* vb = kb + g.kv_stride;
        const int off = static_cast<int>((b - b0) * BS);
        const int nslots = static_cast<int>(std::min<int64_t>(BS, ctx - b * BS));
        for (int j = 0; j < nslots; ++j)
          for (int d = 0; d < D; d += 8) store8(Vb.data() + (off + j) * D + d, load8(vb + j * g.slot_stride + d));
        if (per_kvh <= kDotRows) {
          dot_scores<D>(Q, per_kvh, kb, g.slot_stride, nslots, S + off, CS);
        } else {
          for (int j = 0; j < BS; ++j)
            for (int d = 0; d < D; ++d)
              Kt[d * BS + j] = j < nslots ? to_float(kb[j * g.slot_stride + d]) : 0.f;
          broadcast_scores<D>(Q, per_kvh, Kt.data(), S + off, BS, CS);
        }
      }
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
        accumulate_pv<D>(Ob.data() + r * D, sr, limit, Vb.data(), corr);
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
                        const int32_t*, int64_t, int64_t, int, float);

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
              "kv_cache must be contiguous [blocks, layers, 2, block_size, kv_heads, head_dim]");
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t L = kv_cache.size(1), BS = kv_cache.size(3), KVH = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == D, "head_dim of q and kv_cache differ");
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
  g.slot_stride = KVH * D;
  g.kv_stride = BS * g.slot_stride;
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
           cl[s], cl[s] - ql[s] + t0, nq, static_cast<float>(scale));
      }
    });
  };
  if (kv_cache.scalar_type() == at::kFloat) {
    run(kv_cache.data_ptr<float>());
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "kv_cache must be float32 or bfloat16");
    run(reinterpret_cast<const bf16_t*>(kv_cache.data_ptr<at::BFloat16>()));
  }
}

}  // namespace pdk
