// Linear layers straight from the GGUF block types of kquant_blocks.h (Q5_0, Q5_1, Q4_K, Q5_K,
// Q6_K, F16, BF16), and their dequantization (prefill GEMMs, embedding rows, references).
//
// How a block type runs: each weight block is unpacked (in registers / L1, once per block and
// weight row, shared by every activation row of the call) into 32-weight groups of unsigned
// integers q and per-16-weight float scales: w = a * (q - off) + m, i.e. a * q - b with
// b = a * off - m. Every type has that form (K-quants: a = d * sc, m = -dmin * mn; Q6_K:
// off = 32; Q5_0: off = 16; Q5_1: m = the block's minimum). Activations are quantized once per
// row (``kquant_prepare``) in groups of 32 values, as ggml does (Q8_1-like: an fp32 scale per
// 32 values and their sums), but in two levels sharing one scale: x ~ d * (h + l / 256), so
// the product keeps ~16 bits of x (the interleaved Q4 kernels do the same; one level moved
// SmolLM2's logits by ~1e-2, more than the greedy parity prompts' margins allow).
// Then sum(w * x) = d / 256 * (a . (q * (256 h + l))) - b . c, with c the activation sums per
// half group: integer dot products of u8 weights and s8 activations (AVX2 ``maddubs``, AVX-512
// VNNI ``vpdpbusd``), the levels combined in integers, scaled in float per 16 weights.
// The K-quants at AVX2 below AVX-512 VNNI share one activation scale per 256 values instead
// (``KBlock``, ggml's Q8_K in two levels) and accumulate a whole block in integers (see
// "block-scaled activations" below): the per-group float work had made them compute-bound.
//
// The portable loops are written so the compiler vectorizes them; the same inline code is
// instantiated under an AVX2 target (``LLMRT_AVX2``, x86 only) where the CPU has it, with the dot
// product in intrinsics; the K-quants take an AVX-512 VNNI tile where the CPU has it (one
// thread, batch 1, against the AVX2 tile: 1.45x for a Q4_K 4096x2048 GEMV, 1.6x for Q6_K
// 2048x8192). arm64: the same tiles with NEON widening dots, sdot at +dotprod, and at +i8mm
// smmla over two weight rows x two activation rows (row_pair_tile_i8mm). F16 / BF16 rows
// read float32 x directly (F16C conversion on AVX2, fcvtl on arm64).

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "cpu.h"

#if defined(LLMRT_X86)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "blocks.h"
#include "interleaved_layout.h"  // LLMRT_VNNI
#include "kquant_blocks.h"
#include "neon_dot.h"
#include "prefetch.h"

namespace {

using llmrt_kernels::half_at;
#if defined(LLMRT_X86)
using llmrt_kernels::half_f16c;
#endif
using llmrt_kernels::kBF16;
using llmrt_kernels::kF16;
using llmrt_kernels::kQ4_K;
using llmrt_kernels::kQ5_0;
using llmrt_kernels::kQ5_1;
using llmrt_kernels::kQ5_K;
using llmrt_kernels::kQ6_K;
using llmrt_kernels::kQK;
using llmrt_kernels::kquant_block_bytes;
using llmrt_kernels::kquant_block_weights;

// Activation levels (see the file comment).
constexpr int kLevels = 2;

// One group of 32 unpacked weights: w[i] = a[i / 16] * (q[i] - off) + m[i / 16].
struct alignas(32) WGroup {
  uint8_t q[32];
  float a8[8];  // a[0] in lanes 0-3, a[1] in lanes 4-7 (the AVX2 dot's per-lane scales)
  float b[2];   // a * off - m: what the activation sums are multiplied by
  float m[2];
  float off;
};

// One group of 32 prepared activations: x ~ sum_l d[l] * q[l], c[h] = sum_l d[l] * sum(q[l] half h).
struct PGroup {
  int8_t q[kLevels][32];
  float d[kLevels];
  float c[2];
};

constexpr int64_t groups_per_block(int64_t kind) { return kind == kQ5_0 || kind == kQ5_1 ? 1 : 8; }

inline void set_scales(WGroup& g, float a0, float a1, float off, float m0, float m1) {
  for (int i = 0; i < 4; ++i) {
    g.a8[i] = a0;
    g.a8[4 + i] = a1;
  }
  g.off = off;
  g.m[0] = m0;
  g.m[1] = m1;
  g.b[0] = a0 * off - m0;
  g.b[1] = a1 * off - m1;
}

// K-quant 6-bit (scale, min) pair j of a Q4_K / Q5_K block's 12 scale bytes.
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The block at ``blk`` as groups_per_block(KIND) groups.
template <int64_t KIND>
inline void unpack_block(const uint8_t* blk, WGroup* g) {
  if constexpr (KIND == kQ5_0 || KIND == kQ5_1) {
    const float d = half_at(blk);
    const uint8_t* p = blk + (KIND == kQ5_1 ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const uint8_t* qs = p + 4;
    for (int j = 0; j < 16; ++j) {
      g->q[j] = static_cast<uint8_t>((qs[j] & 15) | (((qh >> j) & 1u) << 4));
      g->q[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
    }
    if constexpr (KIND == kQ5_1) {
      const float m = half_at(blk + 2);
      set_scales(*g, d, d, 0.0f, m, m);
    } else {
      set_scales(*g, d, d, 16.0f, 0.0f, 0.0f);
    }
  } else if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    const float d = half_at(blk), dmin = half_at(blk + 2);
    const uint8_t* scales = blk + 4;
    const uint8_t* qh = blk + 16;  // Q5_K only
    const uint8_t* qs = blk + (KIND == kQ5_K ? 48 : 16);
    for (int grp = 0; grp < 8; ++grp) {
      const uint8_t* src = qs + 32 * (grp / 2);
      const int shift = 4 * (grp % 2);
      for (int l = 0; l < 32; ++l) {
        uint8_t q = static_cast<uint8_t>((src[l] >> shift) & 15);
        if constexpr (KIND == kQ5_K) q = static_cast<uint8_t>(q | (((qh[l] >> grp) & 1) << 4));
        g[grp].q[l] = q;
      }
      int sc, mn;
      scale_min_k4(grp, scales, sc, mn);
      const float a = d * static_cast<float>(sc), m = -(dmin * static_cast<float>(mn));
      set_scales(g[grp], a, a, 0.0f, m, m);
    }
  } else {  // Q6_K
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_at(blk + 208);
    for (int grp = 0; grp < 8; ++grp) {
      const int h = grp / 4, t = grp % 4;
      const uint8_t* lo = ql + 64 * h + 32 * (t % 2);
      const int lshift = 4 * (t / 2);
      const uint8_t* hi = qh + 32 * h;
      const int hshift = 2 * t;
      for (int l = 0; l < 32; ++l)
        g[grp].q[l] =
            static_cast<uint8_t>(((lo[l] >> lshift) & 15) | (((hi[l] >> hshift) & 3) << 4));
      set_scales(g[grp], d * static_cast<float>(sc[2 * grp]),
                 d * static_cast<float>(sc[2 * grp + 1]), 32.0f, 0.0f, 0.0f);
    }
  }
}

// The 32 values at ``x`` as a prepared group: x ~ d * (h + l / 256) with d = max|x| / 127,
// h = round(x / d) and l = round(256 * (x / d - h)) clamped to +-127 (error at most d / 512,
// as the interleaved kernels' activations). The levels share one scale (d[1] = d[0] / 256,
// exact), so an integer dot may combine them as 256 * (w . h) + (w . l) before one float
// scaling (the VNNI and AVX2 tiles do); the scalar loop keeps them as two levels.
inline void quantize_group(const float* x, PGroup& p) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int s[kLevels][2] = {};
  for (int j = 0; j < 32; ++j) {
    const float v = x[j] * inv;
    const float h = std::nearbyint(v);
    const float l = std::min(127.0f, std::max(-127.0f, std::nearbyint((v - h) * 256.0f)));
    p.q[0][j] = static_cast<int8_t>(h);
    p.q[1][j] = static_cast<int8_t>(l);
    s[0][j / 16] += static_cast<int>(h);
    s[1][j / 16] += static_cast<int>(l);
  }
  p.d[0] = d;
  p.d[1] = d * (1.0f / 256.0f);
  for (int h = 0; h < 2; ++h)
    p.c[h] = p.d[0] * static_cast<float>(s[0][h]) + p.d[1] * static_cast<float>(s[1][h]);
}

inline void prepare_rows(const float* x, int64_t r0, int64_t r1, int64_t k, uint8_t* prep) {
  const int64_t groups = k / 32;
  for (int64_t r = r0; r < r1; ++r) {
    PGroup* p = reinterpret_cast<PGroup*>(prep) + r * groups;
    for (int64_t gi = 0; gi < groups; ++gi) quantize_group(x + r * k + gi * 32, p[gi]);
  }
}

#if defined(LLMRT_X86)
LLMRT_AVX2 void prepare_rows_avx2(const float* x, int64_t r0, int64_t r1, int64_t k,
                                     uint8_t* prep) {
  prepare_rows(x, r0, r1, k, prep);
}
#endif

// ---- dot products over unpacked groups ----------------------------------------------------

inline float dot_group_scalar(const WGroup& g, const PGroup& p) {
  float s = 0.0f;
  for (int l = 0; l < kLevels; ++l) {
    int i0 = 0, i1 = 0;
    for (int j = 0; j < 16; ++j) i0 += static_cast<int>(g.q[j]) * p.q[l][j];
    for (int j = 16; j < 32; ++j) i1 += static_cast<int>(g.q[j]) * p.q[l][j];
    s += p.d[l] * (g.a8[0] * static_cast<float>(i0) + g.a8[4] * static_cast<float>(i1));
  }
  return s - (g.b[0] * p.c[0] + g.b[1] * p.c[1]);
}

// Rows [r0, r0 + rt) of prepared x against weight row n, for blocks of KIND (portable).
template <int64_t KIND>
void range_scalar(const uint8_t* prep, int64_t rows_m, const uint8_t* w, int64_t rb, int64_t k,
                  float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t G = groups_per_block(KIND);
  constexpr int64_t bb = kquant_block_bytes(KIND);
  const int64_t nb = k / kquant_block_weights(KIND), groups = k / 32;
  const PGroup* px = reinterpret_cast<const PGroup*>(prep);
  WGroup g[G];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * rb;
    for (int64_t r = 0; r < rows_m; ++r) y[r * ldy + n] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      unpack_block<KIND>(row + b * bb, g);
      for (int64_t r = 0; r < rows_m; ++r) {
        const PGroup* p = px + r * groups + b * G;
        float s = 0.0f;
        for (int64_t i = 0; i < G; ++i) s += dot_group_scalar(g[i], p[i]);
        y[r * ldy + n] += s;
      }
    }
  }
}

#if defined(LLMRT_X86)
LLMRT_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// 256 * (q . h) + (q . l) per four weights (8 int32 lanes) of a group's unsigned quants ``qw``
// against its prepared levels (quantize_group: one shared scale, so the levels combine in
// integers; |sum| < 2^25).
#if defined(LLMRT_X86)
LLMRT_AVX2 inline __m256i two_level_dot_avx2(__m256i qw, const PGroup& p, __m256i ones) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q[0]));
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q[1]));
  const __m256i ih = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, h), ones);
  const __m256i il = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, l), ones);
  return _mm256_add_epi32(_mm256_slli_epi32(ih, 8), il);
}
#endif

// Activation rows one pass over a weight block serves (accumulators in registers).
constexpr int64_t kRowTile = 4;

// A Q5_0 / Q5_1 block's 32 five-bit values as bytes, in registers: nibbles from qs, bit j of
// qh spread to byte j (a byte shuffle of the broadcast word, then a per-byte bit test).
#if defined(LLMRT_X86)
LLMRT_AVX2 inline __m256i q5_bytes_avx2(const uint8_t* qs, uint32_t qh) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low),
                                       _mm_and_si128(raw, low));
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}
#endif

// row_tile_avx2 for the one-group blocks (Q5_0, Q5_1): unpacked in registers.
#if defined(LLMRT_X86)
template <int64_t KIND, int RT>
LLMRT_AVX2 void row_tile_q5_avx2(const PGroup* px, int64_t groups, const uint8_t* row,
                                    int64_t nb, float* y, int64_t ldy, int64_t n) {
  constexpr int64_t bb = kquant_block_bytes(KIND);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RT];
  float macc[RT];
  for (int r = 0; r < RT; ++r) {
    acc[r] = _mm256_setzero_ps();
    macc[r] = 0.0f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = half_f16c(blk);
    const uint8_t* p5 = blk + (KIND == kQ5_1 ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p5, 4);
    const __m256i qw = q5_bytes_avx2(p5 + 4, qh);
    const float off = KIND == kQ5_1 ? -half_f16c(blk + 2) : 16.0f * d;  // b = d * 16 or -m
    for (int r = 0; r < RT; ++r) {
      const PGroup& p = px[r * groups + b];
      const __m256i iv = two_level_dot_avx2(qw, p, ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_set1_ps(d * p.d[1]), acc[r]);
      macc[r] += off * (p.c[0] + p.c[1]);
    }
  }
  for (int r = 0; r < RT; ++r) y[r * ldy + n] = hsum_avx2(acc[r]) - macc[r];
}
#endif

// Group ``grp`` of a K-quant block's quants as bytes, in registers (unpack_block's rule).
#if defined(LLMRT_X86)
template <int64_t KIND>
LLMRT_AVX2 inline __m256i kquant_group_avx2(const uint8_t* blk, int grp) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    const uint8_t* qs = blk + (KIND == kQ5_K ? 48 : 16);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (grp / 2)));
    const __m128i shift = _mm_cvtsi32_si128(4 * (grp % 2));
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(raw, shift), low);
    if constexpr (KIND == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(grp)),
                                           _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
  } else {  // Q6_K
    const int h = grp / 4, t = grp % 4;
    const __m256i lo = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (t % 2)));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i ql = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (t / 2))), low);
    const __m256i qh = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * t)),
                                        _mm256_set1_epi8(3));
    return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
  }
}
#endif

// A K-quant block's per-half-group scales: a (the quants' factor) and b (the activation
// sums' factor), as unpack_block computes them.
template <int64_t KIND>
inline void kquant_scales(const uint8_t* blk, float a[8][2], float b[8][2]) {
  if constexpr (KIND == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_at(blk + 208);
    for (int g = 0; g < 8; ++g)
      for (int h = 0; h < 2; ++h) {
        a[g][h] = d * static_cast<float>(sc[2 * g + h]);
        b[g][h] = 32.0f * a[g][h];
      }
  } else {
    const float d = half_at(blk), dmin = half_at(blk + 2);
    for (int g = 0; g < 8; ++g) {
      int sc, mn;
      scale_min_k4(g, blk + 4, sc, mn);
      a[g][0] = a[g][1] = d * static_cast<float>(sc);
      b[g][0] = b[g][1] = dmin * static_cast<float>(mn);
    }
  }
}

// row_tile_avx2 for the K-quants: quants unpacked in registers, scales once per block.
#if defined(LLMRT_X86)
template <int64_t KIND, int RT>
LLMRT_AVX2 void row_tile_kquant_avx2(const PGroup* px, int64_t groups, const uint8_t* row,
                                        int64_t nb, float* y, int64_t ldy, int64_t n) {
  constexpr int64_t bb = kquant_block_bytes(KIND);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RT];
  float macc[RT];
  for (int r = 0; r < RT; ++r) {
    acc[r] = _mm256_setzero_ps();
    macc[r] = 0.0f;
  }
  float a[8][2], b[8][2];
  for (int64_t blkno = 0; blkno < nb; ++blkno) {
    const uint8_t* blk = row + blkno * bb;
    kquant_scales<KIND>(blk, a, b);
    for (int g = 0; g < 8; ++g) {
      const __m256i qw = kquant_group_avx2<KIND>(blk, g);
      const __m256 av = _mm256_set_m128(_mm_set1_ps(a[g][1]), _mm_set1_ps(a[g][0]));
      for (int r = 0; r < RT; ++r) {
        const PGroup& p = px[r * groups + blkno * 8 + g];
        const __m256i iv = two_level_dot_avx2(qw, p, ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(av, _mm256_set1_ps(p.d[1])),
                                 acc[r]);
        macc[r] += b[g][0] * p.c[0] + b[g][1] * p.c[1];
      }
    }
  }
  for (int r = 0; r < RT; ++r) y[r * ldy + n] = hsum_avx2(acc[r]) - macc[r];
}

template <int64_t KIND, int RT>
LLMRT_AVX2 void row_tile_avx2(const PGroup* px, int64_t groups, const uint8_t* row,
                                 int64_t nb, float* y, int64_t ldy, int64_t n) {
  if constexpr (KIND == kQ5_0 || KIND == kQ5_1) {
    row_tile_q5_avx2<KIND, RT>(px, groups, row, nb, y, ldy, n);
    return;
  } else {
    row_tile_kquant_avx2<KIND, RT>(px, groups, row, nb, y, ldy, n);
  }
}

template <int64_t KIND>
LLMRT_AVX2 void range_avx2(const uint8_t* prep, int64_t rows_m, const uint8_t* w, int64_t rb,
                              int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = k / kquant_block_weights(KIND), groups = k / 32;
  const PGroup* px = reinterpret_cast<const PGroup*>(prep);
  llmrt_kernels::AheadPrefetch ahead(w + n0 * rb, w + n1 * rb);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * rb;
    ahead.upto(row + rb);
    int64_t r = 0;
    for (; r + kRowTile <= rows_m; r += kRowTile)
      row_tile_avx2<KIND, kRowTile>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n);
    switch (rows_m - r) {
      case 3: row_tile_avx2<KIND, 3>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n); break;
      case 2: row_tile_avx2<KIND, 2>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n); break;
      case 1: row_tile_avx2<KIND, 1>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n); break;
      default: break;
    }
  }
}
#endif

// ---- block-scaled activations: the K-quant GEMV at AVX2 below AVX-512 VNNI -----------------
// Why: with one activation scale per 32 values (PGroup) every group of every weight row needs
// its own float scaling (convert, two multiplies, an FMA, two scalar FMAs for the minimum):
// at batch 1 that float work, not the weight bytes, set the speed (a Q4_K 8192x2048 GEMV read
// 7 GB/s on one thread, forced AVX2). Here the activations of a K-quant super-block share one
// scale (ggml's Q8_K, kept in two levels: x ~ d / 256 * (256 h + l), error at most d / 512 with
// d = max|x| / 127 over 256 values), so a block's eight groups accumulate in integers: the
// u8 x s8 products (vpmaddubsw), times the 6- or 8-bit group scales (vpmaddwd), summed over
// the block, then scaled in float once per block. The minimum / offset term is the weights'
// small integer mins times the activations' sums per 16 / 32 values, also once per block.
// Bounds (int32 lanes, per block): Q4_K 8 * 2 * (2 * 15 * 127) * 63 < 2^22, Q5_K < 2^23,
// Q6_K 8 * 2 * (2 * 63 * 127) * 128 < 2^26; the two levels are converted apart.

// One super-block of 256 prepared activations.
struct KBlock {  // no alignas: the prepared buffers are 16-byte aligned at best
  int8_t h[256];
  int8_t l[256];
  float s16[16];  // sum of 256 h + l per 16 values (exact in float: < 2^20)
  float s32[8];   // the same per 32 values
  float d;        // d / 256 is the scale of 256 h + l
  float pad[7];
};
static_assert(sizeof(KBlock) == 640, "KBlock layout");

// Whether the K-quants run the AVX-512 VNNI tile (range_vnni, per-32 groups): at that level,
// except where 512-bit ops issue as two halves (Zen 4), where the block-scaled path below beat
// it (2-core EPYC, 2 threads, batch 1: Q4_K 8192x2048 0.36 against 0.52 ms, Q6_K 2048x8192
// 0.49 against 0.60 ms; batch 4 1.3-1.5x); Intel's AVX-512 VNNI CPUs keep the tile.
inline bool kquant_vnni_tile() {
  return llmrt_kernels::has_avx512_vnni() && !llmrt_kernels::zmm_halves();
}

// Whether the K-quants run the block-scaled path: x86 from AVX2 (AVX-VNNI included) where
// they do not run the AVX-512 VNNI tile (Zen 4 with AVX-512 VNNI included: there the tile's
// vpmaddwd + vpaddd are one 256-bit vpdpwssd, kb_vnni256; 1B Q4_K_M decode 33-34 against
// 35-36 ms a step).
inline bool kblock_path(int64_t kind) {
#if defined(LLMRT_X86)
  return (kind == kQ4_K || kind == kQ5_K || kind == kQ6_K) && llmrt_kernels::has_avx2() &&
         !kquant_vnni_tile();
#else
  (void)kind;
  return false;
#endif
}

#if defined(LLMRT_X86)
LLMRT_AVX2 void prepare_kblocks_avx2(const float* x, int64_t r0, int64_t r1, int64_t k,
                                     uint8_t* prep) {
  const int64_t nb = k / kQK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
  const __m256 k256 = _mm256_set1_ps(256.0f);
  for (int64_t r = r0; r < r1; ++r) {
    KBlock* out = reinterpret_cast<KBlock*>(prep) + r * nb;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * kQK;
      KBlock& p = out[b];
      __m256 mx = _mm256_setzero_ps();
      for (int j = 0; j < 256; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      p.d = amax / 127.0f;
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      for (int j = 0; j < 256; j += 16) {
        __m256i hv[2], lv[2];
        __m256i s = _mm256_setzero_si256();
        for (int u = 0; u < 2; ++u) {
          const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * u), inv);
          const __m256 h = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          __m256 l = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, h), k256),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          l = _mm256_min_ps(lim, _mm256_max_ps(nlim, l));
          hv[u] = _mm256_cvtps_epi32(h);
          lv[u] = _mm256_cvtps_epi32(l);
          s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_slli_epi32(hv[u], 8), lv[u]));
        }
        // 16 int32 -> 16 int8 (in order: packs works per 128-bit lane, then fix the order)
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i h16 = _mm256_packs_epi32(hv[0], hv[1]);  // lanes: h0-3 h8-11 | h4-7 h12-15
        const __m256i l16 = _mm256_packs_epi32(lv[0], lv[1]);
        const __m256i hl8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(h16, l16), perm);
        // hl8 dwords: h0-3 h4-7 h8-11 h12-15 l0-3 l4-7 l8-11 l12-15 (after the permute)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p.h + j), _mm256_castsi256_si128(hl8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p.l + j), _mm256_extracti128_si256(hl8, 1));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        p.s16[j / 16] = static_cast<float>(_mm_cvtsi128_si32(s4));
      }
      for (int g = 0; g < 8; ++g) p.s32[g] = p.s16[2 * g] + p.s16[2 * g + 1];
    }
  }
}

// Group g's 32 quants of a K-quant block as bytes (kquant_group_avx2), its scales below.
// Q4_K / Q5_K: the eight 6-bit scales and mins as bytes (scale_min_k4, four per word).
inline void k4_scales_mins(const uint8_t* blk, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t w[3];
  std::memcpy(w, blk + 4, 12);
  const uint32_t v[4] = {w[0] & 0x3F3F3F3Fu,
                         (w[2] & 0x0F0F0F0Fu) | (((w[0] >> 6) & 0x03030303u) << 4),
                         w[1] & 0x3F3F3F3Fu,
                         ((w[2] >> 4) & 0x0F0F0F0Fu) | (((w[1] >> 6) & 0x03030303u) << 4)};
  std::memcpy(sc, v, 8);
  std::memcpy(mn, v + 2, 8);
}

#define KB_NS kb_avx2
#define KB_TARGET LLMRT_AVX2
#define KB_ACC(acc, p16, sc) _mm256_add_epi32(acc, _mm256_madd_epi16(p16, sc))
#include "kquant_kblock_tile.h"
#undef KB_NS
#undef KB_TARGET
#undef KB_ACC
#define KB_NS kb_avx_vnni
#define KB_TARGET LLMRT_AVX_VNNI
#define KB_ACC(acc, p16, sc) _mm256_dpwssd_avx_epi32(acc, p16, sc)
#include "kquant_kblock_tile.h"
#undef KB_NS
#undef KB_TARGET
#undef KB_ACC
// AVX-512 VNNI CPUs that take this path (Zen 4: kquant_vnni_tile) have the same 256-bit
// vpdpwssd in its EVEX form (AVX512VL): one instruction for vpmaddwd + vpaddd.
#define KB_NS kb_vnni256
#define KB_TARGET LLMRT_VNNI
#define KB_ACC(acc, p16, sc) _mm256_dpwssd_epi32(acc, p16, sc)
#include "kquant_kblock_tile.h"
#undef KB_NS
#undef KB_TARGET
#undef KB_ACC
#endif

// ---- AVX-512 VNNI: two groups per zmm (K-quants) ---------------------------------------
// The AVX2 tiles' arithmetic on 64 weights at a time: vpdpbusd multiplies the unsigned quants
// by the signed activation bytes and sums four products per int32 lane, the two levels
// combine in integers (256 * h-dot + l-dot), and one float FMA per 16 lanes applies the
// weights' scale (per 16 weights) times the activations' (per 32). A block's quants unpack
// with 512-bit loads into pairs of groups in the order the bytes give them (Q4_K / Q5_K:
// groups 4i + s and 4i + 2 + s share a 64-byte load; Q6_K: 2j and 2j + 1); the activations
// are loaded per group, so any pairing costs the same there. The min / offset term is the
// weights' b times the activation sums. Q5_0 / Q5_1 keep the AVX2 tile (one 32-weight block
// per scale: pairing two cost more than it saved, 126 against 100 us for a 1536x576 GEMV).

#if defined(LLMRT_X86)
// Bytes 0-31 from ``lo``, 32-63 from ``hi``.
LLMRT_VNNI inline __m512i join256(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// The groups each zmm of a block holds (low 32 bytes, high 32 bytes).
template <int64_t KIND>
constexpr int kPairLo[4] = {0, 1, 4, 5};
template <int64_t KIND>
constexpr int kPairHi[4] = {2, 3, 6, 7};
template <>
constexpr int kPairLo<kQ6_K>[4] = {0, 2, 4, 6};
template <>
constexpr int kPairHi<kQ6_K>[4] = {1, 3, 5, 7};

// A K-quant block's quants as four zmm of unsigned bytes, pair j = groups (kPairLo[j], kPairHi[j]).
template <int64_t KIND>
LLMRT_VNNI inline void kquant_unpack_vnni(const uint8_t* blk, __m512i q[4]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    const uint8_t* qs = blk + (KIND == kQ5_K ? 48 : 16);
    for (int i = 0; i < 2; ++i) {
      const __m512i raw = _mm512_loadu_si512(qs + 64 * i);  // chunks 2i (groups 4i, 4i+1), 2i+1
      q[2 * i] = _mm512_and_si512(raw, low);                              // groups 4i, 4i+2
      q[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);    // groups 4i+1, 4i+3
    }
    if constexpr (KIND == kQ5_K) {
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
      const __m512i one = _mm512_set1_epi8(1);
      for (int j = 0; j < 4; ++j) {
        const __m512i shift = _mm512_mask_mov_epi16(_mm512_set1_epi16(static_cast<short>(kPairLo<KIND>[j])),
                                                    0xFFFF0000u, _mm512_set1_epi16(static_cast<short>(kPairHi<KIND>[j])));
        const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), one);
        q[j] = _mm512_or_si512(q[j], _mm512_slli_epi16(bit, 4));
      }
    }
  } else {  // Q6_K: ql chunk 64h + 32(t % 2) >> 4(t / 2), qh chunk 32h >> 2t, for group 4h + t
    const __m512i three = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m512i raw = _mm512_loadu_si512(blk + 64 * h);  // t = 0, 1 low nibbles; 2, 3 high
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
      for (int u = 0; u < 2; ++u) {  // pair (4h + 2u, 4h + 2u + 1): t = 2u, 2u + 1
        const __m512i lo = _mm512_and_si512(u ? _mm512_srli_epi16(raw, 4) : raw, low);
        const __m512i shift = _mm512_mask_mov_epi16(_mm512_set1_epi16(static_cast<short>(4 * u)),
                                                    0xFFFF0000u, _mm512_set1_epi16(static_cast<short>(4 * u + 2)));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), three);
        q[2 * h + u] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
      }
    }
  }
}

// A K-quant block's scales as vectors: ``a[j]`` the quants' factor for pair j in vpdpbusd's
// lane order (four lanes per 16 weights), ``b`` the activation sums' factor (lane 2g + h).
template <int64_t KIND>
LLMRT_VNNI inline void kquant_scales_vnni(const uint8_t* blk, __m512 a[4], __m512& b) {
  __m512 a16;  // lane 2g + h
  if constexpr (KIND == kQ6_K) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    a16 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)),
                        _mm512_set1_ps(half_f16c(blk + 208)));
    b = _mm512_mul_ps(a16, _mm512_set1_ps(32.0f));
  } else {
    // The eight 6-bit (scale, min) pairs of scale_min_k4, four per 32-bit word.
    uint32_t w[3];
    std::memcpy(w, blk + 4, 12);
    const uint32_t sc_lo = w[0] & 0x3F3F3F3Fu, mn_lo = w[1] & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (w[2] & 0x0F0F0F0Fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((w[2] >> 4) & 0x0F0F0F0Fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    const __m128i v = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi),
                                     static_cast<int>(mn_lo), static_cast<int>(mn_hi));
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));  // sc 0-7, mn 8-15
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    a16 = _mm512_mul_ps(_mm512_permutexvar_ps(dup, f), _mm512_set1_ps(half_f16c(blk)));
    b = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(dup, _mm512_set1_epi32(8)), f),
                      _mm512_set1_ps(half_f16c(blk + 2)));
  }
  const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  for (int j = 0; j < 4; ++j) {
    const __m512i base = _mm512_mask_mov_epi32(_mm512_set1_epi32(2 * kPairLo<KIND>[j]), 0xFF00,
                                               _mm512_set1_epi32(2 * kPairHi<KIND>[j]));
    a[j] = _mm512_permutexvar_ps(_mm512_add_epi32(base, quad), a16);
  }
}

template <int64_t KIND, int RT>
LLMRT_VNNI void row_tile_kquant_vnni(const PGroup* px, int64_t groups, const uint8_t* row,
                                     int64_t nb, float* y, int64_t ldy, int64_t n) {
  constexpr int64_t bb = kquant_block_bytes(KIND);
  // Lane 2g + h of a block's activation sums: float offset of p[g].c[h] from p[0].c[0].
  const __m512i csum_at = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                         _mm512_set1_epi32(static_cast<int>(sizeof(PGroup) / sizeof(float)))),
      _mm512_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1));
  __m512 acc[RT], macc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
  for (int64_t blkno = 0; blkno < nb; ++blkno) {
    const uint8_t* blk = row + blkno * bb;
    __m512 a[4], b;
    kquant_scales_vnni<KIND>(blk, a, b);
    __m512i qw[4];
    kquant_unpack_vnni<KIND>(blk, qw);
    for (int r = 0; r < RT; ++r) {
      const PGroup* p = px + r * groups + blkno * 8;
      for (int j = 0; j < 4; ++j) {
        const PGroup& lo = p[kPairLo<KIND>[j]];
        const PGroup& hi = p[kPairHi<KIND>[j]];
        const __m512i h = join256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo.q[0])),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi.q[0])));
        const __m512i l = join256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo.q[1])),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi.q[1])));
        const __m512i ih = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw[j], h);
        const __m512i iv = _mm512_dpbusd_epi32(_mm512_slli_epi32(ih, 8), qw[j], l);
        const __m512 sx = _mm512_mask_mov_ps(_mm512_set1_ps(lo.d[1]), 0xFF00, _mm512_set1_ps(hi.d[1]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), _mm512_mul_ps(a[j], sx), acc[r]);
      }
      macc[r] = _mm512_fmadd_ps(b, _mm512_i32gather_ps(csum_at, p[0].c, 4), macc[r]);
    }
  }
  for (int r = 0; r < RT; ++r)
    y[r * ldy + n] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[r], macc[r]));
}

template <int64_t KIND>
LLMRT_VNNI void range_vnni(const uint8_t* prep, int64_t rows_m, const uint8_t* w, int64_t rb,
                           int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = k / kQK, groups = k / 32;
  const PGroup* px = reinterpret_cast<const PGroup*>(prep);
  llmrt_kernels::AheadPrefetch ahead(w + n0 * rb, w + n1 * rb);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * rb;
    ahead.upto(row + rb);
    int64_t r = 0;
    for (; r + kRowTile <= rows_m; r += kRowTile)
      row_tile_kquant_vnni<KIND, kRowTile>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n);
    const PGroup* pr = px + r * groups;
    float* yr = y + r * ldy;
    switch (rows_m - r) {
      case 3: row_tile_kquant_vnni<KIND, 3>(pr, groups, row, nb, yr, ldy, n); break;
      case 2: row_tile_kquant_vnni<KIND, 2>(pr, groups, row, nb, yr, ldy, n); break;
      case 1: row_tile_kquant_vnni<KIND, 1>(pr, groups, row, nb, yr, ldy, n); break;
      default: break;
    }
  }
}
#endif

// ---- arm64: the row tiles with NEON integer dots (neon_dot.h) -----------------------------

#if defined(LLMRT_ARM64)
// Rows [0, RT) of prepared x against one weight row: each block unpacked once (unpack_block,
// which the compiler vectorizes), then per group, level and 16-weight half an int8 dot
// (weights <= 63, so NeonDot's 16-bit pairs cannot overflow), scaled in float.
template <typename Dot, int64_t KIND, int RT>
inline void row_tile_neon(const PGroup* px, int64_t groups, const uint8_t* row, int64_t nb,
                          float* y, int64_t ldy, int64_t n) {
  constexpr int64_t G = groups_per_block(KIND);
  constexpr int64_t bb = kquant_block_bytes(KIND);
  float32x4_t acc[RT];
  float macc[RT];
  for (int r = 0; r < RT; ++r) {
    acc[r] = vdupq_n_f32(0.0f);
    macc[r] = 0.0f;
  }
  WGroup g[G];
  const int32x4_t zero = vdupq_n_s32(0);
  for (int64_t b = 0; b < nb; ++b) {
    unpack_block<KIND>(row + b * bb, g);
    for (int64_t i = 0; i < G; ++i) {
      const int8x16_t w0 = vreinterpretq_s8_u8(vld1q_u8(g[i].q));
      const int8x16_t w1 = vreinterpretq_s8_u8(vld1q_u8(g[i].q + 16));
      const float32x4_t a = {g[i].a8[0], g[i].a8[0], g[i].a8[4], g[i].a8[4]};
      for (int r = 0; r < RT; ++r) {
        const PGroup& p = px[r * groups + b * G + i];
        for (int l = 0; l < kLevels; ++l) {
          // lanes 0-1: the first 16 weights, 2-3: the second
          const int32x4_t s = vpaddq_s32(Dot::dot(zero, w0, vld1q_s8(p.q[l])),
                                         Dot::dot(zero, w1, vld1q_s8(p.q[l] + 16)));
          acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(s), vmulq_n_f32(a, p.d[l]));
        }
        macc[r] += g[i].b[0] * p.c[0] + g[i].b[1] * p.c[1];
      }
    }
  }
  for (int r = 0; r < RT; ++r) y[r * ldy + n] = vaddvq_f32(acc[r]) - macc[r];
}

template <typename Dot, int64_t KIND>
inline void range_neon_tiles(const uint8_t* prep, int64_t rows_m, const uint8_t* w, int64_t rb,
                             int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = k / kquant_block_weights(KIND), groups = k / 32;
  const PGroup* px = reinterpret_cast<const PGroup*>(prep);
  llmrt_kernels::AheadPrefetch ahead(w + n0 * rb, w + n1 * rb);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * rb;
    ahead.upto(row + rb);
    int64_t r = 0;
    for (; r + kRowTile <= rows_m; r += kRowTile)
      row_tile_neon<Dot, KIND, kRowTile>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n);
    switch (rows_m - r) {
      case 3: row_tile_neon<Dot, KIND, 3>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n); break;
      case 2: row_tile_neon<Dot, KIND, 2>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n); break;
      case 1: row_tile_neon<Dot, KIND, 1>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n); break;
      default: break;
    }
  }
}

template <int64_t KIND>
LLMRT_FLATTEN void range_neon(const uint8_t* prep, int64_t rows_m, const uint8_t* w, int64_t rb,
                              int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  range_neon_tiles<llmrt_kernels::NeonDot, KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
}

template <int64_t KIND>
LLMRT_DOTPROD LLMRT_FLATTEN void range_dotprod(const uint8_t* prep, int64_t rows_m,
                                               const uint8_t* w, int64_t rb, int64_t k, float* y,
                                               int64_t ldy, int64_t n0, int64_t n1) {
  range_neon_tiles<llmrt_kernels::DotprodDot, KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
}

// i8mm: weight rows n, n + 1 (each block unpacked once) against activation rows in pairs
// (RP pairs per pass): per group, 16-weight half and level, both weight rows' and both
// activation rows' 16 bytes zipped into smmla's 2x8 operands (llama.cpp's ARM K-quant dots
// take two rows this way when i8mm is there). Lanes: (r, n), (r, n + 1), (r + 1, n),
// (r + 1, n + 1). The levels are joined as 256 h + l in integers (16 * 63 * 127 * 257 < 2^31)
// and scaled once by d[1] (= d[0] / 256 exactly, quantize_group).
template <int64_t KIND, int RP>
LLMRT_I8MM inline void row_pair_tile_i8mm(const PGroup* px, int64_t groups, const uint8_t* row,
                                          int64_t rb, int64_t nb, float* y, int64_t ldy,
                                          int64_t n) {
  using llmrt_kernels::mmla;
  using llmrt_kernels::zip_rows;
  constexpr int64_t G = groups_per_block(KIND);
  constexpr int64_t bb = kquant_block_bytes(KIND);
  float32x4_t acc[RP], macc[RP];
  for (int i = 0; i < RP; ++i) acc[i] = macc[i] = vdupq_n_f32(0.0f);
  WGroup ga[G], gb[G];
  for (int64_t b = 0; b < nb; ++b) {
    unpack_block<KIND>(row + b * bb, ga);
    unpack_block<KIND>(row + rb + b * bb, gb);
    for (int64_t i = 0; i < G; ++i) {
      int8x16_t w[2][2];
      for (int h = 0; h < 2; ++h)
        zip_rows(vreinterpretq_s8_u8(vld1q_u8(ga[i].q + 16 * h)),
                 vreinterpretq_s8_u8(vld1q_u8(gb[i].q + 16 * h)), w[h][0], w[h][1]);
      const float32x4_t a[2] = {{ga[i].a8[0], gb[i].a8[0], ga[i].a8[0], gb[i].a8[0]},
                                {ga[i].a8[4], gb[i].a8[4], ga[i].a8[4], gb[i].a8[4]}};
      const float32x4_t bw[2] = {{ga[i].b[0], gb[i].b[0], ga[i].b[0], gb[i].b[0]},
                                 {ga[i].b[1], gb[i].b[1], ga[i].b[1], gb[i].b[1]}};
      for (int rp = 0; rp < RP; ++rp) {
        const PGroup& pa = px[(2 * rp) * groups + b * G + i];
        const PGroup& pb = px[(2 * rp + 1) * groups + b * G + i];
        const float32x4_t d = {pa.d[1], pa.d[1], pb.d[1], pb.d[1]};
        for (int h = 0; h < 2; ++h) {
          int32x4_t s[kLevels];
          for (int l = 0; l < kLevels; ++l) {
            int8x16_t x0, x1;
            zip_rows(vld1q_s8(pa.q[l] + 16 * h), vld1q_s8(pb.q[l] + 16 * h), x0, x1);
            s[l] = mmla(mmla(vdupq_n_s32(0), x0, w[h][0]), x1, w[h][1]);
          }
          const int32x4_t iv = vaddq_s32(vshlq_n_s32(s[0], 8), s[1]);
          acc[rp] = vfmaq_f32(acc[rp], vcvtq_f32_s32(iv), vmulq_f32(a[h], d));
          const float32x4_t c = {pa.c[h], pa.c[h], pb.c[h], pb.c[h]};
          macc[rp] = vfmaq_f32(macc[rp], bw[h], c);
        }
      }
    }
  }
  for (int rp = 0; rp < RP; ++rp) {
    const float32x4_t v = vsubq_f32(acc[rp], macc[rp]);
    float* y0 = y + (2 * rp) * ldy + n;
    float* y1 = y0 + ldy;
    y0[0] = vgetq_lane_f32(v, 0);
    y0[1] = vgetq_lane_f32(v, 1);
    y1[0] = vgetq_lane_f32(v, 2);
    y1[1] = vgetq_lane_f32(v, 3);
  }
}

template <int64_t KIND>
LLMRT_I8MM LLMRT_FLATTEN void range_i8mm(const uint8_t* prep, int64_t rows_m, const uint8_t* w,
                                         int64_t rb, int64_t k, float* y, int64_t ldy,
                                         int64_t n0, int64_t n1) {
  using llmrt_kernels::DotprodDot;
  if (rows_m < 2) {  // one activation row: nothing to pair (the dotprod tile)
    range_neon_tiles<DotprodDot, KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
    return;
  }
  const int64_t nb = k / kquant_block_weights(KIND), groups = k / 32;
  const PGroup* px = reinterpret_cast<const PGroup*>(prep);
  llmrt_kernels::AheadPrefetch ahead(w + n0 * rb, w + n1 * rb);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint8_t* row = w + n * rb;
    ahead.upto(row + 2 * rb);
    int64_t r = 0;
    for (; r + 2 * 2 <= rows_m; r += 2 * 2)
      row_pair_tile_i8mm<KIND, 2>(px + r * groups, groups, row, rb, nb, y + r * ldy, ldy, n);
    if (r + 2 <= rows_m) {
      row_pair_tile_i8mm<KIND, 1>(px + r * groups, groups, row, rb, nb, y + r * ldy, ldy, n);
      r += 2;
    }
    if (r < rows_m) {  // the odd last activation row
      row_tile_neon<DotprodDot, KIND, 1>(px + r * groups, groups, row, nb, y + r * ldy, ldy, n);
      row_tile_neon<DotprodDot, KIND, 1>(px + r * groups, groups, row + rb, nb, y + r * ldy, ldy,
                                         n + 1);
    }
  }
  if (n < n1)  // the odd last weight row
    range_neon_tiles<DotprodDot, KIND>(prep, rows_m, w, rb, k, y, ldy, n, n1);
}
#endif  // LLMRT_ARM64

// ---- 16-bit float rows ---------------------------------------------------------------------

template <int64_t KIND>
inline float f16ish(uint16_t bits) {
  if constexpr (KIND == kBF16) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
}

template <int64_t KIND>
void half_range_scalar(const float* x, int64_t rows_m, const uint16_t* w, int64_t k, float* y,
                       int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < rows_m; ++r) {
      float s = 0.0f;
      for (int64_t j = 0; j < k; ++j) s += f16ish<KIND>(w[n * k + j]) * x[r * k + j];
      y[r * ldy + n] = s;
    }
}

#if defined(LLMRT_X86)
template <int64_t KIND>
LLMRT_AVX2 inline __m256 load8_avx2(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (KIND == kBF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else
    return _mm256_cvtph_ps(h);
}

template <int64_t KIND>
LLMRT_AVX2 void half_range_avx2(const float* x, int64_t rows_m, const uint16_t* w, int64_t k,
                                   float* y, int64_t ldy, int64_t n0, int64_t n1) {
  llmrt_kernels::AheadPrefetch ahead(w + n0 * k, w + n1 * k);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * k;
    ahead.upto(row + k);
    for (int64_t r = 0; r < rows_m; ++r) {
      const float* xr = x + r * k;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 16 <= k; j += 16) {
        a0 = _mm256_fmadd_ps(load8_avx2<KIND>(row + j), _mm256_loadu_ps(xr + j), a0);
        a1 = _mm256_fmadd_ps(load8_avx2<KIND>(row + j + 8), _mm256_loadu_ps(xr + j + 8), a1);
      }
      float s = hsum_avx2(_mm256_add_ps(a0, a1));
      for (; j < k; ++j) s += f16ish<KIND>(row[j]) * xr[j];
      y[r * ldy + n] = s;
    }
  }
}
#endif

#if defined(LLMRT_ARM64)
template <int64_t KIND>
inline float32x4_t load4_neon(const uint16_t* p) {
  if constexpr (KIND == kBF16)
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  else
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

// half_range_avx2 in NEON (fp16 conversion and FMA are in every AArch64 CPU).
template <int64_t KIND>
void half_range_neon(const float* x, int64_t rows_m, const uint16_t* w, int64_t k, float* y,
                     int64_t ldy, int64_t n0, int64_t n1) {
  llmrt_kernels::AheadPrefetch ahead(w + n0 * k, w + n1 * k);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * k;
    ahead.upto(row + k);
    for (int64_t r = 0; r < rows_m; ++r) {
      const float* xr = x + r * k;
      float32x4_t a0 = vdupq_n_f32(0.0f), a1 = vdupq_n_f32(0.0f);
      int64_t j = 0;
      for (; j + 8 <= k; j += 8) {
        a0 = vfmaq_f32(a0, load4_neon<KIND>(row + j), vld1q_f32(xr + j));
        a1 = vfmaq_f32(a1, load4_neon<KIND>(row + j + 4), vld1q_f32(xr + j + 4));
      }
      float s = vaddvq_f32(vaddq_f32(a0, a1));
      for (; j < k; ++j) s += f16ish<KIND>(row[j]) * xr[j];
      y[r * ldy + n] = s;
    }
  }
}
#endif  // LLMRT_ARM64

// ---- dequantization ------------------------------------------------------------------------

template <int64_t KIND>
inline void dequant_rows(const uint8_t* w, int64_t rb, int64_t k, float* out, int64_t r0,
                         int64_t r1) {
  if constexpr (KIND == kF16 || KIND == kBF16) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(w + r * rb);
      for (int64_t j = 0; j < k; ++j) out[r * k + j] = f16ish<KIND>(row[j]);
    }
  } else {
    constexpr int64_t G = groups_per_block(KIND);
    constexpr int64_t bb = kquant_block_bytes(KIND);
    const int64_t nb = k / kquant_block_weights(KIND);
    WGroup g[G];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        unpack_block<KIND>(w + r * rb + b * bb, g);
        float* o = out + r * k + b * G * 32;
        for (int64_t i = 0; i < G; ++i)
          for (int j = 0; j < 32; ++j) {
            const int h = j / 16;
            o[i * 32 + j] =
                g[i].a8[4 * h] * (static_cast<float>(g[i].q[j]) - g[i].off) + g[i].m[h];
          }
      }
    }
  }
}

#if defined(LLMRT_X86)
template <int64_t KIND>
LLMRT_AVX2 void dequant_rows_avx2(const uint8_t* w, int64_t rb, int64_t k, float* out,
                                     int64_t r0, int64_t r1) {
  if constexpr (KIND == kF16 || KIND == kBF16) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(w + r * rb);
      int64_t j = 0;
      for (; j + 8 <= k; j += 8) _mm256_storeu_ps(out + r * k + j, load8_avx2<KIND>(row + j));
      for (; j < k; ++j) out[r * k + j] = f16ish<KIND>(row[j]);
    }
  } else {
    dequant_rows<KIND>(w, rb, k, out, r0, r1);
  }
}
#endif

template <int64_t KIND>
void range_kind(const float* x, int64_t rows_m, const uint8_t* w, int64_t rb, int64_t k,
                const uint8_t* prep, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if constexpr (KIND == kF16 || KIND == kBF16) {
    const uint16_t* wh = reinterpret_cast<const uint16_t*>(w);
#if defined(LLMRT_X86)
    if (llmrt_kernels::has_avx2()) {
      half_range_avx2<KIND>(x, rows_m, wh, k, y, ldy, n0, n1);
      return;
    }
#endif
#if defined(LLMRT_ARM64)
    if (llmrt_kernels::has_neon()) {
      half_range_neon<KIND>(x, rows_m, wh, k, y, ldy, n0, n1);
      return;
    }
#endif
    half_range_scalar<KIND>(x, rows_m, wh, k, y, ldy, n0, n1);
  } else {
#if defined(LLMRT_X86)
    if constexpr (KIND == kQ4_K || KIND == kQ5_K || KIND == kQ6_K) {
      if (kquant_vnni_tile()) {
        range_vnni<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
        return;
      }
    }
    if constexpr (KIND == kQ4_K || KIND == kQ5_K || KIND == kQ6_K) {
      if (kblock_path(KIND)) {
        if (llmrt_kernels::has_avx_vnni())
          kb_avx_vnni::range_kblock<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
        else if (llmrt_kernels::has_avx512_vnni())
          kb_vnni256::range_kblock<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
        else
          kb_avx2::range_kblock<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
        return;
      }
    }
    if (llmrt_kernels::has_avx2()) {
      range_avx2<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
      return;
    }
#endif
#if defined(LLMRT_ARM64)
    if (llmrt_kernels::has_i8mm()) {
      range_i8mm<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
      return;
    }
    if (llmrt_kernels::has_dotprod()) {
      range_dotprod<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
      return;
    }
    if (llmrt_kernels::has_neon()) {
      range_neon<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
      return;
    }
#endif
    range_scalar<KIND>(prep, rows_m, w, rb, k, y, ldy, n0, n1);
  }
}

template <int64_t KIND>
void dequant_kind(const uint8_t* w, int64_t rb, int64_t k, float* out, int64_t r0, int64_t r1) {
#if defined(LLMRT_X86)
  if (llmrt_kernels::has_avx2()) {
    dequant_rows_avx2<KIND>(w, rb, k, out, r0, r1);
    return;
  }
#endif
  dequant_rows<KIND>(w, rb, k, out, r0, r1);
}

}  // namespace

namespace llmrt_kernels {

int64_t kquant_prep_bytes(int64_t kind, int64_t k) {
  if (kind == kF16 || kind == kBF16) return 0;
  if (kblock_path(kind)) return k / kQK * static_cast<int64_t>(sizeof(KBlock));
  return k / 32 * static_cast<int64_t>(sizeof(PGroup));
}

void kquant_prepare(const float* x, int64_t r0, int64_t r1, int64_t kind, int64_t k,
                    uint8_t* prep) {
  if (kind == kF16 || kind == kBF16) return;
#if defined(LLMRT_X86)
  if (kblock_path(kind)) {
    prepare_kblocks_avx2(x, r0, r1, k, prep);
    return;
  }
#endif
  kquant_prepare_groups(x, r0, r1, k, prep);
}

void kquant_prepare_groups(const float* x, int64_t r0, int64_t r1, int64_t k, uint8_t* prep) {
#if defined(LLMRT_X86)
  if (llmrt_kernels::has_avx2()) {
    prepare_rows_avx2(x, r0, r1, k, prep);
    return;
  }
#endif
  prepare_rows(x, r0, r1, k, prep);
}

void kquant_range(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes,
                  int64_t kind, int64_t k, const uint8_t* prep, float* y, int64_t n, int64_t n0,
                  int64_t n1) {
  switch (kind) {
    case kQ5_0: range_kind<kQ5_0>(x, rows_m, w, row_bytes, k, prep, y, n, n0, n1); break;
    case kQ5_1: range_kind<kQ5_1>(x, rows_m, w, row_bytes, k, prep, y, n, n0, n1); break;
    case kQ4_K: range_kind<kQ4_K>(x, rows_m, w, row_bytes, k, prep, y, n, n0, n1); break;
    case kQ5_K: range_kind<kQ5_K>(x, rows_m, w, row_bytes, k, prep, y, n, n0, n1); break;
    case kQ6_K: range_kind<kQ6_K>(x, rows_m, w, row_bytes, k, prep, y, n, n0, n1); break;
    case kF16: range_kind<kF16>(x, rows_m, w, row_bytes, k, prep, y, n, n0, n1); break;
    case kBF16: range_kind<kBF16>(x, rows_m, w, row_bytes, k, prep, y, n, n0, n1); break;
    default: TORCH_CHECK(false, "llmrt_kernels: kquant_range has no type ", kind);
  }
}

void kquant_unpack_scales(const uint8_t* blk, int64_t kind, float* a, float* b) {
  float a2[8][2], b2[8][2];
  switch (kind) {
    case kQ4_K: kquant_scales<kQ4_K>(blk, a2, b2); break;
    case kQ5_K: kquant_scales<kQ5_K>(blk, a2, b2); break;
    case kQ6_K: kquant_scales<kQ6_K>(blk, a2, b2); break;
    default: TORCH_CHECK(false, "llmrt_kernels: kquant_unpack_scales has no type ", kind);
  }
  std::memcpy(a, a2, sizeof(a2));
  std::memcpy(b, b2, sizeof(b2));
}

void kquant_dequantize(const uint8_t* w, int64_t row_bytes, int64_t kind, int64_t k, float* out,
                       int64_t r0, int64_t r1) {
  switch (kind) {
    case kQ5_0: dequant_kind<kQ5_0>(w, row_bytes, k, out, r0, r1); break;
    case kQ5_1: dequant_kind<kQ5_1>(w, row_bytes, k, out, r0, r1); break;
    case kQ4_K: dequant_kind<kQ4_K>(w, row_bytes, k, out, r0, r1); break;
    case kQ5_K: dequant_kind<kQ5_K>(w, row_bytes, k, out, r0, r1); break;
    case kQ6_K: dequant_kind<kQ6_K>(w, row_bytes, k, out, r0, r1); break;
    case kF16: dequant_kind<kF16>(w, row_bytes, k, out, r0, r1); break;
    case kBF16: dequant_kind<kBF16>(w, row_bytes, k, out, r0, r1); break;
    default: TORCH_CHECK(false, "llmrt_kernels: kquant_dequantize has no type ", kind);
  }
}

}  // namespace llmrt_kernels
