// Many activation rows against an interleaved block weight: an integer GEMM (AVX-512 VNNI).
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

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "blocks.h"
#include "interleaved_layout.h"
#include "linear.h"

namespace {

using llmrt_kernels::block_at;
using llmrt_kernels::kBlock;
using llmrt_kernels::kQ8_0;

// Output columns per panel (two 16-lane vectors) and activation rows per micro tile: 6 x 2
// tiles hold 24 accumulators (12 integer, 12 float) and measured as fast as 5 x 2 and ahead of
// 4 x 2, 4 x 3, 3 x 3, 8 x 1 (41-13% more time) on SmolLM2's shapes.
constexpr int kVecs = 2;
constexpr int kCols = 16 * kVecs;
constexpr int kRows = 6;
// A panel's bytes per block: 8 steps of kVecs 64-byte vectors, then d[kCols] and m[kCols].
constexpr int64_t kPanelBlock = 8 * kVecs * 64 + 2 * kCols * 4;
// Prepared activation bytes (both levels) a row chunk keeps under, so the chunk stays in L2
// while each panel passes over it (SmolLM2's MLP down projection at 2048 rows: 100 against
// 165 GMAC/s at 512).
constexpr int64_t kChunkBytes = 768 << 10;

// A call's activation rows, two levels in natural order: ``h``/``l`` [rows, k] int8, ``scale``
// [rows, nb] dx / 256 and ``sum`` [rows, nb] the block's sum of x as the levels represent it.
struct Levels {
  const int8_t* h;
  const int8_t* l;
  const float* scale;
  const float* sum;
  int64_t k, nb;
};

LLMRT_VNNI void prepare_rows(const float* x, int64_t r0, int64_t r1, int64_t k, int8_t* h,
                             int8_t* l, float* scale, float* sum) {
  const int64_t nb = k / kBlock;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = r * k + b * kBlock;
      const llmrt_kernels::TwoLevel two =
          llmrt_kernels::two_level_block(x + at, h + at, l + at, h + at + 16, l + at + 16);
      scale[r * nb + b] = two.dx / 256.0f;
      sum[r * nb + b] =
          two.dx * (static_cast<float>(two.sum_h) + static_cast<float>(two.sum_l) / 256.0f);
    }
}

// Weight rows [n0, n0 + cols) (cols <= kCols; the rest of the panel is zero) unpacked into
// ``out`` (nb * kPanelBlock bytes).
LLMRT_VNNI void pack_panel(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t nb,
                           int64_t n0, int64_t cols, uint8_t* out) {
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = out + b * kPanelBlock;
    uint32_t* q = reinterpret_cast<uint32_t*>(o);
    float* d = reinterpret_cast<float*>(o + 8 * kVecs * 64);
    float* m = d + kCols;
    for (int64_t j = 0; j < kCols; ++j) {
      alignas(32) uint32_t steps[8] = {};
      float dj = 0.0f, mj = 0.0f;
      if (j < cols) {
        const llmrt_kernels::BlockRef ref = block_at(w + (n0 + j) * row_bytes, base, nb, b);
        if (base == kQ8_0) {
          std::memcpy(steps, ref.q, 32);
          dj = ref.d;
          mj = -128.0f * ref.d;
        } else {
          const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ref.q));
          _mm_store_si128(reinterpret_cast<__m128i*>(steps), _mm_and_si128(z, low));
          _mm_store_si128(reinterpret_cast<__m128i*>(steps + 4),
                          _mm_and_si128(_mm_srli_epi16(z, 4), low));
          dj = ref.d;
          mj = ref.m;
        }
      }
      for (int s = 0; s < 8; ++s) q[s * kCols + j] = steps[s];
      d[j] = dj;
      m[j] = mj;
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
      const int8_t* xs = (level == 0 ? a.h : a.l) + r0 * a.k + b * kBlock;
      if (level == 1)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_slli_epi32(acc[r][c], 8);
      for (int s = 0; s < 8; ++s) {
        __m512i wv[kVecs];
        for (int c = 0; c < kVecs; ++c) wv[c] = _mm512_loadu_si512(o + (s * kVecs + c) * 64);
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xs + r * a.k + 4 * s, 4);
          const __m512i xv = _mm512_set1_epi32(four);
          for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xv);
        }
      }
    }
    const float* d = reinterpret_cast<const float*>(o + 8 * kVecs * 64);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(a.scale[(r0 + r) * a.nb + b]);
      const __m512 sx = _mm512_set1_ps(a.sum[(r0 + r) * a.nb + b]);
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

}  // namespace

namespace llmrt_kernels {

bool interleaved_gemm(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes,
                      int64_t base, int64_t k, float* y, int64_t n) {
  if (!has_vnni()) return false;
  if (rows_m <= 0 || n <= 0) return true;
  const int64_t nb = k / kBlock;
  const int64_t chunk =
      std::max<int64_t>(kRows, kChunkBytes / (2 * k) / kRows * kRows);
  const int64_t prep_rows = std::min(rows_m, chunk);
  // The caller's scratch (a thread_local named inside a lambda would be each worker's own).
  thread_local std::vector<int8_t> levels;
  thread_local std::vector<float> scales;
  levels.resize(static_cast<size_t>(2 * prep_rows * k));
  scales.resize(static_cast<size_t>(2 * prep_rows * nb));
  const int64_t panels = (n + kCols - 1) / kCols;
  for (int64_t c0 = 0; c0 < rows_m; c0 += chunk) {
    const int64_t rows = std::min(chunk, rows_m - c0);
    int8_t* h = levels.data();
    int8_t* l = h + rows * k;
    float* scale = scales.data();
    float* sum = scale + rows * nb;
    const float* xc = x + c0 * k;
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      prepare_rows(xc, r0, r1, k, h, l, scale, sum);
    });
    const Levels a{h, l, scale, sum, k, nb};
    float* yc = y + c0 * n;
    // Panels from a shared counter: a core that runs slower (another tenant's time slice)
    // takes fewer instead of holding the other at the end.
    std::atomic<int64_t> next{0};
    at::parallel_for(0, panels, 1, [&](int64_t, int64_t) {
      std::vector<uint8_t> panel(static_cast<size_t>(nb * kPanelBlock));
      alignas(64) float edge[kRows * kCols];
      for (int64_t p = next.fetch_add(1); p < panels; p = next.fetch_add(1)) {
        const int64_t n0 = p * kCols, cols = std::min<int64_t>(kCols, n - n0);
        pack_panel(w, row_bytes, base, nb, n0, cols, panel.data());
        for (int64_t r = 0; r < rows; r += kRows) {
          const int64_t tile = std::min<int64_t>(kRows, rows - r);
          if (cols == kCols) {
            run_tile(tile, panel.data(), a, r, yc + r * n + n0, n);
          } else {
            run_tile(tile, panel.data(), a, r, edge, kCols);
            for (int64_t i = 0; i < tile; ++i)
              std::memcpy(yc + (r + i) * n + n0, edge + i * kCols, cols * sizeof(float));
          }
        }
      }
    });
  }
  return true;
}

}  // namespace llmrt_kernels
