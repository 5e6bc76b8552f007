// arm64 int8 dot products per level, shared by the NEON kernels (interleaved_neon.cpp,
// kquants.cpp). ``Dot::dot(acc, a, b)`` adds the products of a and b into four 32-bit lanes
// (which bytes go to which lane differs per level; the kernels only use a block's total);
// ``dot2`` adds a1.b1 + a2.b2.
//   NeonDot     smull/smlal of 8 bytes into 16-bit sums, sadalp into 32-bit lanes: each
//               16-bit lane takes two products (dot) or four (dot2), so |a| * |b| must stay
//               below 2^14 (dot: int8 x int8) or 2^13 (dot2: u4 x int8 weights and values)
//   DotprodDot  sdot (callers' entry points carry LLMRT_DOTPROD and are flattened)
// and i8mm's smmla (``mmla``) with ``zip_rows``, which makes its 2x8 operands from two rows.
#pragma once

#if defined(__aarch64__)
#include <arm_neon.h>

#include "cpu.h"

namespace llmrt_kernels {

struct NeonDot {
  static inline int32x4_t dot(int32x4_t acc, int8x16_t a, int8x16_t b) {
    int16x8_t t = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    t = vmlal_high_s8(t, a, b);
    return vpadalq_s16(acc, t);
  }
  static inline int32x4_t dot2(int32x4_t acc, int8x16_t a1, int8x16_t b1, int8x16_t a2,
                               int8x16_t b2) {
    int16x8_t t = vmull_s8(vget_low_s8(a1), vget_low_s8(b1));
    t = vmlal_high_s8(t, a1, b1);
    t = vmlal_s8(t, vget_low_s8(a2), vget_low_s8(b2));
    t = vmlal_high_s8(t, a2, b2);
    return vpadalq_s16(acc, t);
  }
};

struct DotprodDot {
  LLMRT_DOTPROD static inline int32x4_t dot(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__clang__)
    return vreinterpretq_s32_s8(__builtin_neon_vdotq_v(vreinterpretq_s8_s32(acc), a, b, 34));
#else
    return vdotq_s32(acc, a, b);
#endif
  }
  LLMRT_DOTPROD static inline int32x4_t dot2(int32x4_t acc, int8x16_t a1, int8x16_t b1,
                                             int8x16_t a2, int8x16_t b2) {
    return dot(dot(acc, a1, b1), a2, b2);
  }
};

// acc (2x2 int32: lanes (0,0), (0,1), (1,0), (1,1)) += a (2x8 int8: bytes 0-7 row 0, 8-15
// row 1) times b (2x8) transposed: smmla.
LLMRT_I8MM inline int32x4_t mmla(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__clang__)
  return vreinterpretq_s32_s8(__builtin_neon_vmmlaq_v(vreinterpretq_s8_s32(acc), a, b, 34));
#else
  return vmmlaq_s32(acc, a, b);
#endif
}

// Rows r, r + 1 of 16 bytes each as the two 2x8 operands of smmla (bytes 0-7, then 8-15).
inline void zip_rows(int8x16_t a, int8x16_t b, int8x16_t& lo, int8x16_t& hi) {
  lo = vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
  hi = vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
}

// Inlines a level's whole call tree into its entry point (so the entry, compiled for its
// level, holds the sdot/smmla helpers as instructions, never as calls).
#define LLMRT_FLATTEN __attribute__((flatten))

}  // namespace llmrt_kernels

#endif  // __aarch64__
