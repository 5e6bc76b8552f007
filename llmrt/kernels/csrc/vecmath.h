// Vector math the kernels share: 16-lane masks and loads, e^x on 16 float32 lanes, and the
// MLP activations.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu.h"

namespace llmrt_kernels {

// Activation codes (llmrt/families/layers.py ``ACTIVATIONS`` names them).
inline constexpr int64_t kSilu = 0;
inline constexpr int64_t kGelu = 1;
inline constexpr int64_t kGeluTanh = 2;
inline constexpr int64_t kRelu = 3;

// One value's activation, in float32.
inline float activate(float v, int64_t kind) {
  switch (kind) {
    case kSilu: return v / (1.0f + std::exp(-v));
    case kGelu: return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
    case kGeluTanh: {
      const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + std::tanh(inner));
    }
    default: return v > 0.0f ? v : 0.0f;
  }
}

// The first n of 16 lanes (all 16 from n >= 16).
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// 16 values as float32 (masked lanes read as zero) from float32, float16 (F16C conversion)
// or bfloat16 (the upper half of a float32).
LLMRT_AVX512 inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
LLMRT_AVX512 inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
LLMRT_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-7 Taylor polynomial
// (error below float32 rounding), then scaled by 2^n. Inputs are clamped to [-87, 88].
LLMRT_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// silu(v) = v / (1 + e^-v) on 16 lanes.
LLMRT_AVX512 inline __m512 silu512(__m512 v) {
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                        exp512(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

}  // namespace llmrt_kernels
