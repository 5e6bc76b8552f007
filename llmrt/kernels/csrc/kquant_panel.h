// The K-quant panels' shared AVX2 pieces (kquant_gemm.cpp's two-level panels and
// kquant_q8_gemm.cpp's one-level ones): a 32-weight group of a Q4_K / Q5_K / Q6_K block
// unpacked to bytes in registers, and eight columns' groups stored as the group's eight
// k-steps (an 8x8 dword transpose).
#pragma once

#include <cstdint>

#include "cpu.h"
#include "kquant_blocks.h"
#include "transpose.h"

#if defined(LLMRT_X86)
#include <immintrin.h>

namespace llmrt_kernels {

// Group ``grp`` (32 weights) of a K-quant block's quants as bytes (kquants.cpp's unpack_block
// rule, in registers).
template <int64_t KIND>
LLMRT_AVX2 inline __m256i group_avx2(const uint8_t* blk, int grp) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    const uint8_t* qs = blk + (KIND == kQ5_K ? 48 : 16);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (grp / 2)));
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (grp % 2))), low);
    if constexpr (KIND == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(grp)),
                                           _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
  } else {  // Q6_K
    const int h = grp / 4, t = grp % 4;
    const __m256i lo =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (t % 2)));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i ql = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (t / 2))), low);
    const __m256i qh = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * t)),
                                        _mm256_set1_epi8(3));
    return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
  }
}

// Eight columns' 32 quants of one group (``v[c]``: eight dwords, dword s = quants 4s..4s+3)
// stored as the group's eight steps (step s: dword s of every column): an 8x8 dword transpose.
LLMRT_AVX2 inline void store_steps(const __m256i v[8], uint8_t* o) {
  __m256i r[8];
  for (int c = 0; c < 8; ++c) r[c] = v[c];
  transpose8x8(r);
  for (int st = 0; st < 8; ++st) _mm256_store_si256(reinterpret_cast<__m256i*>(o + 32 * st), r[st]);
}

}  // namespace llmrt_kernels

#endif  // LLMRT_X86
