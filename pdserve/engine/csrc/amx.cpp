// AMX-BF16 family of the dense GEMM (gemm.cpp's kAmx): y[M, N] = x[M, K] @ W^T + b
// on the tile unit's TDPBF16PS, batch-invariant by construction like the others.
//
// The weight is bf16dp's packed layout ([K/2][64][2] per group of 64 outputs): 16
// consecutive pairs of K of one 16-output block are exactly a B tile (16 rows of
// 64 bytes, the group's row stride apart). x is rounded to bfloat16 as bf16dp does.
// A tile of 16 rows of x times a group's blocks accumulates in up to four C tiles,
// 32 values of K per TDPBF16PS, K ascending; a K that is not a multiple of 32 ends
// with one narrower step. Which values of K a step holds depends on K alone, and a
// tile row's sums on that row alone, so the rows beside it (M, its place in a tile,
// the number of rows a tile is configured with) never change its result. The
// tile unit's rounding is its own (it is not vdpbf16ps's chain, nor float32's), so
// this family agrees with the others to rounding, and with itself bit for bit.
//
// Linux hands a process the tile registers' state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM); amx_ready() asks once. Each thread loads its own tile
// configuration before its tiles and releases it after.
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace pdk {

bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")
namespace {

constexpr int64_t kBlock = 16, kGroup = 64;  // bf16dp's packing (gemm.cpp)
constexpr int64_t kStepK = 32;               // values of K a full step holds
constexpr int64_t kMC = 128;                 // rows of x per cache chunk

// GCC's tile intrinsics are asm statements that do not tell the compiler which
// memory they read or write (ldtilecfg: only the first 8 bytes of its config), so
// stores before them and loads after them are fenced by hand.
inline void memory_fence() { asm volatile("" ::: "memory"); }

// Tiles: 0-3 the C accumulators, 4/5 A and B of a full step, 6/7 of the K tail.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int64_t rows, int64_t k_tail) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) c.colsb[t] = 64, c.rows[t] = static_cast<uint8_t>(rows);
  c.colsb[5] = 64, c.rows[5] = kStepK / 2;
  if (k_tail > 0) {
    c.colsb[6] = static_cast<uint16_t>(k_tail * 2), c.rows[6] = static_cast<uint8_t>(rows);
    c.colsb[7] = 64, c.rows[7] = static_cast<uint8_t>(k_tail / 2);
  }
  memory_fence();
  _tile_loadconfig(&c);
}

// The tile intrinsics take their tile numbers as literal text: C tile T, then the
// full step's A (4) and B (5) or the tail's (6, 7).
#define PDK_STEP(T) _tile_loadd(5, B + (T) * 2 * kBlock, ldb); _tile_dpbf16ps(T, 4, 5);
#define PDK_TAIL(T) _tile_loadd(7, B + (T) * 2 * kBlock, ldb); _tile_dpbf16ps(T, 6, 7);
#define PDK_STORE(T) _tile_stored(T, c + (T) * kBlock * kBlock, kBlock * 4);
#define PDK_EACH(X) X(0) if constexpr (NP > 1) { X(1) } if constexpr (NP > 2) { X(2) } \
                    if constexpr (NP > 3) { X(3) }
#define PDK_ZERO(T) _tile_zero(T);

// `rows` rows of x (bf16, K per row) times one group of NP blocks; P its first pair.
template <int NP>
void tile_group(const bf16_t* x, int64_t rows, int64_t K, const bf16_t* P, float* y, int64_t N,
                int64_t n0, const float* bias) {
  const int64_t ldp = NP * 2 * kBlock, ldb = ldp * 2, lda = K * 2;
  PDK_EACH(PDK_ZERO)
  int64_t k0 = 0;
  for (; k0 + kStepK <= K; k0 += kStepK) {
    const bf16_t* B = P + (k0 / 2) * ldp;
    _tile_loadd(4, x + k0, lda);
    PDK_EACH(PDK_STEP)
  }
  if (k0 < K) {
    const bf16_t* B = P + (k0 / 2) * ldp;
    _tile_loadd(6, x + k0, lda);
    PDK_EACH(PDK_TAIL)
  }
  alignas(64) float c[4 * kBlock * kBlock];
  PDK_EACH(PDK_STORE)
  memory_fence();
  for (int p = 0; p < NP; ++p) {
    const int64_t n = n0 + p * kBlock;
    if (n >= N) break;
    const __mmask16 mask =
        N - n >= kBlock ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m)
      _mm512_mask_storeu_ps(y + m * N + n, mask,
                            _mm512_add_ps(_mm512_load_ps(c + (p * kBlock + m) * kBlock), b));
  }
}

// Rows [m0, m1) of x, 16 a tile (the configured row count for the last, shorter
// one), times groups [g0, g1).
void rows_times_groups(const bf16_t* x, int64_t m0, int64_t m1, int64_t K, const bf16_t* P,
                       int64_t n_pad, float* y, int64_t N, int64_t g0, int64_t g1,
                       const float* bias) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t width = std::min(kGroup, n_pad - g * kGroup), n0 = g * kGroup;
    const bf16_t* Pg = P + g * kGroup * K;
    for (int64_t m = m0; m < m1; m += kBlock) {
      const int64_t rows = std::min(kBlock, m1 - m);
      const bf16_t* xm = x + m * K;
      float* ym = y + m * N;
      switch (width / kBlock) {
        case 4: tile_group<4>(xm, rows, K, Pg, ym, N, n0, bias); break;
        case 3: tile_group<3>(xm, rows, K, Pg, ym, N, n0, bias); break;
        case 2: tile_group<2>(xm, rows, K, Pg, ym, N, n0, bias); break;
        default: tile_group<1>(xm, rows, K, Pg, ym, N, n0, bias); break;
      }
    }
  }
}

#undef PDK_STEP
#undef PDK_TAIL
#undef PDK_STORE
#undef PDK_EACH
#undef PDK_ZERO

}  // namespace

// x bf16 [M, K] (K even) times bf16dp's packed W [n_pad padded outputs] -> y float32.
void amx_gemm(const bf16_t* x, int64_t M, int64_t K, const bf16_t* P, int64_t n_pad, float* y,
              int64_t N, const float* bias) {
  const int64_t groups = (n_pad + kGroup - 1) / kGroup, full = M / kBlock * kBlock;
  const int64_t k_tail = K % kStepK;
  memory_fence();  // x, written by the caller, is read by tile loads only
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    if (full > 0) {
      configure(kBlock, k_tail);
      for (int64_t m0 = 0; m0 < full; m0 += kMC)
        rows_times_groups(x, m0, std::min(m0 + kMC, full), K, P, n_pad, y, N, g0, g1, bias);
    }
    if (full < M) {
      configure(M - full, k_tail);
      rows_times_groups(x, full, M, K, P, n_pad, y, N, g0, g1, bias);
    }
    _tile_release();
  });
}

// FLOPs of `iters` steps of four independent TDPBF16PS accumulations (16 x 16 x 32).
double amx_peak_loop(int64_t iters) {
  alignas(64) static bf16_t a[kBlock * kStepK];
  configure(kBlock, 0);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  for (int64_t t = 0; t < iters; ++t) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_release();
  return 2.0 * kBlock * kBlock * kStepK * 4 * static_cast<double>(iters);
}
#pragma GCC pop_options

}  // namespace pdk
