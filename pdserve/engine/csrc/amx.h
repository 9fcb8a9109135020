// The tile unit's kernels (amx.cpp), called by gemm.cpp's and w8a8.cpp's amx
// families. Each entry raises an error where Linux did not grant this process the
// tile state (amx_ready()); callers choose amx only where the CPU's flags have it.
#pragma once

#include <cstdint>

#include "vec.h"

namespace pdk {

// Asks Linux once for the tile state (arch_prctl); whether it was granted.
bool amx_ready();
// x bf16 [M, K] (K even) times bf16dp's packed W [n_pad padded outputs] -> y float32.
void amx_gemm(const bf16_t* x, int64_t M, int64_t K, const bf16_t* P, int64_t n_pad, float* y,
              int64_t N, const float* bias);
// qx int8 [M, K] with scales sx [M, K / G] times avx512vnni's packed W8A8 weight -> y.
void amx_w8a8(const int8_t* qx, int64_t M, int64_t K, int64_t G, const int8_t* P,
              int64_t n_pad, const float* sx, const float* sw, const float* bias, float* y,
              int64_t N);
// Peak loops (operations of `iters` steps): TDPBF16PS, TDPBSSD.
double amx_peak_loop(int64_t iters);
double amx_int8_peak_loop(int64_t iters);

}  // namespace pdk
