// RMSNorm rows in portable float32 (the fused decode step's norm, and the prefill op's loop
// on CPUs without AVX-512): out = w * (x * (1 / sqrt(mean(x^2) + eps))), as Hugging Face's
// RMSNorm computes it in float32.
#pragma once

#include <cmath>
#include <cstdint>

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

}  // namespace llmrt_kernels
