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

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "blocks.h"
#include "cpu.h"

#if defined(LLMRT_X86)
#define LLMRT_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,f16c,fma")))
#endif

namespace llmrt_kernels {

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

#if defined(LLMRT_X86)
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

// ``two_level_block`` in AVX2 (the same roundings in the same order, so the same bytes).
LLMRT_AVX2 inline __m128i pack16_epi8(__m256 a, __m256 b, int32_t& sum) {
  const __m256i ia = _mm256_cvtps_epi32(a), ib = _mm256_cvtps_epi32(b);
  const __m256i s32 = _mm256_add_epi32(ia, ib);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  sum += _mm_cvtsi128_si32(t);
  const __m256i s16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(ia, ib), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
}

LLMRT_AVX2 inline TwoLevel two_level_block_avx2(const float* x, int8_t* h0, int8_t* l0,
                                                int8_t* h1, int8_t* l1) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256 hv[4], lv[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 s = _mm256_mul_ps(v[i], inv);
    hv[i] = _mm256_round_ps(s, kRound);
    lv[i] = _mm256_min_ps(
        _mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(s, hv[i]), _mm256_set1_ps(256.0f)),
                                      kRound),
                      _mm256_set1_ps(-127.0f)),
        _mm256_set1_ps(127.0f));
  }
  int32_t sum_h = 0, sum_l = 0;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h0), pack16_epi8(hv[0], hv[1], sum_h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h1), pack16_epi8(hv[2], hv[3], sum_h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(l0), pack16_epi8(lv[0], lv[1], sum_l));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(l1), pack16_epi8(lv[2], lv[3], sum_l));
  return {amax / 127.0f, sum_h, sum_l};
}

#endif  // LLMRT_X86

// One instruction set's tile kernels over the interleaved layout, for activation rows
// [r, r + MT) and weight rows [c0, c1) (run_tiles, tiles.h, drives the chunks and tiles).
// ``Kernels`` names that level's kernels: ``q4<BASE, MT>`` (Q4_0 / Q4_1) and ``q8<MT>``, each
// taking (prep, prep_stride, w, row_bytes, nb, y, ldy, c0, c1), and ``kMaxRows``, the rows one
// pass keeps in registers (a taller tile runs as passes of kMaxRows).
template <typename Kernels>
struct InterleavedTile {
  int64_t base;
  const uint8_t* prep;
  int64_t prep_stride;
  const uint8_t* w;
  int64_t row_bytes, nb;
  float* y;
  int64_t ldy;

  template <int MT>
  void run(int64_t r, int64_t c0, int64_t c1) const {
    if constexpr (MT > Kernels::kMaxRows) {
      run<Kernels::kMaxRows>(r, c0, c1);
      run<MT - Kernels::kMaxRows>(r + Kernels::kMaxRows, c0, c1);
    } else {
      const uint8_t* p = prep + r * prep_stride;
      float* yr = y + r * ldy;
      switch (base) {
        case kQ4_0:
          Kernels::template q4<kQ4_0, MT>(p, prep_stride, w, row_bytes, nb, yr, ldy, c0, c1);
          break;
        case kQ4_1:
          Kernels::template q4<kQ4_1, MT>(p, prep_stride, w, row_bytes, nb, yr, ldy, c0, c1);
          break;
        default: Kernels::template q8<MT>(p, prep_stride, w, row_bytes, nb, yr, ldy, c0, c1); break;
      }
    }
  }
};

}  // namespace llmrt_kernels
