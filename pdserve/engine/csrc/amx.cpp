// The tile unit's (AMX) kernels: the dense GEMM's amx family (families.h's kAmx) on
// TDPBF16PS, and W8A8's amx family (families.h's kAmx) on TDPBSSD (further down).
//
// Dense: y[M, N] = x[M, K] @ W^T + b, batch-invariant by construction like the other
// families. The weight is bf16dp's packed layout ([K/2][64][2] per group of 64
// outputs): 16 consecutive pairs of K of one 16-output block are exactly a B tile (16
// rows of 64 bytes, the group's row stride apart). x is rounded to bfloat16 as bf16dp
// does. A tile of 16 rows of x times a group's blocks accumulates in up to four C
// tiles, 32 values of K per TDPBF16PS, K ascending; a K that is not a multiple of 32
// ends with one narrower step. Where K is a multiple of 32 (and at most kPairMaxK),
// two tiles of rows go together through two blocks at a time (tile_sums_2x2): each C
// tile still takes the same steps in the same order. Which values of K a step holds
// depends on K alone, and a tile row's sums on that row alone, so the rows beside it
// (M, its place in a tile or pair of tiles, the number of rows a tile is configured
// with, the cache chunk) never change its result. The tile
// unit's rounding is its own (it is not vdpbf16ps's chain, nor float32's), so this
// family agrees with the others to rounding, and with itself bit for bit.
//
// Linux hands a process the tile registers' state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM); amx_ready() asks once. Each thread loads its own tile
// configuration before its tiles and releases it after.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "vec512.h"

namespace pdk {

bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

namespace {
void require_tiles() {
  TORCH_CHECK(amx_ready(), "amx: Linux did not grant this process the tile registers");
}
}  // namespace

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

void amx_configure(int64_t rows, int64_t a_bytes, int64_t b_rows, int64_t tail_bytes) {
  struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } c;
  for (int t = 0; t < 4; ++t) c.colsb[t] = 64, c.rows[t] = static_cast<uint8_t>(rows);
  c.colsb[4] = static_cast<uint16_t>(a_bytes), c.rows[4] = static_cast<uint8_t>(rows);
  c.colsb[5] = 64, c.rows[5] = static_cast<uint8_t>(b_rows);
  if (tail_bytes > 0) {
    c.colsb[6] = static_cast<uint16_t>(tail_bytes), c.rows[6] = static_cast<uint8_t>(rows);
    c.colsb[7] = 64, c.rows[7] = static_cast<uint8_t>(tail_bytes / 4);
  } else {  // a second A and B (the dense 2 x 2 step, tile_sums_2x2)
    c.colsb[6] = static_cast<uint16_t>(a_bytes), c.rows[6] = static_cast<uint8_t>(rows);
    c.colsb[7] = 64, c.rows[7] = static_cast<uint8_t>(b_rows);
  }
  memory_fence();
  _tile_loadconfig(&c);
}

namespace {

constexpr int64_t kBlock = 16, kGroup = 64;  // bf16dp's packing (gemm.cpp)
constexpr int64_t kStepK = 32;               // values of K a full step holds
constexpr int64_t kMC = 128;  // rows of x per cache chunk (W8A8; at least, for bf16)
// bf16 x in chunks of up to this many bytes (whole pairs of tiles): each chunk reads
// every group's weights once, so fewer chunks read a large weight fewer times. Measured
// on the AMX Xeon (one thread, 1024 rows, 2 x 2 steps): the 576 -> 2 x 1536 gate/up
// with SiLU·mul 4.00 -> 3.51 ms at 448-row chunks rather than 128; 256 KB chunks
// measured alike; W8A8's 128-row chunks measured best as they are.
constexpr int64_t kChunkBytes = 512 << 10;
// The dense 2 x 2 step (tile_sums_2x2) reads each pair of row tiles' x once per two
// blocks: where that pair fits the L1 data cache (48 KB; K <= 768). Measured (same
// setting, 1024 rows): 1x4 -> 2x2 576x576 0.88 -> 0.76 ms, 960x576 1.39 -> 1.20, the
// gate/up 4.58 -> 4.00; but 576x1536 (K 1536) 2.19 -> 2.35.
constexpr int64_t kPairMaxK = 768;

int64_t dense_chunk(int64_t K) {
  return std::max(kMC, kChunkBytes / (K * 2) / (2 * kBlock) * (2 * kBlock));
}

// Outputs of at least this many bytes are written with non-temporal stores, which
// skip the read for ownership. Measured on the AMX Xeon (~13 GB/s, 2 MB L2 a core): a
// 32 x 128-token prefill's 576 -> 3072 matmuls (25 MB outputs) took 790-794 ms
// instead of 927-961, the prefill 2187-2245 ms instead of 2285-2437. At 4 MB the
// smaller outputs streamed too and the ops reading them next (attention, the norms)
// lost as much as the matmuls gained.
constexpr int64_t kStreamBytes = 16 << 20;

// Whether y [M, N] is written with streaming stores (whole 16-output blocks of
// 64-byte aligned rows only).
bool streams(const float* y, int64_t M, int64_t N) {
  return M * N * 4 >= kStreamBytes && N % kBlock == 0 && reinterpret_cast<uintptr_t>(y) % 64 == 0;
}

// The tile intrinsics take their tile numbers as literal text: C tile T, then the
// full step's A (4) and B (5) or the tail's (6, 7).
#define PDK_STEP(T) _tile_loadd(5, B + (T) * 2 * kBlock, ldb); _tile_dpbf16ps(T, 4, 5);
#define PDK_TAIL(T) _tile_loadd(7, B + (T) * 2 * kBlock, ldb); _tile_dpbf16ps(T, 6, 7);
#define PDK_STORE(T) _tile_stored(T, c + (T) * kBlock * kBlock, kBlock * 4);
#define PDK_EACH(X) X(0) if constexpr (NP > 1) { X(1) } if constexpr (NP > 2) { X(2) } \
                    if constexpr (NP > 3) { X(3) }
#define PDK_ZERO(T) _tile_zero(T);

// A step's B tiles of a group are one contiguous run of NP KB, and the
// group's steps and the next group follow it. The first row tile of a call streams
// them from memory (all of a decode step's rows fit one tile), so it prefetches the
// run kPrefetchSteps steps ahead. Measured on the AMX Xeon, one decode row, bf16,
// two threads, alternated 12 times in one process: 24.6 -> 19.3 ms a token (median).
constexpr int64_t kPrefetchSteps = 2;

// The sums of a tile's rows of x (bf16, K per row) times one group of NP blocks (P
// its first pair): block p's row m at c[(p * 16 + m) * 16]; pf: prefetch ahead.
template <int NP>
void tile_sums(const bf16_t* x, int64_t K, const bf16_t* P, float* c, bool pf) {
  const int64_t ldp = NP * 2 * kBlock, ldb = ldp * 2, lda = K * 2;
  PDK_EACH(PDK_ZERO)
  int64_t k0 = 0;
  for (; k0 + kStepK <= K; k0 += kStepK) {
    const bf16_t* B = P + (k0 / 2) * ldp;
    if (pf) prefetch_region(B + kPrefetchSteps * (kStepK / 2) * ldp, kStepK * ldp);
    _tile_loadd(4, x + k0, lda);
    PDK_EACH(PDK_STEP)
  }
  if (k0 < K) {
    const bf16_t* B = P + (k0 / 2) * ldp;
    _tile_loadd(6, x + k0, lda);
    PDK_EACH(PDK_TAIL)
  }
  PDK_EACH(PDK_STORE)
  memory_fence();
}

// The sums of two full tiles of rows of x (32 rows, K a multiple of 32) times two
// blocks of a group (P the first's first pair, ldp the group's pair stride): row tile
// r's rows times block p at c[((p * 2 + r) * 16 + m) * 16]. Each C tile takes the same
// TDPBF16PS steps, K ascending, as tile_sums gives it (the same bits), but a step
// loads 2 A and 2 B tiles for its 4 products where tile_sums loads 1 and 4: half the
// weight read from L2 per product.
void tile_sums_2x2(const bf16_t* x, int64_t K, const bf16_t* P, int64_t ldp, float* c) {
  const int64_t ldb = ldp * 2, lda = K * 2;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k0 = 0; k0 < K; k0 += kStepK) {
    const bf16_t* B = P + (k0 / 2) * ldp;
    _tile_loadd(4, x + k0, lda);
    _tile_loadd(6, x + kBlock * K + k0, lda);
    _tile_loadd(5, B, ldb);
    _tile_loadd(7, B + 2 * kBlock, ldb);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 6, 5);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 6, 7);
  }
  _tile_stored(0, c, kBlock * 4);
  _tile_stored(1, c + kBlock * kBlock, kBlock * 4);
  _tile_stored(2, c + 2 * kBlock * kBlock, kBlock * 4);
  _tile_stored(3, c + 3 * kBlock * kBlock, kBlock * 4);
  memory_fence();
}

inline void store16(float* dst, __m512 v, __mmask16 mask, bool stream) {
  if (stream && mask == 0xFFFF)
    _mm512_stream_ps(dst, v);
  else
    _mm512_mask_storeu_ps(dst, mask, v);
}
inline void store16(bf16_t* dst, __m512 v, __mmask16 mask, bool) { store16_bf16(dst, v, mask); }

// `rows` rows of x times one group of NP blocks -> y[:, n0 ..] (+ bias).
template <int NP>
void tile_group(const bf16_t* x, int64_t rows, int64_t K, const bf16_t* P, float* y, int64_t N,
                int64_t n0, const float* bias, bool stream, bool pf) {
  alignas(64) float c[4 * kBlock * kBlock];
  tile_sums<NP>(x, K, P, c, pf);
  for (int p = 0; p < NP; ++p) {
    const int64_t n = n0 + p * kBlock;
    if (n >= N) break;
    const __mmask16 mask =
        N - n >= kBlock ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m)
      store16(y + m * N + n, _mm512_add_ps(_mm512_load_ps(c + (p * kBlock + m) * kBlock), b),
              mask, stream);
  }
}

// 32 rows of x (two full tiles) times one group of NP (2 or 4) whole blocks, K a
// multiple of 32 -> y[:, n0 ..] (+ bias), the same bits as tile_group.
template <int NP>
void tile_group_2x2(const bf16_t* x, int64_t K, const bf16_t* P, float* y, int64_t N,
                    int64_t n0, const float* bias, bool stream) {
  alignas(64) float c[4 * kBlock * kBlock];
  const int64_t ldp = NP * 2 * kBlock;
  for (int p0 = 0; p0 < NP; p0 += 2) {
    tile_sums_2x2(x, K, P + p0 * 2 * kBlock, ldp, c);
    for (int p = 0; p < 2; ++p) {
      const int64_t n = n0 + (p0 + p) * kBlock;
      const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
      for (int64_t m = 0; m < 2 * kBlock; ++m)
        store16(y + m * N + n, _mm512_add_ps(_mm512_load_ps(c + (p * 2 * kBlock + m) * kBlock), b),
                0xFFFF, stream);
    }
  }
}

// A fused gate/up weight's group of gates (Pg) and of their ups (Pu, I outputs on):
// y[:, n0 ..] = silu(x Wg^T + bg) * (x Wu^T + bu), y [rows, I]. The sums and the bias
// are tile_group's, the rest pointwise.cpp's silu_mul, lane for lane (silu_mul16): the
// same bits as gemm then silu_mul, without the [rows, 2I] float32 round trip.
template <typename T>  // float, or bf16_t (store16_bf16)
void silu_group(const bf16_t* x, int64_t rows, int64_t K, const bf16_t* Pg, const bf16_t* Pu,
                T* y, int64_t I, int64_t n0, const float* bias, bool stream, bool pf) {
  alignas(64) float cg[4 * kBlock * kBlock], cu[4 * kBlock * kBlock];
  constexpr int NP = 4;
  tile_sums<NP>(x, K, Pg, cg, pf);
  tile_sums<NP>(x, K, Pu, cu, pf);
  for (int p = 0; p < NP; ++p) {
    const int64_t n = n0 + p * kBlock;
    const __m512 bg = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    const __m512 bu = bias ? _mm512_loadu_ps(bias + I + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t i = (p * kBlock + m) * kBlock;
      store16(y + m * I + n, silu_mul16(_mm512_add_ps(_mm512_load_ps(cg + i), bg),
                                        _mm512_add_ps(_mm512_load_ps(cu + i), bu)),
              0xFFFF, stream);
    }
  }
}

// silu_group for two full tiles of rows (32), K a multiple of 32: the same bits.
template <typename T>
void silu_group_2x2(const bf16_t* x, int64_t K, const bf16_t* Pg, const bf16_t* Pu, T* y,
                    int64_t I, int64_t n0, const float* bias, bool stream) {
  alignas(64) float cg[4 * kBlock * kBlock], cu[4 * kBlock * kBlock];
  constexpr int64_t ldp = 4 * 2 * kBlock;
  for (int p0 = 0; p0 < 4; p0 += 2) {
    tile_sums_2x2(x, K, Pg + p0 * 2 * kBlock, ldp, cg);
    tile_sums_2x2(x, K, Pu + p0 * 2 * kBlock, ldp, cu);
    for (int p = 0; p < 2; ++p) {
      const int64_t n = n0 + (p0 + p) * kBlock;
      const __m512 bg = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
      const __m512 bu = bias ? _mm512_loadu_ps(bias + I + n) : _mm512_setzero_ps();
      for (int64_t m = 0; m < 2 * kBlock; ++m) {
        const int64_t i = (p * 2 * kBlock + m) * kBlock;
        store16(y + m * I + n, silu_mul16(_mm512_add_ps(_mm512_load_ps(cg + i), bg),
                                          _mm512_add_ps(_mm512_load_ps(cu + i), bu)),
                0xFFFF, stream);
      }
    }
  }
}

// body(m0, m1) over rows [0, M) of one thread's share: whole 16-row tiles in chunks
// of `chunk` rows, then the shorter last tile, each with the tiles configured for it.
template <typename Body>
void over_rows(int64_t M, int64_t chunk, int64_t a_bytes, int64_t b_rows, int64_t tail_bytes,
               Body body) {
  const int64_t full = M / kBlock * kBlock;
  if (full > 0) {
    amx_configure(kBlock, a_bytes, b_rows, tail_bytes);
    for (int64_t m0 = 0; m0 < full; m0 += chunk) body(m0, std::min(m0 + chunk, full));
  }
  if (full < M) {
    amx_configure(M - full, a_bytes, b_rows, tail_bytes);
    body(full, M);
  }
  _tile_release();
}

// Rows [m0, m1) of x, 16 a tile (the configured row count for the last, shorter
// one), times groups [g0, g1).
void rows_times_groups(const bf16_t* x, int64_t m0, int64_t m1, int64_t K, const bf16_t* P,
                       int64_t n_pad, float* y, int64_t N, int64_t g0, int64_t g1,
                       const float* bias, bool stream) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t width = std::min(kGroup, n_pad - g * kGroup), n0 = g * kGroup;
    const bf16_t* Pg = P + g * kGroup * K;
    int64_t m = m0;
    if (K % kStepK == 0 && K <= kPairMaxK && width % (2 * kBlock) == 0 && g * kGroup + width <= N)
      for (; m + 2 * kBlock <= m1; m += 2 * kBlock) {  // two full tiles at a time
        if (width == kGroup)
          tile_group_2x2<4>(x + m * K, K, Pg, y + m * N, N, n0, bias, stream);
        else
          tile_group_2x2<2>(x + m * K, K, Pg, y + m * N, N, n0, bias, stream);
      }
    for (; m < m1; m += kBlock) {
      const int64_t rows = std::min(kBlock, m1 - m);
      const bf16_t* xm = x + m * K;
      float* ym = y + m * N;
      const bool pf = m == 0;
      switch (width / kBlock) {
        case 4: tile_group<4>(xm, rows, K, Pg, ym, N, n0, bias, stream, pf); break;
        case 3: tile_group<3>(xm, rows, K, Pg, ym, N, n0, bias, stream, pf); break;
        case 2: tile_group<2>(xm, rows, K, Pg, ym, N, n0, bias, stream, pf); break;
        default: tile_group<1>(xm, rows, K, Pg, ym, N, n0, bias, stream, pf); break;
      }
    }
  }
}

// ----------------------------------------------------------- W8A8 (AMX-INT8)
// families.h's kAmx: the same arithmetic as its other families (see there), the
// integer part on TDPBSSD. avx512vnni's packed weight ([K/4][64][4] per group of 64
// outputs) holds, for one group of G values of K, a B tile per 16-output block (G/4
// rows of 64 bytes); qx (int8, signed) per row holds the A tile's rows. One TDPBSSD
// is then one block's exact int32 dot products over one activation group, and the
// float part that follows -- acc += float(dot) * sx[m, g], group by group, then
// acc * sw + b -- is the other families' operations in their order: bit-identical.

// A tile of rows of qx times one 16-output block (B its first step of 4 k, ldb
// bytes a step) -> y[:, n ..]: acc = sum over groups, in order, of float(dot) *
// sx[m, g]; y = acc * sw + b. st [ng][16] holds the tile rows' scales group by
// group (0 past the configured rows); out(m, row m's 16 values) takes the results
// (sc: the block's sw, b: its bias or 0). The 16 accumulators stay in registers. Group
// g's sums are stored to a ring of kRing buffers and folded kLag groups later: a
// vector load of a tile store's bytes right after it waits for the store to drain.
// Measured (one core, an isolated loop of this pattern): 30 ns a group folded at
// once, 21 ns folded two groups on, 20 ns with nothing stored to the folded buffer.
constexpr int64_t kRing = 4, kLag = 2;
#define PDK_W8_STEP(C, g)                                                     \
  _tile_zero(C);                                                              \
  _tile_loadd(4, qx + (g) * G, K);                                            \
  _tile_loadd(5, B + (g) * (G / 4) * ldb, ldb);                               \
  _tile_dpbssd(C, 4, 5);                                                      \
  _tile_stored(C, c[(g) % kRing], kBlock * 4);                                \
  memory_fence();                                                             \
  if ((g) >= kLag) PDK_W8_FOLD((g) - kLag)
#define PDK_W8_FOLD(g)                                                                   \
  _Pragma("GCC unroll 16") for (int m = 0; m < kBlock; ++m) acc[m] = _mm512_add_ps(      \
      acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[(g) % kRing] + m * kBlock)), \
                            _mm512_set1_ps(st[(g) * kBlock + m])));
template <typename Out>
void w8_tile_block(const int8_t* qx, int64_t rows, int64_t K, int64_t G, const int8_t* B,
                   int64_t ldb, const float* st, __m512 sc, __m512 b, Out out) {
  const int64_t ng = K / G;
  alignas(64) int32_t c[kRing][kBlock * kBlock];
  __m512 acc[kBlock];
#pragma GCC unroll 16
  for (int m = 0; m < kBlock; ++m) acc[m] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 1 < ng; g += 2) {
    PDK_W8_STEP(0, g)
    PDK_W8_STEP(1, g + 1)
  }
  if (g < ng) { PDK_W8_STEP(0, g) }
  for (g = std::max<int64_t>(0, ng - kLag); g < ng; ++g) { PDK_W8_FOLD(g) }
#pragma GCC unroll 16
  for (int m = 0; m < kBlock; ++m) {
    if (m >= rows) break;
    out(m, _mm512_add_ps(_mm512_mul_ps(acc[m], sc), b));
  }
}
#undef PDK_W8_STEP
#undef PDK_W8_FOLD

// The scales of rows [m0, m1) for w8_tile_block, per row tile: [ng][16].
std::vector<float> tile_scales(const float* sx, int64_t m0, int64_t m1, int64_t ng) {
  const int64_t tiles = (m1 - m0 + kBlock - 1) / kBlock;
  std::vector<float> st(tiles * ng * kBlock);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t r = 0; r < kBlock; ++r) {
        const int64_t m = m0 + t * kBlock + r;
        st[(t * ng + g) * kBlock + r] = m < m1 ? sx[m * ng + g] : 0.f;
      }
  return st;
}

// Rows [m0, m1) of qx times groups [g0, g1) of 64 outputs, block by block.
void w8_rows_times_groups(const int8_t* qx, int64_t m0, int64_t m1, int64_t K, int64_t G,
                          const int8_t* P, int64_t n_pad, const float* sx, const float* sw,
                          const float* bias, float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t ng = K / G;
  const std::vector<float> st = tile_scales(sx, m0, m1, ng);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t width = std::min(kGroup, n_pad - g * kGroup);
    for (int64_t n = g * kGroup; n < g * kGroup + width && n < N; n += kBlock) {
      const __mmask16 mask =
          N - n >= kBlock ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
      const __m512 sc = _mm512_maskz_loadu_ps(mask, sw + n);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
      for (int64_t m = m0; m < m1; m += kBlock) {
        float* ym = y + m * N + n;
        w8_tile_block(qx + m * K, std::min(kBlock, m1 - m), K, G,
                      P + g * kGroup * K + (n % kGroup) * 4, width * 4,
                      st.data() + (m - m0) / kBlock * ng * kBlock, sc, b,
                      [=](int r, __m512 v) { _mm512_mask_storeu_ps(ym + r * N, mask, v); });
      }
    }
  }
}

// A fused gate/up weight's gates [g0, g1) of 64 (their ups I outputs on) for rows
// [m0, m1): y = silu(gate) * up, y [rows, I]; each block's gate and up values are
// w8_rows_times_groups's, the rest pointwise.cpp's silu_mul (silu_mul16).
void w8_silu_rows(const int8_t* qx, int64_t m0, int64_t m1, int64_t K, int64_t G,
                  const int8_t* P, const float* sx, const float* sw, const float* bias, float* y,
                  int64_t I, int64_t g0, int64_t g1) {
  const int64_t ng = K / G;
  const std::vector<float> st = tile_scales(sx, m0, m1, ng);
  alignas(64) float gate[kBlock][kBlock];
  for (int64_t n = g0 * kGroup; n < g1 * kGroup; n += kBlock) {
    const int8_t* Pg = P + n / kGroup * kGroup * K + (n % kGroup) * 4;
    const int8_t* Pu = Pg + I * K;
    const __m512 sg = _mm512_loadu_ps(sw + n), su = _mm512_loadu_ps(sw + I + n);
    const __m512 bg = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    const __m512 bu = bias ? _mm512_loadu_ps(bias + I + n) : _mm512_setzero_ps();
    for (int64_t m = m0; m < m1; m += kBlock) {
      const int64_t rows = std::min(kBlock, m1 - m);
      const float* sm = st.data() + (m - m0) / kBlock * ng * kBlock;
      float* ym = y + m * I + n;
      w8_tile_block(qx + m * K, rows, K, G, Pg, kGroup * 4, sm, sg, bg,
                    [&gate](int r, __m512 v) { _mm512_store_ps(gate[r], v); });
      w8_tile_block(qx + m * K, rows, K, G, Pu, kGroup * 4, sm, su, bu,
                    [&gate, ym, I](int r, __m512 v) {
                      _mm512_storeu_ps(ym + r * I, silu_mul16(_mm512_load_ps(gate[r]), v));
                    });
    }
  }
}

}  // namespace

void amx_gemm(const bf16_t* x, int64_t M, int64_t K, const bf16_t* P, int64_t n_pad, float* y,
              int64_t N, const float* bias) {
  require_tiles();
  const int64_t groups = (n_pad + kGroup - 1) / kGroup;
  const bool stream = streams(y, M, N);
  memory_fence();  // x, written by the caller, is read by tile loads only
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    over_rows(M, dense_chunk(K), 64, kStepK / 2, K % kStepK * 2, [&](int64_t m0, int64_t m1) {
      rows_times_groups(x, m0, m1, K, P, n_pad, y, N, g0, g1, bias, stream);
    });
    if (stream) _mm_sfence();  // the streamed stores, before the caller reads them
  });
}

template <typename T>
void amx_gemm_silu_mul(const bf16_t* x, int64_t M, int64_t K, const bf16_t* P, T* y,
                       int64_t I, const float* bias) {
  require_tiles();
  TORCH_CHECK(I % kGroup == 0, "amx silu_mul: the intermediate size must be a multiple of 64");
  const int64_t groups = I / kGroup;
  const bool stream = std::is_same_v<T, float> && streams(reinterpret_cast<const float*>(y), M, I);
  memory_fence();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    over_rows(M, dense_chunk(K), 64, kStepK / 2, K % kStepK * 2, [&](int64_t m0, int64_t m1) {
      for (int64_t g = g0; g < g1; ++g) {
        const bf16_t *Pg = P + g * kGroup * K, *Pu = P + (groups + g) * kGroup * K;
        int64_t m = m0;
        if (K % kStepK == 0 && K <= kPairMaxK)
          for (; m + 2 * kBlock <= m1; m += 2 * kBlock)
            silu_group_2x2(x + m * K, K, Pg, Pu, y + m * I, I, g * kGroup, bias, stream);
        for (; m < m1; m += kBlock)
          silu_group(x + m * K, std::min(kBlock, m1 - m), K, Pg, Pu, y + m * I, I, g * kGroup,
                     bias, stream, m == 0);
      }
    });
    if (stream) _mm_sfence();
  });
}

template void amx_gemm_silu_mul(const bf16_t*, int64_t, int64_t, const bf16_t*, float*,
                                int64_t, const float*);
template void amx_gemm_silu_mul(const bf16_t*, int64_t, int64_t, const bf16_t*, bf16_t*,
                                int64_t, const float*);

void amx_w8a8(const int8_t* qx, int64_t M, int64_t K, int64_t G, const int8_t* P,
              int64_t n_pad, const float* sx, const float* sw, const float* bias, float* y,
              int64_t N) {
  require_tiles();
  const int64_t groups = (n_pad + kGroup - 1) / kGroup;
  memory_fence();  // qx, written by the caller, is read by tile loads only
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    over_rows(M, kMC, G, G / 4, 0, [&](int64_t m0, int64_t m1) {
      w8_rows_times_groups(qx, m0, m1, K, G, P, n_pad, sx, sw, bias, y, N, g0, g1);
    });
  });
}

void amx_w8a8_silu_mul(const int8_t* qx, int64_t M, int64_t K, int64_t G, const int8_t* P,
                       const float* sx, const float* sw, const float* bias, float* y,
                       int64_t I) {
  require_tiles();
  TORCH_CHECK(I % kGroup == 0, "amx silu_mul: the intermediate size must be a multiple of 64");
  memory_fence();
  at::parallel_for(0, I / kGroup, 1, [&](int64_t g0, int64_t g1) {
    over_rows(M, kMC, G, G / 4, 0, [&](int64_t m0, int64_t m1) {
      w8_silu_rows(qx, m0, m1, K, G, P, sx, sw, bias, y, I, g0, g1);
    });
  });
}

// Operations (2 per multiply-add) of `iters` steps of four independent tile dot
// products: TDPBF16PS (16 x 16 x 32) or, for Int8, TDPBSSD (16 x 16 x 64).
template <bool Int8>
double tile_peak_loop(int64_t iters) {
  require_tiles();
  alignas(64) static uint8_t a[kBlock * 64];
  amx_configure(kBlock, 64, 16);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  for (int64_t t = 0; t < iters; ++t) {
    if constexpr (Int8) {
      _tile_dpbssd(0, 4, 5); _tile_dpbssd(1, 4, 5); _tile_dpbssd(2, 4, 5); _tile_dpbssd(3, 4, 5);
    } else {
      _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 5); _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_release();
  return 2.0 * kBlock * kBlock * (Int8 ? 64 : 32) * 4 * static_cast<double>(iters);
}

double amx_peak_loop(int64_t iters) { return tile_peak_loop<false>(iters); }
double amx_int8_peak_loop(int64_t iters) { return tile_peak_loop<true>(iters); }

#undef PDK_STEP
#undef PDK_TAIL
#undef PDK_STORE
#undef PDK_EACH
#undef PDK_ZERO
#pragma GCC pop_options

}  // namespace pdk
