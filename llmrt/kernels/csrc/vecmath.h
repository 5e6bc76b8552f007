// Vector math the kernels share: 16-lane masks and loads, e^x on 16 float32 lanes, and the
// MLP activations.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu.h"

namespace llmrt_kernels {

// Activation codes (llmrt/families/layers.py ``ACTIVATIONS`` names them).
inline constexpr int64_t kSilu = 0;
inline constexpr int64_t kGelu = 1;
inline constexpr int64_t kGeluTanh = 2;
inline constexpr int64_t kRelu = 3;
inline constexpr int64_t kRelu2 = 4;  // relu(x)^2 (Nemotron)

// One value's activation, in float32.
inline float activate(float v, int64_t kind) {
  switch (kind) {
    case kSilu: return v / (1.0f + std::exp(-v));
    case kGelu: return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
    case kGeluTanh: {
      const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + std::tanh(inner));
    }
    case kRelu2: {
      const float r = v > 0.0f ? v : 0.0f;
      return r * r;
    }
    default: return v > 0.0f ? v : 0.0f;
  }
}

#if defined(LLMRT_X86)
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

// ---- AVX2 + FMA + F16C: 8 lanes; tails go through a zeroed buffer (same math) ----

LLMRT_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
LLMRT_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
LLMRT_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The first n (< 8) values of ``p``, the other lanes zero.
template <typename T>
LLMRT_AVX2 inline __m256 load8_tail(const T* p, int64_t n) {
  alignas(32) T buf[8];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, static_cast<size_t>(n) * sizeof(T));
  return load8(buf);
}

LLMRT_AVX2 inline void store8_tail(float* p, __m256 v, int64_t n) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(float));
}

LLMRT_AVX2 inline float hadd8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ``exp512`` on 8 lanes (the same steps; 2^n built in the exponent bits, exact as scalef is
// for n in [-126, 127]).
LLMRT_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

LLMRT_AVX2 inline __m256 silu256(__m256 v) {
  return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                        exp256(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}

// out[j] = silu(g[j]) * u[j] (u == nullptr: silu(g[j])) in float32.
template <typename In>
LLMRT_AVX2 inline void silu_row_avx2(const In* g, const In* u, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 a = silu256(load8(g + j));
    if (u != nullptr) a = _mm256_mul_ps(a, load8(u + j));
    _mm256_storeu_ps(out + j, a);
  }
  if (j < n) {
    __m256 a = silu256(load8_tail(g + j, n - j));
    if (u != nullptr) a = _mm256_mul_ps(a, load8_tail(u + j, n - j));
    store8_tail(out + j, a, n - j);
  }
}

#endif  // LLMRT_X86

#if defined(LLMRT_ARM64)
// ---- arm64 NEON (every AArch64 CPU): 4 lanes, exp256's steps; tails through a zeroed buffer

inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const c10::Half* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
inline float32x4_t load4(const c10::BFloat16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}

inline float32x4_t exp128(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.0f)), vdupq_n_f32(88.0f));
  const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.0f / 5040.0f);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 720.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

inline float32x4_t silu128(float32x4_t v) {
  return vdivq_f32(v, vaddq_f32(vdupq_n_f32(1.0f), exp128(vnegq_f32(v))));
}

// out[j] = silu(g[j]) * u[j] (u == nullptr: silu(g[j])) in float32.
template <typename In>
inline void silu_row_neon(const In* g, const In* u, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float32x4_t a = silu128(load4(g + j));
    if (u != nullptr) a = vmulq_f32(a, load4(u + j));
    vst1q_f32(out + j, a);
  }
  if (j < n) {
    In gb[4], ub[4];
    float ob[4];
    std::memset(static_cast<void*>(gb), 0, sizeof(gb));
    std::memset(static_cast<void*>(ub), 0, sizeof(ub));
    std::memcpy(static_cast<void*>(gb), g + j, static_cast<size_t>(n - j) * sizeof(In));
    if (u != nullptr) std::memcpy(static_cast<void*>(ub), u + j, static_cast<size_t>(n - j) * sizeof(In));
    float32x4_t a = silu128(load4(gb));
    if (u != nullptr) a = vmulq_f32(a, load4(ub));
    vst1q_f32(ob, a);
    std::memcpy(out + j, ob, static_cast<size_t>(n - j) * sizeof(float));
  }
}
#endif  // LLMRT_ARM64

}  // namespace llmrt_kernels
