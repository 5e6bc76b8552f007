// Many activation rows against a Q4_K / Q5_K / Q6_K weight (ggml's blocks, the file's order)
// with the activations in ONE 8-bit level: the ``kquant_gemm_q8`` op, an opt-in path for
// prefill-sized calls (``device.gemm_dtype: int8``) that does half the products of
// kquant_gemm.cpp's two-level panels.
//
// Activation numerics (the op's contract; tests restate it): per row, per 256 consecutive
// values (one weight super-block), amax = max |x|, d = amax / 127 and q = nearbyint(x * s)
// with s = 127 / amax (float32 divide, float32 product, ties to even; q = 0, d = 0 where amax
// is 0), so |q| <= 127; beside them the int16 sums of q per 16 and per 32 values. Why per 256
// (ggml's Q8_K shape) rather than per 32: one activation scale per super-block lets the weights'
// 6- / 8-bit sub-block scales multiply the integer dot products in integers (vpmaddwd), the
// super-block sums in int32, and only one int32 -> float conversion per super-block, row and
// column remain; the mins (Q4_K / Q5_K, per 32) and Q6_K's -32 offset (per 16) come from the
// sums, four or eight vpmaddwd per super-block and row.
// The result per super-block: dx * (d * sum_j sc_j (q_j . x_j) - f * sum_j m_j (1 . x_j)),
// with Q4_K / Q5_K f = dmin and m the 6-bit mins (per 32), Q6_K f = 32 d and m = sc (per 16).
//
// The product loop (AVX2): panels of 8 output columns, unpacked per call from the blocks
// (kquant_panel.h: one 32-byte vector holds 8 columns' four consecutive quants), each row's
// four int8s broadcast into one vpmaddubsw per step and panel (two panels per tile). The
// int16 pair sums add up in int16 over as many steps as cannot overflow (|q| <= 127: Q4_K u <= 15, 8 steps <= 30480; Q5_K u <= 31,
// 4 steps <= 31496; Q6_K u <= 63, 2 steps <= 32004), then one vpmaddwd by the sub-block scale
// widens them into the int32 super-block sum (at most 3.1e7, 6.4e7, 2.7e8: no overflow).
// At AVX-512 VNNI / AVX-VNNI each step is one vpdpbusd into int32 per row, the sub-block
// scales one vpmulld per sub-block.
//
// Measured (Llama-3.2-1B's shapes 2048->2048, 2048->512, 2048->8192, 8192->2048, 512 rows, 2
// threads, random blocks, in-process medians against what QuantizedLinear runs today): forced
// AVX2 against kquant_gemm.cpp's two-level panels 1.86-2.09x on Q4_K (41-61 -> 86-114
// GMAC/s/core on a quiet machine) and 2.06-2.45x on Q6_K (33-46 -> 82-95); at AVX-512 VNNI
// against dequantize + MKL sgemm 1.2-2.2x (Q4_K) and 1.1-2.4x (Q6_K), where the vpdpbusd loop
// ran 1.0-1.5x the AVX2 loop's speed; forced avx_vnni its loop tied the AVX2 loop on Q4_K and
// won 1.13-1.18x on Q6_K. By rows at AVX2 (Q4_K): 0.6x at 16, 1.0x at 32, 1.1-1.3x at 64,
// 1.4-1.65x at 128 (Q6_K 1.7-2.4x from 16); at AVX-512 VNNI 1.0-1.6x at 128, 1.3-1.95x at 256.
// The AVX2 loop now takes two panels per broadcast (4 rows x 16 columns, tile_avx2): on a
// 2-core Zen 4 forced to AVX2, one thread, Llama-3.2-1B Q4_K_M tensors at 512 rows, Q4_K
// 111-115 -> 127-130 GMAC/s, Q6_K 87-100 -> 93-104. (A first two-panel try ran 0.77-0.88x:
// its step loop was left rolled, see tile_avx2.) The vpdpbusd loop takes two panels too:
// on the same Zen 4 at AVX-512 VNNI, one thread, 512 rows, best of five interleaved runs,
// Q4_K 118-133 -> 139-157 GMAC/s, Q6_K 127 -> 136; pp512 of the 1B Q4_K_M 208-232 -> 233-267
// tok/s. AVX-VNNI keeps one panel (16 registers; not measured here).

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "blocks.h"
#include "cpu.h"
#include "interleaved_layout.h"  // LLMRT_VNNI
#include "kquant_blocks.h"
#include "kquant_panel.h"
#include "linear.h"
#include "parallel.h"

namespace {

using llmrt_kernels::kQ4_K;
using llmrt_kernels::kQ5_K;
using llmrt_kernels::kQ6_K;
using llmrt_kernels::kQK;

// One row's 256 activation values: int8 quants, int16 sums per 16 and per 32, the scale d.
struct Q8Block {
  int8_t q[256];
  int16_t s[16];
  int16_t s32[8];
  float d;
  float pad[3];
};
static_assert(sizeof(Q8Block) == 320, "Q8Block");

[[maybe_unused]] constexpr int kCols = 8;
[[maybe_unused]] constexpr int kRows = 4;
[[maybe_unused]] constexpr int kRowsVnni = 6;
[[maybe_unused]] constexpr int64_t kPackBytes = 256 << 10;

// A panel's bytes per super-block: 8 groups x 8 steps x 32 bytes of quants, the int16
// sub-block scale vectors (lanes 2c, 2c + 1: column c's scale; one per 32 weights for Q4_K /
// Q5_K, per 16 for Q6_K), the int16 min vectors (lanes 2c, 2c + 1: column c's factors of the
// row's sums: Q4_K / Q5_K the mins of groups 2i, 2i + 1 against s32[2i], s32[2i + 1], four
// vectors; Q6_K the scales of 16-value parts 2i, 2i + 1 against s[2i], s[2i + 1], eight), then
// float d[8] and f[8].
[[maybe_unused]] constexpr int64_t scale_vectors(int64_t kind) { return kind == kQ6_K ? 16 : 8; }
[[maybe_unused]] constexpr int64_t min_vectors(int64_t kind) { return kind == kQ6_K ? 8 : 4; }
[[maybe_unused]] constexpr int64_t sb_bytes(int64_t kind) {
  return 2048 + 32 * scale_vectors(kind) + 32 * min_vectors(kind) + 64;
}

bool supported(int64_t kind) {
  if (kind != kQ4_K && kind != kQ5_K && kind != kQ6_K) return false;
#if defined(LLMRT_X86)
  return llmrt_kernels::has_avx2();
#else
  return false;
#endif
}

#if defined(LLMRT_X86)
using llmrt_kernels::group_avx2;
using llmrt_kernels::half_at;
using llmrt_kernels::store_steps;

// Rows [r0, r1) of x (k values each) as Q8Blocks (k / 256 per row).
LLMRT_AVX2 void quantize_rows_avx2(const float* x, int64_t r0, int64_t r1, int64_t k,
                                   Q8Block* out) {
  const int64_t nb = k / kQK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * kQK;
      Q8Block& o = out[r * nb + b];
      __m256 m = _mm256_setzero_ps();
      for (int i = 0; i < kQK; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float s = amax > 0.0f ? 127.0f / amax : 0.0f;
      o.d = amax / 127.0f;
      const __m256 sv = _mm256_set1_ps(s);
      for (int i = 0; i < kQK; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; ++j)
          v[j] = _mm256_cvtps_epi32(_mm256_round_ps(
              _mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), sv),
              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i w16a = _mm256_packs_epi32(v[0], v[1]), w16b = _mm256_packs_epi32(v[2], v[3]);
        // The two packs interleave dwords per 128-bit lane (values 0-3, 8-11, 16-19, 24-27 |
        // 4-7, ...); the permute puts them back in order.
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.q + i), p8);
      }
      for (int j = 0; j < 16; ++j) {
        int sum = 0;
        for (int t = 0; t < 16; ++t) sum += o.q[16 * j + t];
        o.s[j] = static_cast<int16_t>(sum);
      }
      for (int j = 0; j < 8; ++j) o.s32[j] = static_cast<int16_t>(o.s[2 * j] + o.s[2 * j + 1]);
    }
  }
}

// Column c's integer sub-block scales and mins of one block, and its float d and f (see the
// header comment). Q4_K / Q5_K: sc, m per 32 (8 each, 6 bits); Q6_K: sc per 16 (int8).
template <int64_t KIND>
void block_scales(const uint8_t* blk, int16_t* sc, int16_t* mn, float* d, float* f) {
  if constexpr (KIND == kQ6_K) {
    const int8_t* s = reinterpret_cast<const int8_t*>(blk + 192);
    for (int j = 0; j < 16; ++j) sc[j] = s[j];
    for (int j = 0; j < 16; ++j) mn[j] = s[j];
    *d = half_at(blk + 208);
    *f = 32.0f * *d;
  } else {
    const uint8_t* s = blk + 4;  // 12 bytes: 6-bit (scale, min) pairs
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
      } else {
        sc[j] = static_cast<int16_t>((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        mn[j] = static_cast<int16_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
      }
    }
    *d = half_at(blk);
    *f = half_at(blk + 2);
  }
}

// Weight rows [n0, n0 + cols) packed into ``out`` (k / 256 * sb_bytes bytes); the columns
// past ``cols`` are zero.
template <int64_t KIND>
LLMRT_AVX2 void pack_panel(const uint8_t* w, int64_t rb, int64_t k, int64_t n0, int64_t cols,
                           uint8_t* out) {
  constexpr int64_t bb = llmrt_kernels::kquant_block_bytes(KIND);
  constexpr int64_t nsv = scale_vectors(KIND);
  const int64_t nb = k / kQK;
  alignas(32) static const uint8_t zero_block[bb] = {};
  for (int64_t blk = 0; blk < nb; ++blk) {
    uint8_t* o = out + blk * sb_bytes(KIND);
    const uint8_t* src[kCols];
    for (int c = 0; c < kCols; ++c) src[c] = c < cols ? w + (n0 + c) * rb + blk * bb : zero_block;
    for (int gi = 0; gi < 8; ++gi) {
      __m256i v[kCols];
      for (int c = 0; c < kCols; ++c) v[c] = group_avx2<KIND>(src[c], gi);
      store_steps(v, o + gi * 256);
    }
    int16_t* scv = reinterpret_cast<int16_t*>(o + 2048);
    int16_t* mnv = reinterpret_cast<int16_t*>(o + 2048 + 32 * nsv);
    float* fl = reinterpret_cast<float*>(o + 2048 + 32 * nsv + 32 * min_vectors(KIND));
    for (int c = 0; c < kCols; ++c) {
      int16_t sc[16] = {}, mn[16] = {};
      float d = 0.0f, f = 0.0f;
      if (c < cols) block_scales<KIND>(src[c], sc, mn, &d, &f);
      for (int j = 0; j < nsv; ++j) scv[16 * j + 2 * c] = scv[16 * j + 2 * c + 1] = sc[j];
      for (int i = 0; i < min_vectors(KIND); ++i) {
        mnv[16 * i + 2 * c] = mn[2 * i];
        mnv[16 * i + 2 * c + 1] = mn[2 * i + 1];
      }
      fl[c] = d;
      fl[kCols + c] = f;
    }
  }
}

LLMRT_AVX2 inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Stores a tile row's 8 (or ``cols``) floats.
LLMRT_AVX2 inline void store_row(float* y, __m256 v, int64_t cols) {
  if (cols == kCols) {
    _mm256_storeu_ps(y, v);
  } else {
    alignas(32) float t[kCols];
    _mm256_store_ps(t, v);
    std::memcpy(y, t, static_cast<size_t>(cols) * 4);
  }
}

// The float step of one super-block: acc += dx * (d * isum - f * msum) per column, with msum
// the mins' vpmaddwd over the row's 16- (Q6_K) or 32-value sums.
template <int64_t KIND, int RT>
LLMRT_AVX2 inline void finish_block(const Q8Block* const* xb, const uint8_t* mins,
                                    const float* fl, const __m256i* isum, __m256* acc) {
  __m256i ms[RT];
  for (int r = 0; r < RT; ++r) ms[r] = _mm256_setzero_si256();
  for (int i = 0; i < min_vectors(KIND); ++i) {
    const __m256i mv = _mm256_load_si256(reinterpret_cast<const __m256i*>(mins + 32 * i));
    for (int r = 0; r < RT; ++r) {
      const int16_t* sums = KIND == kQ6_K ? xb[r]->s : xb[r]->s32;
      ms[r] = _mm256_add_epi32(ms[r], _mm256_madd_epi16(mv, bcast4(sums + 2 * i)));
      asm("" : "+x"(ms[r]));  // one chain per row (gcc otherwise spilled every product)
    }
  }
  const __m256 dv = _mm256_load_ps(fl), fv = _mm256_load_ps(fl + kCols);
  for (int r = 0; r < RT; ++r) {
    const __m256 dx = _mm256_set1_ps(xb[r]->d);
    if constexpr (KIND == kQ6_K) {  // f = 32 d: the offset joins the int32 sum (< 4.1e8)
      const __m256i v = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(ms[r], 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dv, dx), acc[r]);
    } else {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dv, dx), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms[r]), _mm256_mul_ps(fv, dx), acc[r]);
    }
  }
}

// Rows [0, RT) of the quantized x (``nb`` Q8Blocks per row) against CP consecutive packed
// panels (``panel_bytes`` apart): each broadcast of a row's four int8s feeds CP vpmaddubsw.
// Why CP = 2 at AVX2: the 4-row x 8-column tile issues 5 loads (one weight vector, four
// broadcasts, which issue like loads) per 4 vpmaddubsw and is load-bound at ~2.5 cycles per
// step; 4 x 16 issues 6 loads per 8 and is bound by the multiplies instead. Only the 8 int16
// chains and the 2 weight vectors stay in registers; the int32 and float sums are touched
// once per sub-block and super-block. The step loops are unrolled by pragma: at 16 columns
// the body passes gcc's size limit for complete unrolling, and the rolled loop ran at half
// speed. Replica loop (one thread, forced AVX2, -O3, Q4_K): 4 x 8 at 115-126 GMAC/s against
// 135-148 for 3 to 6 rows x 16.
template <int64_t KIND, int RT, int CP>
LLMRT_AVX2 void tile_avx2(const Q8Block* px, int64_t nb, const uint8_t* panel,
                          int64_t panel_bytes, float* y, int64_t ldy, int64_t cols) {
  constexpr int kSteps16 = KIND == kQ4_K ? 8 : (KIND == kQ5_K ? 4 : 2);
  constexpr int kStepsPerScale = KIND == kQ6_K ? 4 : 8;
  constexpr int64_t nsv = scale_vectors(KIND);
  __m256 acc[CP][RT];
  for (int c = 0; c < CP; ++c)
    for (int r = 0; r < RT; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o[CP];
    for (int c = 0; c < CP; ++c) o[c] = panel + c * panel_bytes + b * sb_bytes(KIND);
    const Q8Block* xb[RT];
    for (int r = 0; r < RT; ++r) xb[r] = px + r * nb + b;
    __m256i isum[CP][RT];
    for (int c = 0; c < CP; ++c)
      for (int r = 0; r < RT; ++r) isum[c][r] = _mm256_setzero_si256();
    for (int j = 0; j < nsv; ++j) {
#pragma GCC unroll 2
      for (int s0 = j * kStepsPerScale; s0 < (j + 1) * kStepsPerScale; s0 += kSteps16) {
        __m256i t[CP][RT];
#pragma GCC unroll 8
        for (int s = s0; s < s0 + kSteps16; ++s) {
          __m256i wv[CP];
#pragma GCC unroll 2
          for (int c = 0; c < CP; ++c)
            wv[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(o[c] + 32 * s));
#pragma GCC unroll 6
          for (int r = 0; r < RT; ++r) {
            const __m256i xv = bcast4(xb[r]->q + 4 * s);
#pragma GCC unroll 2
            for (int c = 0; c < CP; ++c) {
              const __m256i p = _mm256_maddubs_epi16(wv[c], xv);
              t[c][r] = s == s0 ? p : _mm256_add_epi16(t[c][r], p);
              asm("" : "+x"(t[c][r]));  // keep the sum a chain (gcc otherwise spills products)
            }
          }
        }
        for (int c = 0; c < CP; ++c) {
          const __m256i sv =
              _mm256_load_si256(reinterpret_cast<const __m256i*>(o[c] + 2048 + 32 * j));
          for (int r = 0; r < RT; ++r)
            isum[c][r] = _mm256_add_epi32(isum[c][r], _mm256_madd_epi16(t[c][r], sv));
        }
      }
    }
    for (int c = 0; c < CP; ++c)
      finish_block<KIND, RT>(
          xb, o[c] + 2048 + 32 * nsv,
          reinterpret_cast<const float*>(o[c] + 2048 + 32 * nsv + 32 * min_vectors(KIND)),
          isum[c], acc[c]);
  }
  for (int c = 0; c < CP; ++c)
    for (int r = 0; r < RT; ++r)
      store_row(y + r * ldy + c * kCols, acc[c][r], std::min<int64_t>(kCols, cols - c * kCols));
}

// tile_avx2 with vpdpbusd (AVX-512 VNNI on 256-bit vectors, or AVX-VNNI): each step's u8 x s8
// products sum straight into int32 per sub-block, the scale one vpmulld after it. The body is
// one macro so each level's function holds its own vpdpbusd inline (a shared template under
// the AVX2 target could not inline the VNNI instruction). CP panels per broadcast as at AVX2:
// at one panel the 6-row tile issued 7 loads (one weight vector, six broadcasts) per 6
// vpdpbusd and was load-bound; two issue 8 per 12 (AVX-512 VL has the 32 registers the 12
// chains need). The scale vector's int16 lanes 2c, 2c + 1 hold column c's scale (Q6_K's int8
// sign-extended), so the dword's low half, sign-extended, is the scale.
#define LLMRT_Q8_TILE_DP(DPBUSD)                                                                  \
  constexpr int kStepsPerScale = KIND == kQ6_K ? 4 : 8;                                         \
  constexpr int64_t nsv = scale_vectors(KIND);                                                  \
  __m256 acc[CP][RT];                                                                           \
  for (int c = 0; c < CP; ++c)                                                                  \
    for (int r = 0; r < RT; ++r) acc[c][r] = _mm256_setzero_ps();                               \
  for (int64_t b = 0; b < nb; ++b) {                                                            \
    const uint8_t* o[CP];                                                                       \
    for (int c = 0; c < CP; ++c) o[c] = panel + c * panel_bytes + b * sb_bytes(KIND);           \
    const Q8Block* xb[RT];                                                                      \
    for (int r = 0; r < RT; ++r) xb[r] = px + r * nb + b;                                       \
    __m256i isum[CP][RT];                                                                       \
    for (int c = 0; c < CP; ++c)                                                                \
      for (int r = 0; r < RT; ++r) isum[c][r] = _mm256_setzero_si256();                         \
    for (int s0 = 0; s0 < 64; s0 += kStepsPerScale) {                                           \
      __m256i t[CP][RT];                                                                        \
      for (int c = 0; c < CP; ++c)                                                              \
        for (int r = 0; r < RT; ++r) t[c][r] = _mm256_setzero_si256();                          \
      _Pragma("GCC unroll 8") for (int s = s0; s < s0 + kStepsPerScale; ++s) {                  \
        __m256i wv[CP];                                                                         \
        _Pragma("GCC unroll 2") for (int c = 0; c < CP; ++c) wv[c] =                            \
            _mm256_load_si256(reinterpret_cast<const __m256i*>(o[c] + 32 * s));                 \
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; ++r) {                                  \
          const __m256i xv = bcast4(xb[r]->q + 4 * s);                                          \
          _Pragma("GCC unroll 2") for (int c = 0; c < CP; ++c) t[c][r] =                        \
              DPBUSD(t[c][r], wv[c], xv);                                                       \
        }                                                                                       \
      }                                                                                         \
      for (int c = 0; c < CP; ++c) {                                                            \
        const __m256i sv = _mm256_srai_epi32(                                                   \
            _mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(               \
                                  o[c] + 2048 + 32 * (s0 / kStepsPerScale))),                   \
                              16),                                                              \
            16);                                                                                \
        for (int r = 0; r < RT; ++r)                                                            \
          isum[c][r] = _mm256_add_epi32(isum[c][r], _mm256_mullo_epi32(t[c][r], sv));           \
      }                                                                                         \
    }                                                                                           \
    for (int c = 0; c < CP; ++c)                                                                \
      finish_block<KIND, RT>(                                                                   \
          xb, o[c] + 2048 + 32 * nsv,                                                           \
          reinterpret_cast<const float*>(o[c] + 2048 + 32 * nsv + 32 * min_vectors(KIND)),      \
          isum[c], acc[c]);                                                                     \
  }                                                                                             \
  for (int c = 0; c < CP; ++c)                                                                  \
    for (int r = 0; r < RT; ++r)                                                                \
      store_row(y + r * ldy + c * kCols, acc[c][r], std::min<int64_t>(kCols, cols - c * kCols));

template <int64_t KIND, int RT, int CP>
LLMRT_VNNI void tile_vnni(const Q8Block* px, int64_t nb, const uint8_t* panel,
                          int64_t panel_bytes, float* y, int64_t ldy, int64_t cols) {
  LLMRT_Q8_TILE_DP(_mm256_dpbusd_epi32)
}
template <int64_t KIND, int RT, int CP>
LLMRT_AVX_VNNI void tile_avxvnni(const Q8Block* px, int64_t nb, const uint8_t* panel,
                                 int64_t panel_bytes, float* y, int64_t ldy, int64_t cols) {
  LLMRT_Q8_TILE_DP(_mm256_dpbusd_avx_epi32)
}
#undef LLMRT_Q8_TILE_DP

// Which product loop runs (``level``): 0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI. ``CP`` panels
// (``panel_bytes`` apart) at a time: 2 at AVX2 and AVX-512 VNNI (see tile_avx2 and the
// vpdpbusd tile), 1 at AVX-VNNI and for a pack block's odd last panel.
template <int64_t KIND, int RT, int CP>
void tile_at(int level, const Q8Block* px, int64_t nb, const uint8_t* panel, int64_t panel_bytes,
             float* y, int64_t ldy, int64_t cols) {
  if (level == 2) {
    tile_vnni<KIND, RT, CP>(px, nb, panel, panel_bytes, y, ldy, cols);
    return;
  }
  if constexpr (CP == 1) {
    if (level == 1) {
      tile_avxvnni<KIND, RT, CP>(px, nb, panel, panel_bytes, y, ldy, cols);
      return;
    }
  }
  tile_avx2<KIND, RT, CP>(px, nb, panel, panel_bytes, y, ldy, cols);
}

template <int64_t KIND, int CP>
void rows_kind(int level, const Q8Block* px, int64_t rows, int64_t nb, const uint8_t* panel,
               int64_t panel_bytes, float* y, int64_t ldy, int64_t cols) {
  const int tile = level == 2 ? kRowsVnni : kRows;
  int64_t r = 0;
  for (; r + tile <= rows; r += tile) {
    if (tile == kRowsVnni) {
      tile_at<KIND, kRowsVnni, CP>(level, px + r * nb, nb, panel, panel_bytes, y + r * ldy, ldy,
                                   cols);
    } else {
      tile_at<KIND, kRows, CP>(level, px + r * nb, nb, panel, panel_bytes, y + r * ldy, ldy,
                               cols);
    }
  }
  const Q8Block* pr = px + r * nb;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 5: tile_at<KIND, 5, CP>(level, pr, nb, panel, panel_bytes, yr, ldy, cols); break;
    case 4: tile_at<KIND, 4, CP>(level, pr, nb, panel, panel_bytes, yr, ldy, cols); break;
    case 3: tile_at<KIND, 3, CP>(level, pr, nb, panel, panel_bytes, yr, ldy, cols); break;
    case 2: tile_at<KIND, 2, CP>(level, pr, nb, panel, panel_bytes, yr, ldy, cols); break;
    case 1: tile_at<KIND, 1, CP>(level, pr, nb, panel, panel_bytes, yr, ldy, cols); break;
    default: break;
  }
}

template <int64_t KIND>
void gemm_kind(const Q8Block* px, int64_t rows, const uint8_t* w, int64_t rb, int64_t k,
               float* y, int64_t n, int level) {
  const int64_t nb = k / kQK;
  const int64_t panels = (n + kCols - 1) / kCols, panel_bytes = nb * sb_bytes(KIND);
  const int64_t per_block = std::clamp<int64_t>(kPackBytes / panel_bytes, 1, 16);
  const int64_t blocks = (panels + per_block - 1) / per_block;
  const int64_t tile_rows = level == 2 ? kRowsVnni : kRows;
  // Pack blocks from a shared counter (as kquant_gemm.cpp's): a core slowed by another
  // tenant takes fewer blocks instead of holding the other at the end.
  std::atomic<int64_t> next{0};
  llmrt_kernels::parallel_for(0, blocks, 1, [&](int64_t, int64_t) {
    std::vector<uint8_t> raw(static_cast<size_t>(per_block * panel_bytes + 32));
    uint8_t* packed = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(raw.data()) + 31) & ~static_cast<uintptr_t>(31));
    for (int64_t blk = next.fetch_add(1); blk < blocks; blk = next.fetch_add(1)) {
      const int64_t p0 = blk * per_block, p1 = std::min(panels, p0 + per_block);
      for (int64_t p = p0; p < p1; ++p)
        pack_panel<KIND>(w, rb, k, p * kCols, std::min<int64_t>(kCols, n - p * kCols),
                         packed + (p - p0) * panel_bytes);
      const int64_t pair = level == 1 ? 1 : 2;  // panels per tile (see tile_avx2)
      for (int64_t r = 0; r < rows; r += tile_rows) {
        const int64_t rt = std::min<int64_t>(tile_rows, rows - r);
        for (int64_t p = p0; p < p1; p += pair) {
          const uint8_t* pp = packed + (p - p0) * panel_bytes;
          float* yp = y + r * n + p * kCols;
          const int64_t cols = n - p * kCols;
          if (pair == 2 && p + 1 < p1) {
            rows_kind<KIND, 2>(level, px + r * nb, rt, nb, pp, panel_bytes, yp, n,
                               std::min<int64_t>(2 * kCols, cols));
          } else {  // one panel: every panel at AVX-VNNI, else the block's odd last one
            rows_kind<KIND, 1>(level, px + r * nb, rt, nb, pp, panel_bytes, yp, n,
                               std::min<int64_t>(kCols, cols));
          }
        }
      }
    }
  });
}
// The product loop's level (see tile_at).
int loop_level() {
  if (llmrt_kernels::has_avx512_vnni()) return 2;
  if (llmrt_kernels::has_avx_vnni()) return 1;
  return 0;
}
#endif  // LLMRT_X86

at::Tensor kquant_gemm_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t kind, int64_t k,
                          const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind == kQ4_K || kind == kQ5_K || kind == kQ6_K,
              "llmrt_kernels: kquant_gemm_q8: kind must be Q4_K (12), Q5_K (13) or Q6_K (14), got ",
              kind);
  TORCH_CHECK(supported(kind),
              "llmrt_kernels: kquant_gemm_q8 needs x86 AVX2 (kquant_gemm_q8_supported is false)");
  TORCH_CHECK(k > 0 && k % kQK == 0, "llmrt_kernels: kquant_gemm_q8: k must be a positive multiple of 256, got ", k);
  llmrt_kernels::check_weight(blocks, kind, k);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1,
              "llmrt_kernels: kquant_gemm_q8: x must be float32 on the CPU, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == k, "llmrt_kernels: kquant_gemm_q8: x has ", x.size(-1),
              " features, k is ", k);
  const int64_t n = blocks.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->device().is_cpu() && bias->dim() == 1 &&
                    bias->size(0) == n,
                "llmrt_kernels: kquant_gemm_q8: bias must be float32 [", n, "] on the CPU");
  }
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  if (rows == 0 || n == 0) return y;
#if defined(LLMRT_X86)
  const int64_t nb = k / kQK;
  std::vector<Q8Block> px(static_cast<size_t>(rows * nb));
  const float* xp = xc.const_data_ptr<float>();
  llmrt_kernels::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    quantize_rows_avx2(xp, r0, r1, k, px.data());
  });
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  const int64_t rb = blocks.size(1);
  float* yp = y.mutable_data_ptr<float>();
  const int level = loop_level();
  switch (kind) {
    case kQ4_K: gemm_kind<kQ4_K>(px.data(), rows, w, rb, k, yp, n, level); break;
    case kQ5_K: gemm_kind<kQ5_K>(px.data(), rows, w, rb, k, yp, n, level); break;
    default: gemm_kind<kQ6_K>(px.data(), rows, w, rb, k, yp, n, level); break;
  }
#endif
  if (bias.has_value()) y.add_(*bias);
  return y;
}

bool kquant_gemm_q8_supported(int64_t kind) { return supported(kind); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("kquant_gemm_q8(Tensor x, Tensor blocks, int kind, int k, Tensor? bias) -> Tensor");
  m.def("kquant_gemm_q8_supported(int kind) -> bool", &kquant_gemm_q8_supported);
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) { m.impl("kquant_gemm_q8", &kquant_gemm_q8); }
