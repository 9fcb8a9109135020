// The kernel families: every kernel takes one of these ids as its `family` argument.
// The bindings export them by name (FAMILY_IDS), the one place Python learns the
// numbers (engine/kernels.py: family_id). A family is one level of the CPU's
// instructions, with a name per kind of kernel that runs on it: dense (GEMM,
// attention) and integer (int4, int8, W8A8).
#pragma once

#include <cstdint>

namespace pdk {

enum Family : int64_t {
  kAvx2 = 0,    // "avx2": float32 FMA; AVX2 integer multiply-adds
  kAvx512 = 1,  // "avx512bf16": vdpbf16ps; "avx512vnni": vpdpbusd
  kAmx = 2,     // "amx": the tile unit, TDPBF16PS and TDPBSSD
};

}  // namespace pdk
