// Rotary position embedding over a prefill's queries or keys, in one pass, float32.
//
// Why: torch's form, x * cos + cat(-x2, x1) * sin, is five kernels (neg, cat, two products,
// a sum) and four temporaries of the whole [tokens, heads, head_dim] tensor: ~0.7 s of a
// 20 s mixed SmolLM2 run. Here each element is read once and written once, with torch's
// roundings (two products, then their sum; no fused multiply-add), so results are equal.
//
// Semantics: x [N, H, D] (the last dim contiguous), cos and sin [N, D] (both halves of the
// table, as ``rope_lookup`` builds them); out[n, h, i] = x[n, h, i] * cos[n, i] +
// r[n, h, i] * sin[n, i] with r = (-x[D/2:], x[:D/2]). Returns a contiguous [N, H, D].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstdint>

#include "parallel.h"
#include "cpu.h"
#include "vecmath.h"

// torch rounds the two products before their sum: keep the compiler from fusing them (GCC's
// pragma; the standard one for compilers that honour it).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#pragma STDC FP_CONTRACT OFF

namespace {

using llmrt_kernels::has_avx512;
#if defined(LLMRT_X86)
using llmrt_kernels::lanes;
#endif

#if defined(LLMRT_X86)
LLMRT_AVX512 void rope_rows_avx512(const float* x, int64_t sn, int64_t sh, const float* cos,
                                   const float* sin, float* out, int64_t heads, int64_t dim,
                                   int64_t n0, int64_t n1) {
  const int64_t half = dim / 2;
  for (int64_t n = n0; n < n1; ++n) {
    const float* c = cos + n * dim;
    const float* s = sin + n * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = x + n * sn + h * sh;
      float* o = out + (n * heads + h) * dim;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = lanes(half - i);
        const __m512 a = _mm512_maskz_loadu_ps(m, xr + i);
        const __m512 b = _mm512_maskz_loadu_ps(m, xr + half + i);
        const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, c + i)),
                                        _mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, s + i)));
        const __m512 hi =
            _mm512_add_ps(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, c + half + i)),
                          _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, s + half + i)));
        _mm512_mask_storeu_ps(o + i, m, lo);
        _mm512_mask_storeu_ps(o + half + i, m, hi);
      }
    }
  }
}
#endif  // LLMRT_X86

void rope_rows(const float* x, int64_t sn, int64_t sh, const float* cos, const float* sin,
               float* out, int64_t heads, int64_t dim, int64_t n0, int64_t n1) {
  const int64_t half = dim / 2;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = x + n * sn + h * sh;
      float* o = out + (n * heads + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = xr[i], b = xr[half + i];
        o[i] = a * cos[n * dim + i] - b * sin[n * dim + i];
        o[half + i] = b * cos[n * dim + half + i] + a * sin[n * dim + half + i];
      }
    }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "llmrt_kernels.rope: x, cos and sin must be float32 on the CPU");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1,
              "llmrt_kernels.rope: x must be [tokens, heads, head_dim] with contiguous head_dim");
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "llmrt_kernels.rope: head_dim must be even (got ", dim, ")");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == n &&
                  cos.size(1) == dim,
              "llmrt_kernels.rope: cos and sin must be [tokens, head_dim] = [", n, ", ", dim, "]");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({n, heads, dim}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* cp = c.const_data_ptr<float>();
  const float* sp = s.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t sn = x.stride(0), sh = x.stride(1);
  [[maybe_unused]] const bool simd = has_avx512();
  llmrt_kernels::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
#if defined(LLMRT_X86)
    if (simd) {
      rope_rows_avx512(xp, sn, sh, cp, sp, op, heads, dim, n0, n1);
      return;
    }
#endif
    rope_rows(xp, sn, sh, cp, sp, op, heads, dim, n0, n1);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) { m.impl("rope", &rope); }
