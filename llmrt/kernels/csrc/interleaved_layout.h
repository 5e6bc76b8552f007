// The interleaved block layout and the two-level 8-bit activations its integer kernels
// multiply (interleaved.cpp: layout, decode tiles; interleaved_gemm.cpp: the many-row GEMM).
//
// Layout (same bytes per block as ggml, rows stay independent): a row is groups of G blocks
// (G = 4 for Q4_0/Q4_1, 2 for Q8_0; the last group holds the c <= G blocks left):
//   4-bit: c*16 bytes of quants (block i's ggml qs at 16*i), c fp16 d, (Q4_1) c fp16 m
//   Q8_0:  c*32 bytes of quants stored as q + 128 (unsigned), c fp16 d
//
// Activations: each 32-wide block of a row of x is split into two int8 levels,
// x ~= dx * (h + l / 256) with dx = max|x| / 127, h = round(x / dx), l = round(256 * residual),
// which keeps ~16 bits of each block (error at most dx / 512, or dx / 256 where a residual
// rounds to +-128 and is clamped): products are exact integers and the only rounding left is
// the float32 scaling per block. One 8-bit level (llama.cpp's Q8_1 activations) moved
// SmolLM2's logits by 0.4 in simulation; two levels move them by 6e-3 (float32: 1e-4).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "blocks.h"
#include "cpu.h"

#define LLMRT_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c,fma")))

namespace llmrt_kernels {

// Whether this CPU runs the integer kernels (AVX-512 VNNI and DQ besides ``has_avx512``).
inline bool has_vnni() {
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512vnni") &&
                         __builtin_cpu_supports("avx512dq");
  return ok;
}

// Blocks per group, and quant bytes per block, of a base kind in the interleaved layout.
constexpr int64_t group_of(int64_t base) { return base == kQ8_0 ? 2 : 4; }
constexpr int64_t quant_bytes(int64_t base) { return base == kQ8_0 ? 32 : 16; }

// Where block b of a row of the interleaved layout keeps its quants, fp16 d and (Q4_1) fp16
// m (nullptr for the other kinds).
struct BlockBytes {
  const uint8_t* q;
  const uint8_t* d;
  const uint8_t* m;
};

inline BlockBytes block_bytes_at(const uint8_t* row, int64_t base, int64_t nb, int64_t b) {
  const int64_t g = group_of(base), b0 = b - b % g, c = std::min(g, nb - b0), i = b - b0;
  const uint8_t* o = row + b0 * block_bytes_of(base);
  const int64_t qb = quant_bytes(base);
  return {o + qb * i, o + qb * c + 2 * i, base == kQ4_1 ? o + 18 * c + 2 * i : nullptr};
}

// Block b's d, m (Q4_0: -8 d; Q8_0: 0, its quants carry +128) and quants, in a row of the
// interleaved layout.
struct BlockRef {
  float d, m;
  const uint8_t* q;
};

inline BlockRef block_at(const uint8_t* row, int64_t base, int64_t nb, int64_t b) {
  const BlockBytes at = block_bytes_at(row, base, nb, b);
  const float d = half_at(at.d);
  const float m = at.m != nullptr ? half_at(at.m) : (base == kQ4_0 ? -8.0f * d : 0.0f);
  return {d, m, at.q};
}

// One 32-wide block of activations ``x`` as two int8 levels: elements 0-15 to ``h0``/``l0``,
// 16-31 to ``h1``/``l1``; returns dx and the sums of h and of l (exact integers).
struct TwoLevel {
  float dx;
  int32_t sum_h, sum_l;
};

LLMRT_VNNI inline TwoLevel two_level_block(const float* x, int8_t* h0, int8_t* l0, int8_t* h1,
                                           int8_t* l1) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  int32_t sum_h = 0, sum_l = 0;
  const __m512 xs[2] = {x0, x1};
  int8_t* hs[2] = {h0, h1};
  int8_t* ls[2] = {l0, l1};
  for (int half = 0; half < 2; ++half) {
    const __m512 v = _mm512_mul_ps(xs[half], inv);
    const __m512 hv = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 lv = _mm512_min_ps(
        _mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, hv), _mm512_set1_ps(256.0f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                      _mm512_set1_ps(-127.0f)),
        _mm512_set1_ps(127.0f));
    const __m512i hi = _mm512_cvtps_epi32(hv), li = _mm512_cvtps_epi32(lv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hs[half]), _mm512_cvtsepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ls[half]), _mm512_cvtsepi32_epi8(li));
    sum_h += _mm512_reduce_add_epi32(hi);
    sum_l += _mm512_reduce_add_epi32(li);
  }
  return {amax / 127.0f, sum_h, sum_l};
}

}  // namespace llmrt_kernels
