// RMSNorm rows in portable float32 (the fused decode step's norm, and the prefill op's loop
// on CPUs without AVX-512): out = w * (x * (1 / sqrt(mean(x^2) + eps))), as Hugging Face's
// RMSNorm computes it in float32.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <cmath>
#include <cstdint>

#include "cpu.h"

namespace llmrt_kernels {

inline void rms_norm_rows(const float* x, int64_t rows, int64_t width, const float* w,
                          double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    float ss = 0.0f;
    for (int64_t j = 0; j < width; ++j) ss += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
    float* o = out + r * width;
    for (int64_t j = 0; j < width; ++j) o[j] = w[j] * (xr[j] * inv);
  }
}

#if defined(LLMRT_X86)
// ``rms_norm_rows`` with AVX2: the sum of squares in 8 lanes (then their sum), the scaling
// as the portable loop does it (w * (x * inv)), so only the sum's order differs.
LLMRT_AVX2 inline void rms_norm_rows_avx2(const float* x, int64_t rows, int64_t width,
                                          const float* w, double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= width; j += 16) {
      const __m256 v0 = _mm256_loadu_ps(xr + j), v1 = _mm256_loadu_ps(xr + j + 8);
      a0 = _mm256_fmadd_ps(v0, v0, a0);
      a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    a0 = _mm256_add_ps(a0, a1);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    float ss = _mm_cvtss_f32(s4);
    for (; j < width; ++j) ss += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
    const __m256 vinv = _mm256_set1_ps(inv);
    float* o = out + r * width;
    j = 0;
    for (; j + 8 <= width; j += 8)
      _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(w + j),
                                            _mm256_mul_ps(_mm256_loadu_ps(xr + j), vinv)));
    for (; j < width; ++j) o[j] = w[j] * (xr[j] * inv);
  }
}

#endif  // LLMRT_X86

#if defined(LLMRT_ARM64)
// ``rms_norm_rows`` with NEON (every AArch64 CPU): the sum of squares in 8 lanes, the
// scaling as the portable loop does it.
inline void rms_norm_rows_neon(const float* x, int64_t rows, int64_t width, const float* w,
                               double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = vdupq_n_f32(0.0f);
    int64_t j = 0;
    for (; j + 8 <= width; j += 8) {
      const float32x4_t v0 = vld1q_f32(xr + j), v1 = vld1q_f32(xr + j + 4);
      a0 = vfmaq_f32(a0, v0, v0);
      a1 = vfmaq_f32(a1, v1, v1);
    }
    float ss = vaddvq_f32(vaddq_f32(a0, a1));
    for (; j < width; ++j) ss += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
    float* o = out + r * width;
    j = 0;
    for (; j + 4 <= width; j += 4)
      vst1q_f32(o + j, vmulq_f32(vld1q_f32(w + j), vmulq_n_f32(vld1q_f32(xr + j), inv)));
    for (; j < width; ++j) o[j] = w[j] * (xr[j] * inv);
  }
}
#endif

// The rows with the best loop this level has (AVX-512 callers have their own).
inline void rms_norm_rows_best(const float* x, int64_t rows, int64_t width, const float* w,
                               double eps, float* out) {
#if defined(LLMRT_X86)
  if (has_avx2()) {
    rms_norm_rows_avx2(x, rows, width, w, eps, out);
    return;
  }
#elif defined(LLMRT_ARM64)
  if (has_neon()) {
    rms_norm_rows_neon(x, rows, width, w, eps, out);
    return;
  }
#endif
  rms_norm_rows(x, rows, width, w, eps, out);
}

}  // namespace llmrt_kernels
