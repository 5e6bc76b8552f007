// Many activation rows against an interleaved block weight: an integer GEMM (AVX-512 VNNI, and
// an AVX2 variant below).
//
// Why: prefill multiplies hundreds of rows by each weight. Dequantizing the weight to float32
// for MKL's sgemm reads and writes 8 bytes per weight and then runs at ~60% of the float32
// FMA peak (SmolLM2's shapes, 2 threads). vpdpbusd does 64 u8 x s8 products per instruction
// at the FMA's issue rate, so even with the activations' two int8 levels (two products per
// weight and activation) the integer loop has twice the float32 peak's arithmetic, and it
// reads the 4-bit blocks as they are. Measured on a 2-core Emerald Rapids VM (in-process,
// alternating): 165-185 GMAC/s against sgemm's 77-103 on SmolLM2's prefill shapes.
//
// Shape of the loop (the BLAS register-tile scheme with integer products):
// - the weight is walked in panels of 32 output columns. A panel's nibbles are unpacked once
//   into bytes ordered [block][k/4 step][column][4 k], so one 64-byte load holds 16 columns'
//   four consecutive weights, and every activation row of the call reuses it from cache;
// - a micro tile of kRows rows x 32 columns keeps its integer sums (one block, 32 k) and its
//   float sums in registers; each activation row's four int8s are broadcast (one load) into
//   a vpdpbusd per 16 columns;
// - per block, the integer sums of the high level are shifted by 8 and the low level's are
//   added on (256 h + l, as in the decode kernels), then scaled once: d (per column) x dx/256
//   (per row), plus the block's offset term m (per column) x sum(x) (per row). Q4_0 is
//   m = -8 d, and Q8_0 (quants stored + 128) is m = -128 d.
// Rows are prepared (two levels, natural order) once per call, in chunks that stay in L2
// while every panel passes over them.

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "blocks.h"
#include "interleaved_layout.h"
#include "linear.h"
#include "transpose.h"

namespace {

using llmrt_kernels::kBlock;
using llmrt_kernels::kQ8_0;

// Output columns per panel (two 16-lane vectors) and activation rows per micro tile: 6 x 2
// tiles hold 24 accumulators (12 integer, 12 float) and measured as fast as 5 x 2 and ahead of
// 4 x 2, 4 x 3, 3 x 3, 8 x 1 (41-13% more time) on SmolLM2's shapes.
constexpr int kVecs = 2;
constexpr int kCols = 16 * kVecs;
[[maybe_unused]] constexpr int kRows = 6;  // (x86 only, as the next two)
// A panel's bytes per block: 8 steps of kVecs 64-byte vectors, then d[kCols] and m[kCols].
[[maybe_unused]] constexpr int64_t kPanelBlock = 8 * kVecs * 64 + 2 * kCols * 4;
// Prepared activation bytes (both levels) a row chunk keeps under, so the chunk stays in L2
// while each panel passes over it (SmolLM2's MLP down projection at 2048 rows: 100 against
// 165 GMAC/s at 512).
[[maybe_unused]] constexpr int64_t kChunkBytes = 768 << 10;

// A call's activation rows, prepared: row r at ``rows + r * stride`` holds its two levels in
// natural order (h, then l: k int8 each), then per block dx / 256 and the block's sum of x as
// the levels represent it (nb floats each).
struct Levels {
  const uint8_t* rows;
  int64_t stride, k, nb;
};

constexpr int64_t levels_stride(int64_t k) { return 2 * k + 8 * (k / kBlock); }

#if defined(LLMRT_X86)
LLMRT_VNNI void prepare_rows(const float* x, int64_t r0, int64_t r1, int64_t k, uint8_t* out) {
  const int64_t nb = k / kBlock, stride = levels_stride(k);
  for (int64_t r = r0; r < r1; ++r) {
    int8_t* h = reinterpret_cast<int8_t*>(out + r * stride);
    int8_t* l = h + k;
    float* scale = reinterpret_cast<float*>(l + k);
    float* sum = scale + nb;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = b * kBlock;
      const llmrt_kernels::TwoLevel two = llmrt_kernels::two_level_block(
          x + r * k + at, h + at, l + at, h + at + 16, l + at + 16);
      scale[b] = two.dx / 256.0f;
      sum[b] = two.dx * (static_cast<float>(two.sum_h) + static_cast<float>(two.sum_l) / 256.0f);
    }
  }
}

// Sixteen 128-bit rows (``x[j]``: column j's four k/4 steps, one dword each) transposed into
// four vectors (``out[s]``: step s of the 16 columns) and stored at ``out[s * stride]``.
LLMRT_VNNI inline void transpose_steps(const __m512i z[4], uint8_t* out, int64_t stride) {
  // In each 128-bit lane L, registers a = 0..3 hold columns 4a + L: a 4x4 dword transpose per
  // lane puts step s of those columns in one register, and vpermd orders them 0..15.
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i u[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                        _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
  for (int s = 0; s < 4; ++s)
    _mm512_storeu_si512(out + s * stride, _mm512_permutexvar_epi32(order, u[s]));
}

// Four 128-bit rows in one vector (lane L: ``rows[L]``).
LLMRT_VNNI inline __m512i lanes4(const uint8_t* const* rows, int64_t offset) {
  const __m512i v = _mm512_castsi128_si512(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[0] + offset)));
  const __m512i v1 = _mm512_inserti32x4(
      v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[1] + offset)), 1);
  const __m512i v2 = _mm512_inserti32x4(
      v1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2] + offset)), 2);
  return _mm512_inserti32x4(v2, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[3] + offset)),
                            3);
}

// Weight rows [n0, n0 + cols) (cols <= kCols; the rest of the panel is zero) unpacked into
// ``out`` (nb * kPanelBlock bytes): per block and 16 columns, the quants are gathered four
// columns to a vector and transposed (~0.13 instructions per weight; one column at a time
// with scalar stores took ~0.4, which at 16 rows cost as much as the products).
LLMRT_VNNI void pack_panel(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t nb,
                           int64_t n0, int64_t cols, uint8_t* out) {
  alignas(64) static const uint8_t zeros[64] = {};
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = out + b * kPanelBlock;
    float* d = reinterpret_cast<float*>(o + 8 * kVecs * 64);
    for (int v = 0; v < kVecs; ++v) {
      const uint8_t* q[16];
      alignas(32) uint16_t dh[16], mh[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t col = 16 * v + j;
        if (col >= cols) {
          q[j] = zeros;
          dh[j] = mh[j] = 0;
          continue;
        }
        const llmrt_kernels::BlockBytes at =
            llmrt_kernels::block_bytes_at(w + (n0 + col) * row_bytes, base, nb, b);
        q[j] = at.q;
        std::memcpy(&dh[j], at.d, 2);
        if (at.m != nullptr) std::memcpy(&mh[j], at.m, 2);
      }
      __m512i lo[4], hi[4];
      for (int a = 0; a < 4; ++a) {
        const uint8_t* rows[4] = {q[4 * a], q[4 * a + 1], q[4 * a + 2], q[4 * a + 3]};
        const __m512i z = lanes4(rows, 0);
        if (base == kQ8_0) {
          lo[a] = z;                   // bytes 0-15: steps 0-3
          hi[a] = lanes4(rows, 16);    // bytes 16-31: steps 4-7
        } else {
          lo[a] = _mm512_and_si512(z, low);                         // elements 0-15
          hi[a] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);   // elements 16-31
        }
      }
      transpose_steps(lo, o + v * 64, kVecs * 64);
      transpose_steps(hi, o + (4 * kVecs + v) * 64, kVecs * 64);
      const __m512 dv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)));
      __m512 mv;
      if (base == llmrt_kernels::kQ4_1)
        mv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mh)));
      else
        mv = _mm512_mul_ps(dv, _mm512_set1_ps(base == kQ8_0 ? -128.0f : -8.0f));
      _mm512_storeu_ps(d + 16 * v, dv);
      _mm512_storeu_ps(d + kCols + 16 * v, mv);
    }
  }
}

// Rows [r0, r0 + R) of ``a`` against a packed panel into y (row stride ``ldy``).
template <int R>
LLMRT_VNNI void micro_tile(const uint8_t* panel, const Levels& a, int64_t r0, float* y,
                           int64_t ldy) {
  __m512 f[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) f[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* o = panel + b * kPanelBlock;
    __m512i acc[R][kVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_si512();
    for (int level = 0; level < 2; ++level) {
      const uint8_t* xs = a.rows + r0 * a.stride + level * a.k + b * kBlock;
      if (level == 1)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_slli_epi32(acc[r][c], 8);
      for (int s = 0; s < 8; ++s) {
        __m512i wv[kVecs];
        for (int c = 0; c < kVecs; ++c) wv[c] = _mm512_loadu_si512(o + (s * kVecs + c) * 64);
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xs + r * a.stride + 4 * s, 4);
          const __m512i xv = _mm512_set1_epi32(four);
          for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xv);
        }
      }
    }
    const float* d = reinterpret_cast<const float*>(o + 8 * kVecs * 64);
    for (int r = 0; r < R; ++r) {
      const float* scales = reinterpret_cast<const float*>(a.rows + (r0 + r) * a.stride + 2 * a.k);
      const __m512 dx = _mm512_set1_ps(scales[b]);
      const __m512 sx = _mm512_set1_ps(scales[a.nb + b]);
      for (int c = 0; c < kVecs; ++c) {
        f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]),
                                  _mm512_mul_ps(_mm512_loadu_ps(d + 16 * c), dx), f[r][c]);
        f[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(d + kCols + 16 * c), sx, f[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(y + r * ldy + 16 * c, f[r][c]);
}

void run_tile(int64_t rows, const uint8_t* panel, const Levels& a, int64_t r0, float* y,
              int64_t ldy) {
  switch (rows) {
    case 6: micro_tile<6>(panel, a, r0, y, ldy); break;
    case 5: micro_tile<5>(panel, a, r0, y, ldy); break;
    case 4: micro_tile<4>(panel, a, r0, y, ldy); break;
    case 3: micro_tile<3>(panel, a, r0, y, ldy); break;
    case 2: micro_tile<2>(panel, a, r0, y, ldy); break;
    default: micro_tile<1>(panel, a, r0, y, ldy); break;
  }
}
static_assert(kRows == 6, "run_tile's cases cover 1..kRows");

// Output columns [n0, n1) for every prepared row, panel by panel (``panel``: this thread's
// buffer of nb * kPanelBlock bytes).
void panels_range(const Levels& a, int64_t rows, const uint8_t* w, int64_t row_bytes,
                  int64_t base, float* y, int64_t n, int64_t n0, int64_t n1, uint8_t* panel) {
  alignas(64) float edge[kRows * kCols];
  for (int64_t c0 = n0; c0 < n1; c0 += kCols) {
    const int64_t cols = std::min<int64_t>(kCols, n1 - c0);
    pack_panel(w, row_bytes, base, a.nb, c0, cols, panel);
    for (int64_t r = 0; r < rows; r += kRows) {
      const int64_t tile = std::min<int64_t>(kRows, rows - r);
      if (cols == kCols) {
        run_tile(tile, panel, a, r, y + r * n + c0, n);
      } else {
        run_tile(tile, panel, a, r, edge, kCols);
        for (int64_t i = 0; i < tile; ++i)
          std::memcpy(y + (r + i) * n + c0, edge + i * kCols, cols * sizeof(float));
      }
    }
  }
}

// ---- AVX2 (+FMA, F16C): the same GEMM with 16-bit products ---------------------------------
//
// Without vpdpbusd, the two levels are joined into one 16-bit activation x16 = 256 h + l
// (|x16| <= 32639) and multiplied by the weights widened to 16 bits with vpmaddwd (16 x 16 ->
// pairs summed into 32 bits): one instruction per 8 columns x 2 k takes both levels, where
// vpmaddubsw would need two (one per level) plus the widening to 32 bits. Each integer sum
// per block equals the VNNI loop's 256 * sum(w h) + sum(w l) exactly (|w x16| pair sums <=
// 2 * 255 * 32639, 16 steps per block: < 2^31), and the float steps are the same, so the
// results are bit-equal to it.
//
// A panel is 16 columns (two 8-lane vectors); per block: 16 steps (k pairs 2t, 2t + 1) of
// two 32-byte vectors (column j's pair in lane j), then d[16] and m[16] as floats. A micro
// tile of 4 rows x 16 columns keeps 8 integer sums, 2 weight vectors and 4 broadcasts in the
// 16 ymm registers (at 6 rows gcc kept 9 of the 12 sums in memory); its float sums in L1.
constexpr int kCols2 = 16;
constexpr int kRows2 = 4;
constexpr int64_t kPanelBlock2 = 16 * 2 * 32 + 2 * kCols2 * 4;

// Rows as x16 (k int16, natural order), then per block dx / 256 and the block's sum of x as
// the levels represent it (nb floats each): ``levels_stride(k)`` bytes, as the VNNI rows.
LLMRT_AVX2 void prepare_rows_avx2(const float* x, int64_t r0, int64_t r1, int64_t k,
                                  uint8_t* out) {
  const int64_t nb = k / kBlock, stride = levels_stride(k);
  alignas(32) int8_t h[32], l[32];
  for (int64_t r = r0; r < r1; ++r) {
    int16_t* x16 = reinterpret_cast<int16_t*>(out + r * stride);
    float* scale = reinterpret_cast<float*>(x16 + k);
    float* sum = scale + nb;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = b * kBlock;
      const llmrt_kernels::TwoLevel two =
          llmrt_kernels::two_level_block_avx2(x + r * k + at, h, l, h + 16, l + 16);
      for (int half = 0; half < 2; ++half) {
        const __m256i hv = _mm256_cvtepi8_epi16(
            _mm_load_si128(reinterpret_cast<const __m128i*>(h + 16 * half)));
        const __m256i lv = _mm256_cvtepi8_epi16(
            _mm_load_si128(reinterpret_cast<const __m128i*>(l + 16 * half)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + at + 16 * half),
                            _mm256_add_epi16(_mm256_slli_epi16(hv, 8), lv));
      }
      scale[b] = two.dx / 256.0f;
      sum[b] = two.dx * (static_cast<float>(two.sum_h) + static_cast<float>(two.sum_l) / 256.0f);
    }
  }
}

// Weight rows [n0, n0 + cols) (cols <= kCols2; the rest zero) widened to int16 pairs into
// ``out`` (nb * kPanelBlock2 bytes): per block and 8 columns, each column's 16 pairs (low
// nibbles or first 16 quants: steps 0-7; the rest: steps 8-15) transposed to steps.
LLMRT_AVX2 void pack_panel_avx2(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t nb,
                                int64_t n0, int64_t cols, uint8_t* out) {
  alignas(64) static const uint8_t zeros[32] = {};
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = out + b * kPanelBlock2;
    float* d = reinterpret_cast<float*>(o + 16 * 2 * 32);
    for (int v = 0; v < 2; ++v) {
      __m256i first[8], second[8];
      alignas(16) uint16_t dh[8], mh[8];
      for (int j = 0; j < 8; ++j) {
        const int64_t col = 8 * v + j;
        const uint8_t* q = zeros;
        dh[j] = mh[j] = 0;
        if (col < cols) {
          const llmrt_kernels::BlockBytes at =
              llmrt_kernels::block_bytes_at(w + (n0 + col) * row_bytes, base, nb, b);
          q = at.q;
          std::memcpy(&dh[j], at.d, 2);
          if (at.m != nullptr) std::memcpy(&mh[j], at.m, 2);
        }
        const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        if (base == kQ8_0) {
          first[j] = _mm256_cvtepu8_epi16(z);
          second[j] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
        } else {
          first[j] = _mm256_cvtepu8_epi16(_mm_and_si128(z, low));
          second[j] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(z, 4), low));
        }
      }
      llmrt_kernels::transpose8x8(first);
      llmrt_kernels::transpose8x8(second);
      for (int t = 0; t < 8; ++t) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (t * 2 + v) * 32), first[t]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + ((t + 8) * 2 + v) * 32), second[t]);
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
      __m256 mv;
      if (base == llmrt_kernels::kQ4_1)
        mv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(mh)));
      else
        mv = _mm256_mul_ps(dv, _mm256_set1_ps(base == kQ8_0 ? -128.0f : -8.0f));
      _mm256_storeu_ps(d + 8 * v, dv);
      _mm256_storeu_ps(d + kCols2 + 8 * v, mv);
    }
  }
}

// Rows [r0, r0 + R) of ``a`` (x16 rows) against a packed AVX2 panel into y (row stride ``ldy``).
template <int R>
LLMRT_AVX2 void micro_tile_avx2(const uint8_t* panel, const Levels& a, int64_t r0, float* y,
                                int64_t ldy) {
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  const uint8_t* rows = a.rows + r0 * a.stride;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* o = panel + b * kPanelBlock2;
    const uint8_t* xs = rows + 2 * b * kBlock;
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int s = 0; s < 16; ++s) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + (2 * s) * 32));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + (2 * s + 1) * 32));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xs + r * a.stride + 4 * s, 4);
        const __m256i xv = _mm256_set1_epi32(pair);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xv));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xv));
      }
    }
    const float* d = reinterpret_cast<const float*>(o + 16 * 2 * 32);
    for (int r = 0; r < R; ++r) {
      const float* scales = reinterpret_cast<const float*>(rows + r * a.stride + 2 * a.k);
      const __m256 dx = _mm256_set1_ps(scales[b]);
      const __m256 sx = _mm256_set1_ps(scales[a.nb + b]);
      for (int c = 0; c < 2; ++c) {
        f[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]),
                                  _mm256_mul_ps(_mm256_loadu_ps(d + 8 * c), dx), f[r][c]);
        f[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(d + kCols2 + 8 * c), sx, f[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(y + r * ldy + 8 * c, f[r][c]);
}

// ``micro_tile_avx2`` at the avx_vnni level: vpdpwssd (the 16-bit pairs' products summed
// into the accumulator, AVX-VNNI) in place of vpmaddwd + vpaddd, so each step of a row is one
// instruction per 8 columns instead of two; the same integers (no pair reaches -32768 * -32768)
// and float steps, so the same bits.
template <int R>
LLMRT_AVX_VNNI void micro_tile_avx_vnni(const uint8_t* panel, const Levels& a, int64_t r0,
                                        float* y, int64_t ldy) {
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  const uint8_t* rows = a.rows + r0 * a.stride;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* o = panel + b * kPanelBlock2;
    const uint8_t* xs = rows + 2 * b * kBlock;
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int s = 0; s < 16; ++s) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + (2 * s) * 32));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + (2 * s + 1) * 32));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xs + r * a.stride + 4 * s, 4);
        const __m256i xv = _mm256_set1_epi32(pair);
        acc[r][0] = _mm256_dpwssd_avx_epi32(acc[r][0], w0, xv);
        acc[r][1] = _mm256_dpwssd_avx_epi32(acc[r][1], w1, xv);
      }
    }
    const float* d = reinterpret_cast<const float*>(o + 16 * 2 * 32);
    for (int r = 0; r < R; ++r) {
      const float* scales = reinterpret_cast<const float*>(rows + r * a.stride + 2 * a.k);
      const __m256 dx = _mm256_set1_ps(scales[b]);
      const __m256 sx = _mm256_set1_ps(scales[a.nb + b]);
      for (int c = 0; c < 2; ++c) {
        f[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]),
                                  _mm256_mul_ps(_mm256_loadu_ps(d + 8 * c), dx), f[r][c]);
        f[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(d + kCols2 + 8 * c), sx, f[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(y + r * ldy + 8 * c, f[r][c]);
}

void run_tile_avx2(int64_t rows, const uint8_t* panel, const Levels& a, int64_t r0, float* y,
                   int64_t ldy) {
  if (llmrt_kernels::has_avx_vnni()) {
    switch (rows) {
      case 4: micro_tile_avx_vnni<4>(panel, a, r0, y, ldy); break;
      case 3: micro_tile_avx_vnni<3>(panel, a, r0, y, ldy); break;
      case 2: micro_tile_avx_vnni<2>(panel, a, r0, y, ldy); break;
      default: micro_tile_avx_vnni<1>(panel, a, r0, y, ldy); break;
    }
    return;
  }
  switch (rows) {
    case 4: micro_tile_avx2<4>(panel, a, r0, y, ldy); break;
    case 3: micro_tile_avx2<3>(panel, a, r0, y, ldy); break;
    case 2: micro_tile_avx2<2>(panel, a, r0, y, ldy); break;
    default: micro_tile_avx2<1>(panel, a, r0, y, ldy); break;
  }
}
static_assert(kRows2 == 4, "run_tile_avx2's cases cover 1..kRows2");

// ``panels_range`` for the AVX2 panels.
void panels_range_avx2(const Levels& a, int64_t rows, const uint8_t* w, int64_t row_bytes,
                       int64_t base, float* y, int64_t n, int64_t n0, int64_t n1,
                       uint8_t* panel) {
  alignas(64) float edge[kRows2 * kCols2];
  for (int64_t c0 = n0; c0 < n1; c0 += kCols2) {
    const int64_t cols = std::min<int64_t>(kCols2, n1 - c0);
    pack_panel_avx2(w, row_bytes, base, a.nb, c0, cols, panel);
    for (int64_t r = 0; r < rows; r += kRows2) {
      const int64_t tile = std::min<int64_t>(kRows2, rows - r);
      if (cols == kCols2) {
        run_tile_avx2(tile, panel, a, r, y + r * n + c0, n);
      } else {
        run_tile_avx2(tile, panel, a, r, edge, kCols2);
        for (int64_t i = 0; i < tile; ++i)
          std::memcpy(y + (r + i) * n + c0, edge + i * kCols2, cols * sizeof(float));
      }
    }
  }
}

// This thread's panel buffer, at least ``bytes`` long.
uint8_t* panel_buffer(int64_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < bytes) buffer.resize(static_cast<size_t>(bytes));
  return buffer.data();
}

#endif  // LLMRT_X86

}  // namespace

namespace llmrt_kernels {

bool takes_integer_gemm(int64_t kind, int64_t rows) {
  if (!(kind & kInterleaved)) return false;
  if (has_avx512_vnni()) return rows >= kInterleavedGemmMinRows;
  return has_avx2() && rows >= kInterleavedGemmMinRowsAvx2;
}

int64_t interleaved_gemm_prep_bytes(int64_t k) { return levels_stride(k); }

// Only where ``takes_integer_gemm`` said so (AVX-512 VNNI, or AVX2): elsewhere there is no
// kernel.
#if defined(LLMRT_X86)
void interleaved_gemm_prepare(const float* x, int64_t r0, int64_t r1, int64_t k, uint8_t* prep) {
  if (has_avx512_vnni())
    prepare_rows(x, r0, r1, k, prep);
  else
    prepare_rows_avx2(x, r0, r1, k, prep);
}

void interleaved_gemm_range(const uint8_t* prep, int64_t rows, const uint8_t* w,
                            int64_t row_bytes, int64_t base, int64_t k, float* y, int64_t n,
                            int64_t n0, int64_t n1) {
  if (rows <= 0 || n0 >= n1) return;
  const Levels a{prep, levels_stride(k), k, k / kBlock};
  if (has_avx512_vnni())
    panels_range(a, rows, w, row_bytes, base, y, n, n0, n1, panel_buffer(a.nb * kPanelBlock));
  else
    panels_range_avx2(a, rows, w, row_bytes, base, y, n, n0, n1,
                      panel_buffer(a.nb * kPanelBlock2));
}

void interleaved_gemm(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes,
                      int64_t base, int64_t k, float* y, int64_t n) {
  if (rows_m <= 0 || n <= 0) return;
  const bool vnni = has_avx512_vnni();
  const int64_t stride = levels_stride(k);
  const int64_t chunk = std::max<int64_t>(kRows, kChunkBytes / stride / kRows * kRows);
  // The caller's scratch (a thread_local named inside a lambda would be each worker's own).
  thread_local std::vector<uint8_t> levels;
  levels.resize(static_cast<size_t>(std::min(rows_m, chunk) * stride));
  const int64_t cols = vnni ? kCols : kCols2;
  const int64_t panels = (n + cols - 1) / cols;
  const int64_t panel_bytes = (k / kBlock) * (vnni ? kPanelBlock : kPanelBlock2);
  for (int64_t c0 = 0; c0 < rows_m; c0 += chunk) {
    const int64_t rows = std::min(chunk, rows_m - c0);
    const float* xc = x + c0 * k;
    uint8_t* prep = levels.data();
    llmrt_kernels::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      interleaved_gemm_prepare(xc, r0, r1, k, prep);
    });
    const Levels a{prep, stride, k, k / kBlock};
    float* yc = y + c0 * n;
    // Panels from a shared counter: a core that runs slower (another tenant's time slice)
    // takes fewer instead of holding the other at the end.
    std::atomic<int64_t> next{0};
    llmrt_kernels::parallel_for(0, panels, 1, [&](int64_t, int64_t) {
      uint8_t* panel = panel_buffer(panel_bytes);
      for (int64_t p = next.fetch_add(1); p < panels; p = next.fetch_add(1)) {
        const int64_t p0 = p * cols, p1 = std::min(n, (p + 1) * cols);
        if (vnni)
          panels_range(a, rows, w, row_bytes, base, yc, n, p0, p1, panel);
        else
          panels_range_avx2(a, rows, w, row_bytes, base, yc, n, p0, p1, panel);
      }
    });
  }
}

#else
void interleaved_gemm_prepare(const float*, int64_t, int64_t, int64_t, uint8_t*) {
  TORCH_CHECK(false, "llmrt_kernels: the integer GEMM needs AVX2 or AVX-512 VNNI");
}
void interleaved_gemm_range(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                            float*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "llmrt_kernels: the integer GEMM needs AVX2 or AVX-512 VNNI");
}
void interleaved_gemm(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                      int64_t) {
  TORCH_CHECK(false, "llmrt_kernels: the integer GEMM needs AVX2 or AVX-512 VNNI");
}
#endif  // LLMRT_X86

}  // namespace llmrt_kernels
