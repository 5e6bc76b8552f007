// The fused decode step's norms: RMSNorm or LayerNorm rows, each with an optional bias.
//
// LayerNorm as torch computes it in float32: mean, then the mean of squared deviations, then
// out = (x - mean) * (1 / sqrt(var + eps)) * w + b. A weightless LayerNorm (OLMo) is given
// ones, a ``(1 + w)`` one (Nemotron) its weight plus one, both made once at build in Python.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

#include "cpu.h"
#include "rms_norm.h"
#include "vecmath.h"

namespace llmrt_kernels {

// Norm kinds (llmrt/families/fused_decode.py ``NORM_KINDS`` names them).
inline constexpr int64_t kNormRms = 0;
inline constexpr int64_t kNormLayer = 1;

// One norm's weights (borrowed) and form; ``w == nullptr``: no norm here.
struct NormRef {
  const float* w = nullptr;
  const float* b = nullptr;
  int64_t kind = kNormRms;
  double eps = 0.0;
};

inline void layer_norm_row(const float* x, int64_t width, const float* w, const float* b,
                           float eps, float* out) {
  float sum = 0.0f;
  for (int64_t j = 0; j < width; ++j) sum += x[j];
  const float mean = sum / static_cast<float>(width);
  float ss = 0.0f;
  for (int64_t j = 0; j < width; ++j) ss += (x[j] - mean) * (x[j] - mean);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
  for (int64_t j = 0; j < width; ++j) {
    const float v = (x[j] - mean) * inv * w[j];
    out[j] = b != nullptr ? v + b[j] : v;
  }
}

#if defined(LLMRT_X86)
LLMRT_AVX512 inline void layer_norm_row_avx512(const float* x, int64_t width, const float* w,
                                               const float* b, float eps, float* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16)
    acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(lanes(width - j), x + j));
  const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(width);
  const __m512 vmean = _mm512_set1_ps(mean);
  acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 m = lanes(width - j);
    const __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, x + j), vmean);
    acc = _mm512_fmadd_ps(d, d, acc);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(width) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 m = lanes(width - j);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), vmean);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(d, vinv), _mm512_maskz_loadu_ps(m, w + j));
    if (b != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + j));
    _mm512_mask_storeu_ps(out + j, m, v);
  }
}

LLMRT_AVX2 inline void layer_norm_row_avx2(const float* x, int64_t width, const float* w,
                                           const float* b, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= width; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
  float sum = hadd8(acc);
  for (; j < width; ++j) sum += x[j];
  const float mean = sum / static_cast<float>(width);
  const __m256 vmean = _mm256_set1_ps(mean);
  acc = _mm256_setzero_ps();
  for (j = 0; j + 8 <= width; j += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + j), vmean);
    acc = _mm256_fmadd_ps(d, d, acc);
  }
  float ss = hadd8(acc);
  for (; j < width; ++j) ss += (x[j] - mean) * (x[j] - mean);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (j = 0; j + 8 <= width; j += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + j), vmean);
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(d, vinv), _mm256_loadu_ps(w + j));
    if (b != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(b + j));
    _mm256_storeu_ps(out + j, v);
  }
  for (; j < width; ++j) {
    const float v = (x[j] - mean) * inv * w[j];
    out[j] = b != nullptr ? v + b[j] : v;
  }
}
#endif  // LLMRT_X86

// ``n`` over ``rows`` rows of ``x`` into ``out`` (the best loop this level has).
inline void norm_rows(const NormRef& n, const float* x, int64_t rows, int64_t width, float* out) {
  const float eps = static_cast<float>(n.eps);
  if (n.kind == kNormRms) {
    rms_norm_rows_best(x, rows, width, n.w, n.eps, out);
    if (n.b != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < width; ++j) out[r * width + j] += n.b[j];
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
#if defined(LLMRT_X86)
    if (has_avx512()) {
      layer_norm_row_avx512(x + r * width, width, n.w, n.b, eps, out + r * width);
      continue;
    }
    if (has_avx2()) {
      layer_norm_row_avx2(x + r * width, width, n.w, n.b, eps, out + r * width);
      continue;
    }
#endif
    layer_norm_row(x + r * width, width, n.w, n.b, eps, out + r * width);
  }
}

}  // namespace llmrt_kernels
