// RMSNorm over a prefill's rows (float32): y = w * (x * (1 / sqrt(mean(x^2) + eps))), as
// Hugging Face's RMSNorm computes it in float32, one pass per row, rows shared by the team.
//
// Why: torch's CPU rms_norm (``aten::_fused_rms_norm``: pow, mean, rsqrt and two products,
// one thread) took ~0.7 ms per [1000, 576] call, 0.35 s of the mixed workload's 9.9 s on
// SmolLM2; the row is in cache after its sum of squares, so the second pass is free.
// Numerics: the sum of squares runs in 16 float32 lanes (then a fixed tree), not torch's
// order, so results differ from torch's in the last bits (~1e-7 relative).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "cpu.h"
#include "rms_norm.h"
#include "vecmath.h"

namespace {


#if defined(LLMRT_X86)
using llmrt_kernels::lanes;

LLMRT_AVX512 void rms_rows_avx512(const float* x, const float* w, float* y, int64_t width,
                                  float eps, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * width;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(lanes(width - j), xr + j);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float mean = _mm512_reduce_add_ps(ss) / static_cast<float>(width);
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
    float* yr = y + r * width;
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 m = lanes(width - j);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), inv);
      _mm512_mask_storeu_ps(yr + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + j), v));
    }
  }
}

#endif  // LLMRT_X86

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "llmrt_kernels.rms_norm: x must be float32 on the CPU");
  TORCH_CHECK(x.dim() >= 1, "llmrt_kernels.rms_norm: x needs a last dim");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat &&
                  weight.dim() == 1 && weight.size(0) == width,
              "llmrt_kernels.rms_norm: the weight must be float32 [", width, "] on the CPU");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty(xc.sizes(), xc.options());
  const int64_t rows = width == 0 ? 0 : xc.numel() / width;
  if (rows == 0) return y;
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = wc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  [[maybe_unused]] const bool simd = llmrt_kernels::has_avx512();
  [[maybe_unused]] const float e = static_cast<float>(eps);
  llmrt_kernels::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
#if defined(LLMRT_X86)
    if (simd) {
      rms_rows_avx512(xp, wp, yp, width, e, r0, r1);
      return;
    }
#endif
    llmrt_kernels::rms_norm_rows_best(xp + r0 * width, r1 - r0, width, wp, eps, yp + r0 * width);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) { m.impl("rms_norm", &rms_norm); }
