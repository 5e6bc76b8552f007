// An 8x8 transpose of 32-bit lanes in AVX2 registers, which every panel packer uses to turn
// eight columns' k/4 steps into steps of eight columns (interleaved_gemm.cpp,
// interleaved_q8_gemm.cpp, kquant_panel.h).
#pragma once

#include "cpu.h"

#if defined(LLMRT_X86)
#include <immintrin.h>

namespace llmrt_kernels {

// Eight rows of eight dwords transposed in place (r[i][j] -> r[j][i]).
LLMRT_AVX2 inline void transpose8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    r[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

}  // namespace llmrt_kernels

#endif  // LLMRT_X86
