// The tile unit's kernels (amx.cpp), called by gemm.cpp's and w8a8.cpp's amx
// families, and its configuration (attention_bf16.cpp's amx family loads it too).
// Each entry raises an error where Linux did not grant this process the tile state
// (amx_ready()); callers choose amx only where the CPU's flags have it.
#pragma once

#include <cstdint>

#include "vec.h"

namespace pdk {

// Asks Linux once for the tile state (arch_prctl); whether it was granted.
bool amx_ready();
// Loads this thread's tile configuration: tiles 0-3 (the C accumulators) and 4 (A)
// `rows` rows of 64 / a_bytes bytes, 5 (B) b_rows rows of 64 bytes; when tail_bytes
// > 0, a K tail's A (6: rows of tail_bytes) and B (7: tail_bytes / 4 rows of 64).
void amx_configure(int64_t rows, int64_t a_bytes, int64_t b_rows, int64_t tail_bytes = 0);
// GCC's tile intrinsics are asm statements that do not tell the compiler which
// memory they read or write (ldtilecfg: only the first 8 bytes of its config), so
// stores before them and loads after them are fenced by hand.
inline void memory_fence() { asm volatile("" ::: "memory"); }
// x bf16 [M, K] (K even) times bf16dp's packed W [n_pad padded outputs] -> y float32.
void amx_gemm(const bf16_t* x, int64_t M, int64_t K, const bf16_t* P, int64_t n_pad, float* y,
              int64_t N, const float* bias);
// silu(gate) * up from a fused gate/up weight packed like amx_gemm's (2I outputs:
// I gates, then their ups; I a multiple of 64) -> y [M, I], float32 (T = float: the
// same bits as amx_gemm then pointwise.cpp's silu_mul) or bfloat16 (T = bf16_t: those
// through to_bf16).
template <typename T>
void amx_gemm_silu_mul(const bf16_t* x, int64_t M, int64_t K, const bf16_t* P, T* y,
                       int64_t I, const float* bias);
// qx int8 [M, K] with scales sx [M, K / G] times avx512vnni's packed W8A8 weight -> y.
void amx_w8a8(const int8_t* qx, int64_t M, int64_t K, int64_t G, const int8_t* P,
              int64_t n_pad, const float* sx, const float* sw, const float* bias, float* y,
              int64_t N);
// silu(gate) * up from a fused gate/up W8A8 weight packed like amx_w8a8's (2I
// outputs: I gates, then their ups; I a multiple of 64) -> y float32 [M, I].
void amx_w8a8_silu_mul(const int8_t* qx, int64_t M, int64_t K, int64_t G, const int8_t* P,
                       const float* sx, const float* sw, const float* bias, float* y,
                       int64_t I);
// Peak loops (operations of `iters` steps): TDPBF16PS, TDPBSSD.
double amx_peak_loop(int64_t iters);
double amx_int8_peak_loop(int64_t iters);

}  // namespace pdk
