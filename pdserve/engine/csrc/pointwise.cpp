// Fused per-token ops of the decoder layer, float32 activations:
//   rms_norm          out = x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm      residual += x; out = rms_norm(residual)   (residual in place)
//                     (either norm's out in bfloat16 on request: to_bf16 of the
//                     float32 row, what a bf16 GEMM family makes of its input)
//   rope_write_kv     rotary ("rotate half") on the q and k heads of a fused qkv row,
//                     in place, then k and v stored into their cache slots
//   silu_mul          out = silu(gate) * up for gate_up = [gate | up]
//   apply_token_bitmask  logits[rows[j], t] = -inf where bit t of mask[j] is clear
//                     (structured outputs: the tokens a request's grammar forbids)
//   argmax_rows, inverse_cdf_rows  the sampler's greedy and random draws
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_rows.h"
#include "vec.h"

namespace pdk {
namespace {

constexpr int64_t kTokenGrain = 4;

template <typename W>
void norm_row(const float* x, const W* w, float* out, int64_t n, float eps) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = load8(x + i);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(hsum(ss) / static_cast<float>(n) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8)
    store8(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), iv), load8(w + i)));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              name, " must be a contiguous float32 [T, hidden] tensor");
  TORCH_CHECK(x.size(1) % 8 == 0, name, ": hidden size must be a multiple of 8");
}

template <typename Fn>
void with_weight(const at::Tensor& w, int64_t n, Fn fn) {
  TORCH_CHECK(w.dim() == 1 && w.numel() == n && w.is_contiguous(), "norm weight must be [hidden]");
  if (w.scalar_type() == at::kFloat) fn(w.data_ptr<float>());
  else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "norm weight must be float32 or bfloat16");
    fn(reinterpret_cast<const bf16_t*>(w.data_ptr<at::BFloat16>()));
  }
}

// The norms' output: float32 [T, n], or (bf16) its rows through to_bf16. Row t of
// the float32 result goes to dst(t) (for bf16: a buffer of the thread's), then done(t).
class NormOut {
 public:
  NormOut(const at::Tensor& x, bool bf16) : bf16_(bf16), n_(x.size(1)) {
    TORCH_CHECK(!bf16 || __builtin_cpu_supports("avx512bf16"),
                "a bfloat16 norm output needs AVX512-BF16");
    out_ = bf16 ? at::empty(x.sizes(), x.options().dtype(at::kBFloat16)) : at::empty_like(x);
  }
  float* dst(int64_t t, std::vector<float>& row) {
    if (!bf16_) return out_.data_ptr<float>() + t * n_;
    row.resize(n_);
    return row.data();
  }
  void done(int64_t t, const std::vector<float>& row) {
    if (bf16_)
      to_bf16(row.data(), n_, reinterpret_cast<bf16_t*>(out_.data_ptr<at::BFloat16>()) + t * n_);
  }
  at::Tensor tensor() const { return out_; }

 private:
  bool bf16_;
  int64_t n_;
  at::Tensor out_;
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool bf16_out) {
  check_rows(x, "x");
  const int64_t T = x.size(0), n = x.size(1);
  NormOut out(x, bf16_out);
  const float* xp = x.data_ptr<float>();
  with_weight(w, n, [&](auto* wp) {
    at::parallel_for(0, T, kTokenGrain, [&](int64_t a, int64_t b) {
      std::vector<float> row;
      for (int64_t t = a; t < b; ++t) {
        norm_row(xp + t * n, wp, out.dst(t, row), n, static_cast<float>(eps));
        out.done(t, row);
      }
    });
  });
  return out.tensor();
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps,
                        bool bf16_out) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  const int64_t T = x.size(0), n = x.size(1);
  NormOut out(x, bf16_out);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  with_weight(w, n, [&](auto* wp) {
    at::parallel_for(0, T, kTokenGrain, [&](int64_t a, int64_t b) {
      std::vector<float> row;
      for (int64_t t = a; t < b; ++t) {
        float* r = rp + t * n;
        for (int64_t i = 0; i < n; i += 8) store8(r + i, _mm256_add_ps(load8(r + i), load8(xp + t * n + i)));
        norm_row(r, wp, out.dst(t, row), n, static_cast<float>(eps));
        out.done(t, row);
      }
    });
  });
  return out.tensor();
}

// qkv [T, (H + 2 KVH) * D] float32 (rows contiguous); cos/sin [P, D] float32;
// positions [T] int64; kv_cache [blocks, layers, 2, KVH, BS, row] (row: D values, or for
// an int8 cache D int8 values and their scale, kv_rows.h); slots [T] int64
// (block * BS + offset).
void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& kv_cache, int64_t layer,
                   const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "qkv must be contiguous float32 [T, (H + 2 KVH) * D]");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be contiguous");
  const int64_t T = qkv.size(0), L = kv_cache.size(1);
  const int64_t row_w = kv_cache.size(5);
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  const int64_t D = int8 ? row_w - kKvScaleBytes : row_w;
  const int64_t KVH = kv_cache.size(3), BS = kv_cache.size(4);
  TORCH_CHECK(KVH == num_kv_heads && qkv.size(1) == (num_heads + 2 * KVH) * D,
              "qkv width does not match the heads");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D, "cos/sin must be float32 [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
              positions.numel() == T && slots.numel() == T, "positions/slots must be int64 [T]");
  TORCH_CHECK(0 <= layer && layer < L, "layer out of range");
  const int64_t P = cos.size(0), half = D / 2, width = qkv.size(1);
  const int64_t head_stride = BS * row_w, kv_stride = KVH * head_stride;
  const int64_t block_stride = L * 2 * kv_stride, num_slots = kv_cache.size(0) * BS;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= pos[t] && pos[t] < P && 0 <= sl[t] && sl[t] < num_slots,
                "position or slot out of range at token ", t);
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto run = [&](auto* cache) {
    using T_ = std::remove_pointer_t<decltype(cache)>;
    at::parallel_for(0, T, kTokenGrain, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) {
        float* row = base + t * width;
        const float* c = cp + pos[t] * D;
        const float* s = sp + pos[t] * D;
        for (int64_t h = 0; h < num_heads + KVH; ++h) {
          float* x = row + h * D;
          for (int64_t i = 0; i < half; i += 8) {
            __m256 x1 = load8(x + i), x2 = load8(x + half + i);
            store8(x + i, _mm256_fnmadd_ps(x2, load8(s + i), _mm256_mul_ps(x1, load8(c + i))));
            store8(x + half + i, _mm256_fmadd_ps(x1, load8(s + half + i), _mm256_mul_ps(x2, load8(c + half + i))));
          }
        }
        const int64_t blk = sl[t] / BS, off = sl[t] % BS;
        T_* kdst = cache + blk * block_stride + layer * 2 * kv_stride + off * row_w;
        T_* vdst = kdst + kv_stride;
        const float* k = row + num_heads * D;
        const float* v = k + KVH * D;
        for (int64_t h = 0; h < KVH; ++h) {
          write_row(kdst + h * head_stride, k + h * D, D);
          write_row(vdst + h * head_stride, v + h * D, D);
        }
      }
    });
  };
  if (kv_cache.scalar_type() == at::kFloat) run(kv_cache.data_ptr<float>());
  else if (int8) run(kv_cache.data_ptr<int8_t>());
  else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "kv_cache must be float32, bfloat16 or int8");
    run(reinterpret_cast<bf16_t*>(kv_cache.data_ptr<at::BFloat16>()));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(I % 8 == 0, "intermediate size must be a multiple of 8");
  auto out = at::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f);
  at::parallel_for(0, T, kTokenGrain, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t)
      for (int64_t i = 0; i < I; i += 8) {
        __m256 x = load8(g + t * 2 * I + i);
        __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        store8(op + t * I + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), load8(g + t * 2 * I + I + i)));
      }
  });
  return out;
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& mask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 [B, V] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be int64 [R]");
  TORCH_CHECK(mask.dim() == 2 && mask.scalar_type() == at::kInt && mask.is_contiguous() &&
                  mask.size(0) == rows.size(0),
              "mask must be a contiguous int32 [R, words] tensor, one row per entry of rows");
  const int64_t B = logits.size(0), V = logits.size(1), W = mask.size(1), R = rows.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < R; ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < B, "row ", rp[j], " is outside the logits' ", B, " rows");
  const float ninf = -std::numeric_limits<float>::infinity();
  const auto* mp = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
  float* lp = logits.data_ptr<float>();
  for (int64_t j = 0; j < R; ++j) {
    float* row = lp + rp[j] * V;
    const uint32_t* bits = mp + j * W;
    for (int64_t w = 0; w < W && w * 32 < V; ++w) {
      const uint32_t b = bits[w];
      if (b == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
      for (int64_t t = 0; t < n; ++t)
        if (!((b >> t) & 1u)) row[base + t] = ninf;
    }
    for (int64_t t = W * 32; t < V; ++t) row[t] = ninf;  // past the mask: never allowed
  }
}

// torch.argmax(x, dim=-1) of a float32 [B, V] tensor, as torch answers it (the first
// index of the largest value; a row holding a NaN answers its first NaN), vectorised:
// ~10x torch's CPU argmax on 32 rows of 49152 logits (the greedy sampler's).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous float32 [B, V] tensor with V > 0");
  const int64_t B = x.size(0), V = x.size(1);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = xp + b * V;
      __m256 m0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
      __m256 nan = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= V; i += 16) {
        const __m256 a = load8(row + i), c = load8(row + i + 8);
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, c);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, c, _CMP_UNORD_Q));
      }
      float mx = hmax(_mm256_max_ps(m0, m1));
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      for (; i < V; ++i) {
        has_nan = has_nan || std::isnan(row[i]);
        mx = std::max(mx, row[i]);
      }
      int64_t at_ = 0;
      if (has_nan) {
        while (!std::isnan(row[at_])) ++at_;
      } else {
        const __m256 mv = _mm256_set1_ps(mx);
        int64_t j = 0;
        for (; j + 8 <= V; j += 8) {
          const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + j), mv, _CMP_EQ_OQ));
          if (hit) break;
        }
        while (row[j] != mx) ++j;  // the first equal lane (or the tail)
        at_ = j;
      }
      op[b] = at_;
    }
  });
  return out;
}

// The sampler's inverse-CDF draw of each row of float32 probabilities p [B, V] for
// u [B] (float64 in [0, 1)), as its reference computes it (sampler.py): cdf =
// cumsum(float64(p)) in index order, then the first index whose cdf exceeds u * cdf[V-1];
// where none does (u * total rounded up to the total), the first index whose cdf reaches
// the total. The sums are the reference's bit for bit: the same additions in the same
// order, each row once. The search adds again only within the block of kCdfBlock that
// holds the answer, from that block's stored starting sum, so a row costs one pass, not
// cumsum's written [B, V] float64 and a search over it (32 rows of 49152: ~0.5 ms against
// ~5 ms; sampler.py). A row whose total is not a finite positive number (it has
// no probability mass, or a NaN) answers -1: the caller's reference takes it.
at::Tensor inverse_cdf_rows(const at::Tensor& p, const at::Tensor& u) {
  TORCH_CHECK(p.dim() == 2 && p.scalar_type() == at::kFloat && p.is_contiguous() && p.size(1) > 0,
              "p must be a contiguous float32 [B, V] tensor with V > 0");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.is_contiguous() &&
              u.size(0) == p.size(0), "u must be a contiguous float64 [B] tensor");
  constexpr int64_t kCdfBlock = 512;
  const int64_t B = p.size(0), V = p.size(1), blocks = (V + kCdfBlock - 1) / kCdfBlock;
  auto out = at::empty({B}, p.options().dtype(at::kLong));
  const float* pp = p.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<double> start(blocks + 1);  // start[k]: the cdf before block k; [blocks]: total
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = pp + b * V;
      double acc = 0.0;
      for (int64_t k = 0; k < blocks; ++k) {
        start[k] = acc;
        for (int64_t i = k * kCdfBlock, e = std::min(V, i + kCdfBlock); i < e; ++i)
          acc += static_cast<double>(row[i]);
      }
      start[blocks] = acc;
      if (!(std::isfinite(acc) && acc > 0.0)) {
        op[b] = -1;
        continue;
      }
      // The first cdf above target (strictly); none above it: the first that reaches
      // the total (above = false then). Block k ends at cdf start[k + 1], and sums only
      // grow (p >= 0), so the answer lies in the first block whose end qualifies.
      double target = up[b] * acc;
      bool above = target < acc;
      if (!above) target = acc;
      int64_t k = 0;
      while (above ? !(start[k + 1] > target) : start[k + 1] < target) ++k;
      double c = start[k];
      int64_t i = k * kCdfBlock;
      for (;; ++i) {
        c += static_cast<double>(row[i]);
        if (above ? c > target : c >= target) break;
      }
      op[b] = i;
    }
  });
  return out;
}

}  // namespace pdk
