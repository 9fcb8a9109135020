// The paged attention's bfloat16 dot-product families, for a bfloat16 KV cache: the
// float32 family's tasks and online softmax (attention.cpp, attention.h), with both
// products on the tile unit (amx: TDPBF16PS) or on AVX512-BF16 (avx512bf16: VDPBF16PS).
//
// Per task (a sequence's tile of up to kBf16TileQ query tokens), per chunk of the
// context (kChunk slots from position 0), per kv head:
//   - the chunk's keys are transposed once (dword i of 16 slots' rows, dims 2i and
//     2i + 1, side by side: a B tile of S = Q K^T, or the 16 keys' lanes of one
//     VDPBF16PS), its values paired once (slots 2j and 2j + 1 side by side: a B tile
//     of P V, or 16 outputs' lanes); slots past the context are zeros;
//   - per tile of 16 rows (r = (query token, head in the group), as attention.cpp):
//     S, 32 dims a step (amx; a 16-dim tail last) or 2 (avx512bf16), in order; the
//     rows' online softmax on AVX-512 in base 2 (tile_softmax: P rounded to bfloat16,
//     zero past each row's causal limit); the chunk's P V from zeros, 32 slots a step
//     (amx) or 2 (avx512bf16), in order, after the next tile's softmax; then
//     O = O * factor + P V (combine).
// q * scale * log2(e) is rounded to bfloat16 first. A row's sums depend only on that
// row (and the chunk's keys and values), so a row goes through the same operations
// whatever step it comes in and whichever rows share its tile: the chunk's slots past
// a row's limit are zeros of P (their products are exact zeros), and the rows beside
// it are other rows' business. So the float32 family's invariance holds in each of
// these too (a token's bits depend on its query, position and cache only); the
// families agree with each other to bfloat16 rounding, not bit for bit.
#include <vector>

#include "amx.h"
#include "attention.h"
#include "vec512.h"

namespace pdk {

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace {

constexpr int kT = 16;  // rows of a tile; slots of a score tile; outputs of a P V tile
// Slots of a chunk: its per-row costs (maxima, sums, factors, the output's update) are
// shared by 128 scores.
constexpr int kChunk = 128;

// r[0..15] (16 dwords each) transposed in place: r[i] lane n = old r[n] lane i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// Keys of 16 slots (rows k[n] of D bf16; nullptr: zeros) as B tiles of S = Q K^T:
// kt[i * 16 + n] = dword i (dims 2i, 2i + 1) of slot n, i < D / 2.
template <int D>
void transpose_keys(const bf16_t* const* k, uint32_t* kt) {
  constexpr int W = D / 2;  // dwords of a row
  for (int b = 0; b < W; b += 16) {
    const int w = std::min(16, W - b);
    const auto mask = static_cast<__mmask16>((1u << w) - 1);
    __m512i r[16];
    for (int n = 0; n < 16; ++n)
      r[n] = k[n] ? _mm512_maskz_loadu_epi32(mask, k[n] + 2 * b) : _mm512_setzero_si512();
    transpose16(r);
    for (int i = 0; i < w; ++i) _mm512_storeu_si512(kt + (b + i) * 16, r[i]);
  }
}

// Values of slots 2j, 2j + 1 (rows v0, v1 of D bf16; nullptr: zeros) as one row of a
// P V B tile: vp[d] = (v0[d], v1[d]), d < D.
template <int D>
void pair_values(const bf16_t* v0, const bf16_t* v1, uint32_t* vp) {
  alignas(64) static constexpr uint16_t lo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                  53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo), ih = _mm512_load_si512(hi);
  for (int d = 0; d < D; d += 32) {
    const auto mask = D - d >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32(0xFFFFu);
    const __m512i a = v0 ? _mm512_maskz_loadu_epi16(mask, v0 + d) : _mm512_setzero_si512();
    const __m512i b = v1 ? _mm512_maskz_loadu_epi16(mask, v1 + d) : _mm512_setzero_si512();
    _mm512_storeu_si512(vp + d, _mm512_permutex2var_epi16(a, il, b));
    if (D - d >= 32) _mm512_storeu_si512(vp + d + 16, _mm512_permutex2var_epi16(a, ih, b));
  }
}

// The lanes of a group of 16 slots from j below a row's limit.
inline __mmask16 live(int limit, int j) {
  const int n = std::clamp(limit - j, 0, 16);
  return static_cast<__mmask16>((1u << n) - 1);
}

// 2^x on 16 lanes for the softmax's scores, already in base 2 (q carries log2 e):
// n = round(x), 2^(x - n) by its Taylor polynomial of degree 4 (relative error below
// 5e-5, well under P's bfloat16 rounding of 4e-3), scaled by 2^n. x is clamped at -125, so
// nothing is denormal: exp2(-inf) (a row's first chunk) is 2^-125 times zeros.
inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax of a tile's rows over a chunk's scores (row m: S[m * CS ..],
// base 2, lim[m] of them live; lim <= 0: the chunk is in the row's future): the rows'
// maxima, their factors in one exp2_16 (into corr: what the rows' outputs so far are
// to be scaled by), then per row P = 2^(S - max) on 16 lanes (0 past the limit) into
// P (bfloat16, groups of 32 up to `width`) and its sum into l. Each row's operations are the same whichever lane, tile or chunk width it comes
// with (groups past the limit add exact zeros).
void tile_softmax(const float* S, int CS, const int* lim, int rt, int width, float* m_run,
                  float* l_run, bf16_t* P, float* corr) {  // l_run: 16 lanes a row
  alignas(64) float mx[16], mo[16];
  for (int m = 0; m < 16; ++m) {
    mo[m] = m < rt && lim[m] > 0 ? m_run[m] : 0.f;  // rows that skip the chunk: factor 1
    mx[m] = mo[m];
  }
  for (int m = 0; m < rt; ++m) {
    if (lim[m] <= 0) continue;
    const float* sr = S + m * CS;
    __m512 v0 = _mm512_set1_ps(kNegInf), v1 = v0;
    int j = 0;
    for (; j + 32 <= lim[m]; j += 32) {  // (a max is exact in any order)
      v0 = _mm512_max_ps(v0, _mm512_loadu_ps(sr + j));
      v1 = _mm512_max_ps(v1, _mm512_loadu_ps(sr + j + 16));
    }
    for (; j < lim[m]; j += 16) v0 = _mm512_mask_max_ps(v0, live(lim[m], j), v0, _mm512_loadu_ps(sr + j));
    mx[m] = std::max(m_run[m], _mm512_reduce_max_ps(_mm512_max_ps(v0, v1)));
  }
  _mm512_store_ps(corr, exp2_16(_mm512_sub_ps(_mm512_load_ps(mo), _mm512_load_ps(mx))));
  for (int m = 0; m < rt; ++m) {
    bf16_t* pr = P + m * CS;
    if (lim[m] <= 0) {
      for (int j = 0; j < width; j += 32) _mm512_storeu_si512(pr + j, _mm512_setzero_si512());
      continue;
    }
    const __m512 mv = _mm512_set1_ps(mx[m]);
    const float* sr = S + m * CS;
    const int limit = lim[m], full = std::min(width, limit);
    __m512 sum = _mm512_setzero_ps();
    auto group = [&](int j, __mmask16 k0, __mmask16 k1) {  // slots j .. j + 31
      const __m512 p0 = _mm512_maskz_mov_ps(k0, exp2_16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(k1, exp2_16(_mm512_sub_ps(_mm512_loadu_ps(sr + j + 16), mv)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    };
    int j = 0;
    for (; j + 32 <= full; j += 32) group(j, 0xFFFF, 0xFFFF);  // every lane live
    for (; j < width; j += 32) group(j, live(limit, j), live(limit, j + 16));
    float* lr = l_run + m * 16;  // lanes summed once, at the end (before write_rows)
    _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(corr[m]), sum));
    m_run[m] = mx[m];
  }
}

// The tile's rows' outputs after a chunk: O = O * corr + PV (the chunk's P V, float32),
// row for row (a row past its limit has corr 1 and PV 0: the same bits).
template <int D>
void combine(float* O, const float* PV, const float* corr, int rt) {
  for (int m = 0; m < rt; ++m) {
    const __m512 cv = _mm512_set1_ps(corr[m]);
    for (int d = 0; d < D; d += 16)
      _mm512_storeu_ps(O + m * D + d, _mm512_fmadd_ps(_mm512_loadu_ps(O + m * D + d), cv,
                                                      _mm512_loadu_ps(PV + m * D + d)));
  }
}

// Tile numbers are literal text: X(t) for t < n, n <= 4 (C tiles 0-3).
#define PDK_UPTO(n, X) X(0) if ((n) > 1) { X(1) } if ((n) > 2) { X(2) } if ((n) > 3) { X(3) }

// S[m * CS + slot] for the tile's rows (Qt, bf16 [rt][D]) and n_st <= 4 score tiles
// of transposed keys (Kt), on the tile unit (configured for the tile's rows).
template <int D>
void amx_scores4(const bf16_t* Qt, const uint32_t* kt, int n_st, float* S, int CS) {
  constexpr int kSteps = D / 32, kTail = D % 32;  // full 32-dim steps; a 16-dim tail
#define PDK_ZERO(t) _tile_zero(t);
#define PDK_QK(t)                                                                  \
  if constexpr (kTail == 0 && (t) % 2 == 1) {                                      \
    _tile_loadd(7, kt + (t) * kT * D / 2 + s * kT * kT, 64); _tile_dpbf16ps(t, 4, 7); \
  } else {                                                                         \
    _tile_loadd(5, kt + (t) * kT * D / 2 + s * kT * kT, 64); _tile_dpbf16ps(t, 4, 5); \
  }
#define PDK_QK_TAIL(t) _tile_loadd(7, kt + (t) * kT * D / 2 + kSteps * kT * kT, 64); _tile_dpbf16ps(t, 6, 7);
#define PDK_STORE_S(t) _tile_stored(t, S + (t) * kT, CS * 4);
  PDK_UPTO(n_st, PDK_ZERO)
  for (int s = 0; s < kSteps; ++s) {
    _tile_loadd(4, Qt + s * 32, D * 2);
    PDK_UPTO(n_st, PDK_QK)
  }
  if constexpr (kTail != 0) {
    _tile_loadd(6, Qt + kSteps * 32, D * 2);
    PDK_UPTO(n_st, PDK_QK_TAIL)
  }
  PDK_UPTO(n_st, PDK_STORE_S)
  memory_fence();
}

// amx_scores4 for the chunk's n_st score tiles, four at a time.
template <int D>
void amx_scores(const bf16_t* Qt, int, const uint32_t* kt, int n_st, float* S, int CS) {
  for (int st = 0; st < n_st; st += 4)
    amx_scores4<D>(Qt, kt + st * kT * D / 2, std::min(4, n_st - st), S + st * kT, CS);
}

// PV[m * D ..] = P V for the tile's rows (P bf16 [rt][CS]) over n_ks steps of 32
// slots of paired values (Vp), on the tile unit, from zeros (a tile never loads what
// the vector unit has just stored: that load waited for the stores).
template <int D>
void amx_pv(const bf16_t* P, int, int CS, const uint32_t* Vp, int n_ks, float* Ot) {
  memory_fence();
  for (int c0t = 0; c0t < D / kT; c0t += 4) {
    const int n_ct = std::min(4, D / kT - c0t);
    float* oc = Ot + c0t * kT;
    const uint32_t* vp = Vp + c0t * kT;
#define PDK_ZERO_O(t) _tile_zero(t);
#define PDK_PV(t)                                                               \
  if constexpr (D % 32 == 0 && (t) % 2 == 1) {                                  \
    _tile_loadd(7, vp + ks * kT * D + (t) * kT, D * 4); _tile_dpbf16ps(t, 4, 7); \
  } else {                                                                      \
    _tile_loadd(5, vp + ks * kT * D + (t) * kT, D * 4); _tile_dpbf16ps(t, 4, 5); \
  }
#define PDK_STORE_O(t) _tile_stored(t, oc + (t) * kT, D * 4);
    PDK_UPTO(n_ct, PDK_ZERO_O)
    for (int ks = 0; ks < n_ks; ++ks) {
      _tile_loadd(4, P + ks * 32, CS * 2);
      PDK_UPTO(n_ct, PDK_PV)
    }
    PDK_UPTO(n_ct, PDK_STORE_O)
  }
  memory_fence();
}

constexpr int kDpRows = 4;  // rows sharing each key / value load in the avx512bf16 family
constexpr int kDpCols = 4;  // groups of 16 keys / outputs each row's load is shared by

inline __m512bh bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// R rows x C groups of 16 lanes, each accumulator one VDPBF16PS chain over n pairs in
// order from zeros: acc[r][c] += pair i of a[r] (a + r * a_stride, dword i) times b + c * b_col +
// i * b_step. The R x C chains are independent, so they fill the pipes; a chain's
// operations are the same whichever R and C it comes in.
template <int R, int C>
inline void dp_block(const uint32_t* a, int a_stride, const uint32_t* b, int b_col, int b_step,
                     int n, float* out, int out_stride, int out_col) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < n; ++i) {
    __m512bh bv[C];
    for (int c = 0; c < C; ++c) bv[c] = bh(_mm512_loadu_si512(b + c * b_col + i * b_step));
    for (int r = 0; r < R; ++r) {
      const __m512bh av = bh(_mm512_set1_epi32(static_cast<int>(a[r * a_stride + i])));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av, bv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * out_stride + c * out_col, acc[r][c]);
}

// dp_block for nr <= kDpRows rows and nc <= kDpCols groups: every row of a block of
// kDpCols groups at once, a last narrower block a group at a time.
template <int R>
inline void dp_rows(int nc, const uint32_t* a, int a_stride, const uint32_t* b, int b_col,
                    int b_step, int n, float* out, int out_stride, int out_col) {
  if (nc == kDpCols)
    return dp_block<R, kDpCols>(a, a_stride, b, b_col, b_step, n, out, out_stride, out_col);
  for (int c = 0; c < nc; ++c)
    dp_block<R, 1>(a, a_stride, b + c * b_col, b_col, b_step, n, out + c * out_col, out_stride,
                   out_col);
}

inline void dp_any(int nr, int nc, const uint32_t* a, int a_stride, const uint32_t* b, int b_col,
                   int b_step, int n, float* out, int out_stride, int out_col) {
  static_assert(kDpRows == 4, "dp_any's cases");
  switch (nr) {
    case 4: return dp_rows<4>(nc, a, a_stride, b, b_col, b_step, n, out, out_stride, out_col);
    case 3: return dp_rows<3>(nc, a, a_stride, b, b_col, b_step, n, out, out_stride, out_col);
    case 2: return dp_rows<2>(nc, a, a_stride, b, b_col, b_step, n, out, out_stride, out_col);
    default: return dp_rows<1>(nc, a, a_stride, b, b_col, b_step, n, out, out_stride, out_col);
  }
}

// amx_scores on VDPBF16PS: per row and 16 keys, one accumulator over the D / 2 dims'
// pairs in order.
template <int D>
void dp_scores(const bf16_t* Qt, int rt, const uint32_t* kt, int n_st, float* S, int CS) {
  const auto* q = reinterpret_cast<const uint32_t*>(Qt);  // row m's pair i: q[m * D / 2 + i]
  for (int m0 = 0; m0 < rt; m0 += kDpRows)
    for (int st = 0; st < n_st; st += kDpCols)  // key i of score tile t: kt[t * 8D + i * 16]
      dp_any(std::min(kDpRows, rt - m0), std::min(kDpCols, n_st - st), q + m0 * D / 2, D / 2,
             kt + st * kT * D / 2, kT * D / 2, kT, D / 2, S + m0 * CS + st * kT, CS, kT);
}

// amx_pv on VDPBF16PS: per row and 16 outputs, the pairs of slots in order from zeros.
template <int D>
void dp_pv(const bf16_t* P, int rt, int CS, const uint32_t* Vp, int n_ks, float* Ot) {
  const auto* p = reinterpret_cast<const uint32_t*>(P);  // row m's pair j: p[m * CS / 2 + j]
  for (int m0 = 0; m0 < rt; m0 += kDpRows)
    for (int c = 0; c < D; c += kDpCols * kT)  // pair j's outputs c ..: Vp[j * D + c]
      dp_any(std::min(kDpRows, rt - m0), std::min(kDpCols, (D - c) / kT), p + m0 * CS / 2, CS / 2,
             Vp + c, kT, D, n_ks * 16, Ot + m0 * D + c, D, kT);
}

template <int D, bool Amx>
void attend_tile_bf16(const float* q, int64_t q_row_stride, float* out, int64_t out_row_stride,
                      const bf16_t* cache, const Geometry& g, const int32_t* blocks, int64_t ctx,
                      int64_t first_pos, int nq, float scale) {
  static_assert(D % 16 == 0 && D <= 256, "head_dim");
  const int G = g.G, KVH = g.KVH, BS = g.BS;
  const int per_kvh = nq * G;  // rows of one kv head
  const int rows = per_kvh * KVH;
  const int CS = kChunk;
  std::vector<bf16_t> Qb(static_cast<size_t>(rows) * D);
  std::vector<float> Ob(static_cast<size_t>(rows) * D, 0.f), mrow(rows, kNegInf), lrow(rows * 16, 0.f);
  std::vector<uint32_t> Kt(static_cast<size_t>(CS) * D / 2), Vp(static_cast<size_t>(CS) * D / 2);
  alignas(64) float S[kT * kChunk] = {};  // (slots past the scores computed: masked)
  // A tile's P V waits for the next tile's scores and softmax (two P buffers): the
  // tile unit's load of P then finds the vector unit's stores long done (right after
  // them, it waited for them).
  alignas(64) bf16_t P[2][kT * kChunk];
  alignas(64) float PV[kT * D], corr[2][kT];
  // Row r = (kvh * nq + qi) * G + gi holds head kvh * G + gi of query token qi.
  const __m256 sv = _mm256_set1_ps(scale * 1.44269504088896341f);  // base 2
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int qi = 0; qi < nq; ++qi)
      for (int gi = 0; gi < G; ++gi) {
        const float* src = q + qi * q_row_stride + (kvh * G + gi) * D;
        bf16_t* dst = Qb.data() + ((kvh * nq + qi) * G + gi) * D;
        for (int d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(load8(src + d), sv));
      }
  const int64_t nblocks = (first_pos + nq - 1) / BS + 1;
  const int per_chunk = CS / BS;
  auto row_limit = [&](int rr, int64_t c0, int cslots) {
    return static_cast<int>(std::min<int64_t>(cslots, first_pos + rr / G - c0 + 1));
  };
  [[maybe_unused]] int configured = -1;  // rows the tiles are configured with (amx)
  memory_fence();  // Qb is read by tile loads only
  for (int64_t b0 = 0; b0 < nblocks; b0 += per_chunk) {
    const int64_t b1 = std::min<int64_t>(nblocks, b0 + per_chunk);
    const int64_t c0 = b0 * BS;
    const int cslots = static_cast<int>(std::min<int64_t>(ctx, b1 * BS) - c0);
    const int n_st = (cslots + kT - 1) / kT;  // score tiles of 16 slots
    const int n_ks = (cslots + 31) / 32;      // P V steps of 32 slots
    for (int kvh = 0; kvh < KVH; ++kvh) {
      const bf16_t* kr[kChunk];
      const bf16_t* vr[kChunk];
      for (int j = 0; j < n_ks * 32; ++j) {
        if (j < cslots) {
          kr[j] = cache + static_cast<int64_t>(blocks[b0 + j / BS]) * g.block_stride +
                  kvh * g.head_stride + (j % BS) * g.slot_stride;
          vr[j] = kr[j] + g.kv_stride;
        } else {
          kr[j] = vr[j] = nullptr;
        }
      }
      // The chunk after next, 16 slots per tile transposed here, into L2: a burst of
      // the whole next chunk into L1 (as before) stalled on the misses in flight, and a
      // decode at 7,680 tokens of context read its keys and values at 5 GB/s of 20.
      const int64_t nc0 = c0 + 2 * CS;
      for (int st = 0; st < n_st; ++st) {
        for (int64_t x = nc0 + st * kT; x < std::min(nc0 + (st + 1) * kT, nblocks * BS);) {
          const int n = static_cast<int>(std::min<int64_t>(nc0 + (st + 1) * kT - x, BS - x % BS));
          const bf16_t* k = cache + static_cast<int64_t>(blocks[x / BS]) * g.block_stride +
                            kvh * g.head_stride + (x % BS) * g.slot_stride;
          prefetch_region_l2(k, n * g.slot_stride * 2);
          prefetch_region_l2(k + g.kv_stride, n * g.slot_stride * 2);
          x += n;
        }
        transpose_keys<D>(kr + st * kT, Kt.data() + st * kT * D / 2);
      }
      for (int jp = 0; jp < n_ks * 16; ++jp) pair_values<D>(vr[2 * jp], vr[2 * jp + 1], Vp.data() + jp * D);
      memory_fence();
      int pend = -1, pend_rt = 0;  // the first row of the tile whose P V waits; its rows
      auto configure = [&](int rt) {
        if constexpr (Amx)
          if (rt != configured) amx_configure(configured = rt, 64, 16, D % 32 * 2);
      };
      auto finish = [&]() {  // O = O * corr + P V for the waiting tile
        if (pend < 0) return;
        const int buf = (pend / kT) & 1;
        configure(pend_rt);
        if constexpr (Amx)
          amx_pv<D>(P[buf], pend_rt, CS, Vp.data(), n_ks, PV);
        else
          dp_pv<D>(P[buf], pend_rt, CS, Vp.data(), n_ks, PV);
        combine<D>(Ob.data() + static_cast<size_t>(kvh * per_kvh + pend) * D, PV, corr[buf], pend_rt);
        pend = -1;
      };
      for (int rt0 = 0; rt0 < per_kvh; rt0 += kT) {
        const int rt = std::min(kT, per_kvh - rt0), buf = (rt0 / kT) & 1;
        if (rt != pend_rt) finish();  // (a tile of other rows: configured apart)
        configure(rt);
        const bf16_t* Qt = Qb.data() + static_cast<size_t>(kvh * per_kvh + rt0) * D;
        if constexpr (Amx)
          amx_scores<D>(Qt, rt, Kt.data(), n_st, S, CS);
        else
          dp_scores<D>(Qt, rt, Kt.data(), n_st, S, CS);
        // Softmax; P rounded to bfloat16, zeros past the row's limit.
        int lim[kT];
        for (int m = 0; m < rt; ++m) lim[m] = row_limit(rt0 + m, c0, cslots);
        const int r0 = kvh * per_kvh + rt0;
        tile_softmax(S, CS, lim, rt, n_ks * 32, mrow.data() + r0, lrow.data() + r0 * 16, P[buf], corr[buf]);
        finish();
        pend = rt0;
        pend_rt = rt;
      }
      finish();  // (before the next kv head's values)
    }
  }
  if constexpr (Amx) _tile_release();
  for (int r = 0; r < rows; ++r) lrow[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(lrow.data() + r * 16));
  write_rows<D>(out, out_row_stride, Ob.data(), lrow.data(), KVH, nq, G);
}

#undef PDK_UPTO
#undef PDK_ZERO
#undef PDK_QK
#undef PDK_QK_TAIL
#undef PDK_STORE_S
#undef PDK_ZERO_O
#undef PDK_PV
#undef PDK_STORE_O

}  // namespace

TileFn<bf16_t> bf16_tile_fn(int64_t D, bool amx) {
  return by_head_dim(D, [amx](auto d) -> TileFn<bf16_t> {
    constexpr int kD = decltype(d)::value;
    return amx ? attend_tile_bf16<kD, true> : attend_tile_bf16<kD, false>;
  });
}

#pragma GCC pop_options

}  // namespace pdk
