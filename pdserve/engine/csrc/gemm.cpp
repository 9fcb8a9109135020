// Dense linear layers for every batch size, batch-invariant by construction:
// y[M, N] = x[M, K] @ W^T + b, x and y float32.
//
// The weight is packed once at load (pack_weight) into groups of 32 (fma) or 64
// (bf16dp) outputs, the last one possibly narrower, whose values are contiguous per step of K, so that one
// vector load gives one step of 16 outputs (a block) and the kernel broadcasts x
// into it (the outer-product form of a GEMM); a group is one contiguous stream.
// Every output element then has its own accumulator lane, summed over K in
// ascending order, one step at a time, and the bias is added last. Nothing else
// touches it: the tile a row lands in, the number of rows M, the thread that owns
// the block and the cache blocking change which elements are computed together,
// never the order of any one element's sum. So a row's result is bit-identical
// however many rows share its call (tests/engine/test_gemm.py checks each family).
//
// Three kernel families, chosen once at load from the CPU's flags (linear.py):
//
//   fma        (AVX2 + FMA)      W float32 or bfloat16, a group [K][32]
//                                (bf16: each block in unpack order, load_block);
//                                x float32; one FMA per k and output.
//   bf16dp     (AVX512-BF16)     W bfloat16, a group [K/2][64][2]; x rounded
//                                to bfloat16 (nearest even, as torch does); one
//                                vdpbf16ps per pair of k and output (2x the MACs
//                                of an fp32 FMA per instruction).
//   amx        (AMX-BF16)        bf16dp's packing and rounding of x, on the tile
//                                unit (amx.cpp): 16 rows x 16 outputs x 32 of K
//                                per TDPBF16PS.
//
// N is padded to whole blocks with zero rows in the packed weight; the padding is
// never written to y. Rows of M are taken MR at a time, blocks of a group NP at a
// time, so that MR x NP accumulators stay in registers; M is cut into chunks of MC
// rows so that a chunk of x stays in cache while the groups stream past it. Threads
// split the groups.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "args.h"
#include "families.h"
#include "vec.h"
#include "vec512.h"

namespace pdk {

namespace {

constexpr int64_t kBlock = 16;  // outputs per block (one vector step)
// Outputs per packed group (one stream): as many blocks as a tile takes at once.
constexpr int64_t kFmaGroup = 32, kDpGroup = 64;
constexpr int64_t kMC = 128;    // rows of x per cache chunk
// Few rows (decode) stream the weight from memory once: each group is prefetched
// this many bytes ahead. Larger batches reuse a group from cache.
constexpr int64_t kPrefetch = 1024;
constexpr int64_t kPrefetchRows = 32;

struct Group {
  int64_t offset;  // elements before it in the packed weight
  int64_t width;   // outputs: 64, or 16 / 32 / 48 for the last
};

inline Group group_at(int64_t g, int64_t group, int64_t K, int64_t n_pad) {
  return {g * group * K, std::min(group, n_pad - g * group)};
}

inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
}

// ------------------------------------------------------------ fma (AVX2)
// One k step of a block: 16 outputs in two registers, outputs 0-7 and 8-15. A
// bfloat16 block is packed in the order (0-3, 8-11, 4-7, 12-15) so that widening
// by unpacking against zero (one load, two unpacks) yields them in that order.
inline void load_block(const float* p, __m256& a, __m256& b) { a = load8(p); b = load8(p + 8); }
inline void load_block(const bf16_t* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

// MR rows x NP blocks. P: the first block's step 0; ldp: elements per step of K.
template <typename T, int MR, int NP, bool PF>
void fma_tile(const float* x, int64_t K, const T* P, int64_t ldp, float* y, int64_t N,
              int64_t n0, const float* bias) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[m][p][0] = acc[m][p][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const T* pk = P + k * ldp;
    if constexpr (PF)  // a step of a group is a cache line (bf16) or two (fp32)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) prefetch(pk + p * kBlock);
    __m256 w[NP][2];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) load_block(pk + p * kBlock, w[p][0], w[p][1]);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        acc[m][p][0] = _mm256_fmadd_ps(w[p][0], xb, acc[m][p][0]);
        acc[m][p][1] = _mm256_fmadd_ps(w[p][1], xb, acc[m][p][1]);
      }
    }
  }
  // The accumulators leave registers only here, each once (a variable index into
  // acc before this point would make the compiler keep them in memory).
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const int64_t n = n0 + p * kBlock;
      if (n < N) {
        alignas(32) float out[kBlock];
        store8(out, acc[m][p][0]);
        store8(out + 8, acc[m][p][1]);
        float* dst = y + m * N + n;
        for (int64_t i = 0; i < std::min(kBlock, N - n); ++i)
          dst[i] = out[i] + (bias ? bias[n + i] : 0.f);
      }
    }
}

}  // namespace

// -------------------------------------------------- bf16dp (AVX512-BF16)
// Compiled for AVX512 here only; called only where the CPU has it (linear.py). The
// region holds nothing but intrinsics on raw pointers, so no inline function of a
// header is ever instantiated with AVX512 code.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
// (declared in vec.h)
void to_bf16(const float* x, int64_t count, bf16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) store16_bf16(out + i, _mm512_loadu_ps(x + i), 0xFFFF);
  if (i < count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (count - i)) - 1);
    store16_bf16(out + i, _mm512_maskz_loadu_ps(mask, x + i), mask);
  }
}

namespace {

// MR rows x NP blocks. P: the first block's first pair; ldp: elements per pair of K.
template <int MR, int NP, bool PF>
void dp_tile(const uint32_t* x2, int64_t K2, const bf16_t* P, int64_t ldp, float* y, int64_t N,
             int64_t n0, const float* bias) {
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    const bf16_t* pj = P + j * ldp;
    __m512bh w[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(pj + p * 2 * kBlock) + kPrefetch,
                                     _MM_HINT_T0);
      w[p] = (__m512bh)_mm512_loadu_si512(pj + p * 2 * kBlock);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x2[m * K2 + j]));
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], w[p], xb);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const int64_t n = n0 + p * kBlock;
      if (n >= N) continue;
      float* dst = y + m * N + n;
      if (N - n >= kBlock) {
        __m512 v = acc[m][p];
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
        _mm512_storeu_ps(dst, v);
      } else {
        const __mmask16 mask = static_cast<__mmask16>((1u << (N - n)) - 1);
        __m512 v = acc[m][p];
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n));
        _mm512_mask_storeu_ps(dst, mask, v);
      }
    }
}

// Rows [0, M) of one group: MR = 6 rows a tile, all its blocks at once.
template <int NP, bool PF>
void dp_group(const uint32_t* x2, int64_t M, int64_t K2, const bf16_t* P, float* y, int64_t N,
              int64_t n0, const float* bias) {
  constexpr int MR = 6;
  constexpr int64_t ldp = NP * 2 * kBlock;
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    dp_tile<MR, NP, PF>(x2 + m * K2, K2, P, ldp, y + m * N, N, n0, bias);
  const uint32_t* xr = x2 + m * K2;
  float* yr = y + m * N;
  switch (M - m) {
    case 1: dp_tile<1, NP, PF>(xr, K2, P, ldp, yr, N, n0, bias); break;
    case 2: dp_tile<2, NP, PF>(xr, K2, P, ldp, yr, N, n0, bias); break;
    case 3: dp_tile<3, NP, PF>(xr, K2, P, ldp, yr, N, n0, bias); break;
    case 4: dp_tile<4, NP, PF>(xr, K2, P, ldp, yr, N, n0, bias); break;
    case 5: dp_tile<5, NP, PF>(xr, K2, P, ldp, yr, N, n0, bias); break;
    default: break;
  }
}

template <bool PF>
void dp_any_group(const uint32_t* x2, int64_t M, int64_t K2, const bf16_t* P, int64_t width,
                  float* y, int64_t N, int64_t n0, const float* bias) {
  switch (width / kBlock) {
    case 4: dp_group<4, PF>(x2, M, K2, P, y, N, n0, bias); break;
    case 3: dp_group<3, PF>(x2, M, K2, P, y, N, n0, bias); break;
    case 2: dp_group<2, PF>(x2, M, K2, P, y, N, n0, bias); break;
    default: dp_group<1, PF>(x2, M, K2, P, y, N, n0, bias); break;
  }
}

void dp_groups(const uint32_t* x2, int64_t M, int64_t K, const bf16_t* P, int64_t n_pad,
               float* y, int64_t N, int64_t g0, int64_t g1, const float* bias) {
  for (int64_t g = g0; g < g1; ++g) {
    const Group gr = group_at(g, kDpGroup, K, n_pad);
    if (M <= kPrefetchRows)
      dp_any_group<true>(x2, M, K / 2, P + gr.offset, gr.width, y, N, g * kDpGroup, bias);
    else
      dp_any_group<false>(x2, M, K / 2, P + gr.offset, gr.width, y, N, g * kDpGroup, bias);
  }
}

// silu(gate) * up of a fused gate/up layer (I gates, then their ups) into y [M, I],
// groups [g0, g1) of 64 gates: kMC rows at a time, dp_group's sums of the gates and
// of their ups (bias added) into two buffers, then pointwise.cpp's silu_mul on 16
// lanes (silu_mul16). The same bits as dp_groups then silu_mul.
template <typename T>  // float, or bf16_t (store16_bf16)
void dp_silu_groups(const uint32_t* x2, int64_t M, int64_t K, const bf16_t* P, int64_t I,
                    T* y, int64_t g0, int64_t g1, const float* bias) {
  std::vector<float> tg(kMC * kDpGroup), tu(kMC * kDpGroup);
  const int64_t K2 = K / 2, ng = I / kDpGroup;
  for (int64_t g = g0; g < g1; ++g) {
    const bf16_t* Pg = P + g * kDpGroup * K;
    const bf16_t* Pu = P + (ng + g) * kDpGroup * K;
    const float* bg = bias ? bias + g * kDpGroup : nullptr;
    const float* bu = bias ? bias + I + g * kDpGroup : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kMC) {
      const int64_t rows = std::min(kMC, M - m0);
      const uint32_t* xm = x2 + m0 * K2;
      if (rows <= kPrefetchRows) {
        dp_group<4, true>(xm, rows, K2, Pg, tg.data(), kDpGroup, 0, bg);
        dp_group<4, true>(xm, rows, K2, Pu, tu.data(), kDpGroup, 0, bu);
      } else {
        dp_group<4, false>(xm, rows, K2, Pg, tg.data(), kDpGroup, 0, bg);
        dp_group<4, false>(xm, rows, K2, Pu, tu.data(), kDpGroup, 0, bu);
      }
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = 0; c < kDpGroup; c += kBlock) {
          const __m512 v = silu_mul16(_mm512_loadu_ps(tg.data() + m * kDpGroup + c),
                                      _mm512_loadu_ps(tu.data() + m * kDpGroup + c));
          if constexpr (std::is_same_v<T, float>)
            _mm512_storeu_ps(y + (m0 + m) * I + g * kDpGroup + c, v);
          else
            store16_bf16(y + (m0 + m) * I + g * kDpGroup + c, v, 0xFFFF);
        }
    }
  }
}

// FLOPs of `iters` steps of 12 independent vdpbf16ps chains (named variables, so
// that they stay in registers; kept alive past the loop).
double dp_peak_loop(int64_t iters) {
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = a;  // bf16 1.0 pairs
#define PDK_DECL(i) __m512 c##i = _mm512_set1_ps(static_cast<float>(i));
  PDK_REP12(PDK_DECL)
#undef PDK_DECL
  for (int64_t t = 0; t < iters; ++t) {
#define PDK_STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
    PDK_REP12(PDK_STEP)
#undef PDK_STEP
  }
#define PDK_KEEP(i) asm volatile("" : : "v"(c##i));
  PDK_REP12(PDK_KEEP)
#undef PDK_KEEP
  return 2.0 * 32 * 12 * static_cast<double>(iters);
}

}  // namespace
#pragma GCC pop_options

namespace {

// Rows [m0, M) of NP blocks with ldp elements per step of K: MR rows a tile.
template <typename T, int MR, int NP, bool PF>
void fma_rows(const float* x, int64_t m0, int64_t M, int64_t K, const T* P, int64_t ldp,
              float* y, int64_t N, int64_t n0, const float* bias) {
  int64_t m = m0;
  for (; m + MR <= M; m += MR)
    fma_tile<T, MR, NP, PF>(x + m * K, K, P, ldp, y + m * N, N, n0, bias);
  const float* xr = x + m * K;
  float* yr = y + m * N;
  switch (M - m) {  // MR - 1 rows at most
    case 1: fma_tile<T, 1, NP, PF>(xr, K, P, ldp, yr, N, n0, bias); break;
    case 2: fma_tile<T, 2, NP, PF>(xr, K, P, ldp, yr, N, n0, bias); break;
    case 3: fma_tile<T, 3, NP, PF>(xr, K, P, ldp, yr, N, n0, bias); break;
    case 4: fma_tile<T, 4, NP, PF>(xr, K, P, ldp, yr, N, n0, bias); break;
    case 5: fma_tile<T, 5, NP, PF>(xr, K, P, ldp, yr, N, n0, bias); break;
    default: break;
  }
}

// Rows [0, M) of one group of NP blocks (2, or 1 for a last group of 16): up to 3
// rows take both blocks at once (at least 4 independent FMA chains), more rows a
// block at a time, 6 rows a tile (12 accumulators: 16 ymm registers in all).
template <typename T, int NP, bool PF>
void fma_group(const float* x, int64_t M, int64_t K, const T* P, float* y, int64_t N,
               int64_t n0, const float* bias) {
  constexpr int64_t ldp = NP * kBlock;
  if (M <= 3) {
    fma_rows<T, 3, NP, PF>(x, 0, M, K, P, ldp, y, N, n0, bias);
    return;
  }
  for (int p = 0; p < NP; ++p)
    fma_rows<T, 6, 1, PF>(x, 0, M, K, P + p * kBlock, ldp, y, N, n0 + p * kBlock, bias);
}

template <typename T>
void fma_groups(const float* x, int64_t M, int64_t K, const T* P, int64_t n_pad, float* y,
                int64_t N, int64_t g0, int64_t g1, const float* bias) {
  for (int64_t g = g0; g < g1; ++g) {
    const Group gr = group_at(g, kFmaGroup, K, n_pad);
    const T* Pg = P + gr.offset;
    const int64_t n0 = g * kFmaGroup;
    if (gr.width == 2 * kBlock) {
      if (M <= kPrefetchRows) fma_group<T, 2, true>(x, M, K, Pg, y, N, n0, bias);
      else fma_group<T, 2, false>(x, M, K, Pg, y, N, n0, bias);
    } else {
      if (M <= kPrefetchRows) fma_group<T, 1, true>(x, M, K, Pg, y, N, n0, bias);
      else fma_group<T, 1, false>(x, M, K, Pg, y, N, n0, bias);
    }
  }
}

// FLOPs of `iters` steps of 12 independent float32 FMA chains.
double fma_peak_loop(int64_t iters) {
  const __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-7f);
#define PDK_DECL(i) __m256 c##i = _mm256_set1_ps(static_cast<float>(i));
  PDK_REP12(PDK_DECL)
#undef PDK_DECL
  for (int64_t t = 0; t < iters; ++t) {
#define PDK_STEP(i) c##i = _mm256_fmadd_ps(c##i, a, b);
    PDK_REP12(PDK_STEP)
#undef PDK_STEP
  }
#define PDK_KEEP(i) asm volatile("" : : "x"(c##i));
  PDK_REP12(PDK_KEEP)
#undef PDK_KEEP
  return 2.0 * 8 * 12 * static_cast<double>(iters);
}


bool known(int64_t family) { return family == kAvx2 || family == kAvx512 || family == kAmx; }

int64_t padded_rows(int64_t N) { return (N + kBlock - 1) / kBlock * kBlock; }

}  // namespace

// One thread's arithmetic peak of a family's instruction (FLOP/s), from a register-
// only loop: what `make bench` measures the kernels' GFLOP/s against.
double family_peak(int64_t family) {
  TORCH_CHECK(known(family), "unknown kernel family ", family);
  if (family == kAmx) {
    return peak_rate(amx_peak_loop);
  }
  return peak_rate(family == kAvx2 ? fma_peak_loop : dp_peak_loop);
}

// W [N, K] float32 / bfloat16 -> the family's packed layout (1-d; zero rows pad N
// to whole blocks).
at::Tensor pack_weight(const at::Tensor& w, int64_t family) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) >= 1 && w.size(1) >= 1, "weight must be [N, K]");
  TORCH_CHECK(known(family), "unknown kernel family ", family);
  const int64_t N = w.size(0), K = w.size(1), n_pad = padded_rows(N);
  if (family == kAvx2) {
    TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
                "fma: weight must be float32 or bfloat16");
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "bf16dp/amx: weight must be bfloat16");
    TORCH_CHECK(K % 2 == 0, "bf16dp/amx: K must be even, got ", K);
  }
  at::Tensor padded = at::zeros({n_pad, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  const int64_t group = family == kAvx2 ? kFmaGroup : kDpGroup;
  std::vector<at::Tensor> parts;
  for (int64_t g0 = 0; g0 < n_pad; g0 += group) {
    const int64_t width = std::min(group, n_pad - g0), nb = width / kBlock;
    at::Tensor rows = padded.narrow(0, g0, width);  // [width, K]
    at::Tensor part;
    if (family == kAvx2) {
      part = rows.t();  // [K, width]
      if (w.scalar_type() == at::kBFloat16)  // each block in unpack order (load_block)
        part = part.reshape({K, nb, 2, 2, 4}).transpose(2, 3);
    } else {
      part = rows.view({width, K / 2, 2}).permute({1, 0, 2});  // [K/2, width, 2]
    }
    parts.push_back(part.contiguous().view(-1));
  }
  return at::cat(parts);
}

namespace {
void check_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t family) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat ||
                   (x.scalar_type() == at::kBFloat16 && family != kAvx2)),
              "x must be a contiguous float32 [M, K] tensor (or bfloat16 for the bf16 families)");
  const int64_t K = x.size(1);
  TORCH_CHECK(N >= 1 && K >= 1, "empty weight");
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() && packed.numel() == padded_rows(N) * K,
              "the packed weight must be pack_weight's of a [", N, ", ", K, "] weight");
  TORCH_CHECK(known(family), "unknown kernel family ", family);
  TORCH_CHECK(family == kAvx2 ? (packed.scalar_type() == at::kFloat ||
                                packed.scalar_type() == at::kBFloat16)
                             : (packed.scalar_type() == at::kBFloat16 && K % 2 == 0),
              "the packed weight's dtype does not fit its family");
}

// x as the bf16 families read it, in torch's allocation (64-byte aligned): where a
// row is whole cache lines, an amx A tile's row is then one line, not parts of two.
// Measured on the AMX Xeon (one thread, 1024 rows, alternated three times): the
// 576 -> 960 qkv 1.42-1.45 -> 1.14-1.23 ms, 1536 -> 576 down 2.09-2.16 -> 1.92-2.08.
at::Tensor rounded(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) return x;  // rounded by its producer (to_bf16)
  at::Tensor xb = at::empty({x.numel()}, x.options().dtype(at::kBFloat16));
  to_bf16(x.data_ptr<float>(), x.numel(), reinterpret_cast<bf16_t*>(xb.data_ptr<at::BFloat16>()));
  return xb;
}
const bf16_t* bf16_data(const at::Tensor& xb) {
  return reinterpret_cast<const bf16_t*>(xb.data_ptr<at::BFloat16>());
}
}  // namespace

// y = x @ W^T (+ bias) with W packed by pack_weight for `family`; N = W's rows.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t family,
                const c10::optional<at::Tensor>& bias) {
  check_gemm(x, packed, N, family);
  const int64_t M = x.size(0), K = x.size(1), n_pad = padded_rows(N);
  const float* b = bias_ptr(bias, N);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  float* yp = y.data_ptr<float>();
  if (family != kAvx2) {
    const at::Tensor xb = rounded(x);
    const auto* P = reinterpret_cast<const bf16_t*>(packed.data_ptr<at::BFloat16>());
    if (family == kAmx) {
      amx_gemm(bf16_data(xb), M, K, P, n_pad, yp, N, b);
      return y;
    }
    const int64_t groups = (n_pad + kDpGroup - 1) / kDpGroup;
    const auto* x2 = reinterpret_cast<const uint32_t*>(bf16_data(xb));
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t m0 = 0; m0 < M; m0 += kMC)
        dp_groups(x2 + m0 * (K / 2), std::min(kMC, M - m0), K, P, n_pad, yp + m0 * N, N, g0,
                  g1, b);
    });
    return y;
  }
  const float* xp = x.data_ptr<float>();
  const int64_t groups = (n_pad + kFmaGroup - 1) / kFmaGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMC) {
      const int64_t mm = std::min(kMC, M - m0);
      if (packed.scalar_type() == at::kFloat)
        fma_groups(xp + m0 * K, mm, K, packed.data_ptr<float>(), n_pad, yp + m0 * N, N, g0, g1, b);
      else
        fma_groups(xp + m0 * K, mm, K,
                   reinterpret_cast<const bf16_t*>(packed.data_ptr<at::BFloat16>()), n_pad,
                   yp + m0 * N, N, g0, g1, b);
    }
  });
  return y;
}

// silu(gate) * up of a fused gate/up layer (W: N = 2I rows, I gates then their ups)
// in one call: the avx512bf16 or amx family's gemm and silu_mul, the same bits, y [M, I]
// (bf16_out: to_bf16 of those bits, what the next bf16 GEMM makes of them).
at::Tensor gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         int64_t family, const c10::optional<at::Tensor>& bias, bool bf16_out) {
  check_gemm(x, packed, N, family);
  TORCH_CHECK(family == kAmx || family == kAvx512,
              "silu_mul is fused into the avx512bf16 and amx families' gemm only");
  TORCH_CHECK(N % 128 == 0, "a fused silu_mul needs 2 x a multiple of 64 outputs, got ", N);
  const float* b = bias_ptr(bias, N);
  const int64_t M = x.size(0), K = x.size(1), I = N / 2;
  auto y = at::empty({M, I}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0) return y;
  const at::Tensor xb = rounded(x);
  const auto* P = reinterpret_cast<const bf16_t*>(packed.data_ptr<at::BFloat16>());
  const auto run = [&](auto* yp) {
    if (family == kAmx) {
      amx_gemm_silu_mul(bf16_data(xb), M, K, P, yp, I, b);
      return;
    }
    const auto* x2 = reinterpret_cast<const uint32_t*>(bf16_data(xb));
    at::parallel_for(0, I / kDpGroup, 1, [&](int64_t g0, int64_t g1) {
      dp_silu_groups(x2, M, K, P, I, yp, g0, g1, b);
    });
  };
  if (bf16_out)
    run(reinterpret_cast<bf16_t*>(y.data_ptr<at::BFloat16>()));
  else
    run(y.data_ptr<float>());
  return y;
}

}  // namespace pdk
