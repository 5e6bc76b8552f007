// Many activation rows against a K-quant weight (Q4_K, Q5_K, Q6_K in ggml's blocks), and at
// AVX2 below VNNI against interleaved Q4_0 / Q4_1 from 128 rows and 1024 output columns
// (kquant_blocks.h says why; narrower ones take interleaved_gemm.cpp): an integer GEMM (AVX2
// vpmaddubsw / vpmaddwd; AVX-512 VNNI vpdpbusd on 256-bit vectors, 6-row tiles).
//
// Why: without it a prefill-sized call dequantized the whole weight to float32 (8 bytes
// written and read per weight, the K-quant unpack in portable loops) and ran MKL's sgemm.
// Here the weight's blocks are unpacked once per call, a panel of 8 output columns at a time,
// into unsigned bytes ordered [32-weight group][k/4 step][column][4 k] with the group's
// float scales beside them, and every activation row multiplies the panel from cache.
//
// Numerics are the decode kernels' per-32 groups (kquants.cpp's kquant_prepare_groups; its
// AVX2 GEMVs share a scale per 256 values instead): activations prepared once per row as two
// int8 levels sharing one scale per 32 values (x ~ d / 256 * (256 h + l)), so
// sum(w * x) = a * d / 256 * (256 (q . h) + (q . l)) - b * c per 16-weight half, with the
// weights' quants q, scales a and offsets b (w = a * q - b), and c the activation sums.
//
// The product loop: one 32-byte weight vector holds 8 columns' four consecutive quants; each
// activation row's four int8s (per level) are broadcast into a vpmaddubsw per step. The int16
// pair sums add up in int16 over as many steps as cannot overflow (|h|, |l| <= 127: Q4_K
// q <= 15, 8 steps <= 30480; Q5_K q <= 31, 4 steps; Q6_K q <= 63, 2 steps), then one vpmaddwd
// widens them, so most steps cost two vpmaddubsw and two vpaddw per row.
//
// Not a load-time repack: the panels are rebuilt per call (an AVX2 unpack and 8x8 dword
// transpose, ~1 instruction per 8 weights, paid once per call and shared by every row), so
// the blocks stay the only resident copy and decode keeps its block-direct kernels.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "cpu.h"
#include "interleaved_layout.h"  // LLMRT_VNNI
#include "kquant_blocks.h"
#include "kquant_panel.h"
#include "linear.h"

namespace {

using llmrt_kernels::kInterleaved;
using llmrt_kernels::kQ4_0;
using llmrt_kernels::kQ4_1;
using llmrt_kernels::kQ4_K;
using llmrt_kernels::kQ5_K;
using llmrt_kernels::kQ6_K;
using llmrt_kernels::kQK;
#if defined(LLMRT_X86)
using llmrt_kernels::group_avx2;
using llmrt_kernels::store_steps;
#endif

// Output columns per panel (one vector of eight int32 / float lanes).
constexpr int kCols = 8;
// A panel's bytes per 32-weight group: 8 steps of 32 bytes (column c's quants 4s..4s+3 at
// 4c), then the float a[2][8] and b[2][8] per 16-weight half and column.
[[maybe_unused]] constexpr int64_t kGroupBytes = 8 * 32 + 4 * kCols * 4;
// Activation rows per micro tile (accumulators in registers): AVX2 has 16 vector registers,
// AVX-512 32.
[[maybe_unused]] constexpr int kRows = 4;
[[maybe_unused]] constexpr int kRowsVnni = 6;
// A pack block's panels stay in L2 while every row tile passes over them.
[[maybe_unused]] constexpr int64_t kPackBytes = 256 << 10;

// kquants.cpp's prepared activation group (kquant_prepare): two int8 levels of 32 values,
// their scales d[0] = d, d[1] = d / 256, and the sums c[h] per 16-value half.
struct PGroup {
  int8_t q[2][32];
  float d[2];
  float c[2];
};
static_assert(sizeof(PGroup) == 80, "kquants.cpp's PGroup");

#if defined(LLMRT_X86)
// Weight rows [n0, n0 + cols) (cols <= kCols; the rest of the panel is zero) packed into
// ``out`` (k / 32 * kGroupBytes bytes): per group, the eight columns' 32 quants (eight dwords
// each) become the group's eight steps by an 8x8 dword transpose in registers; the scales
// come per block and column from kquant_unpack_scales.
template <int64_t KIND>
LLMRT_AVX2 void pack_panel_avx2(const uint8_t* w, int64_t rb, int64_t k, int64_t n0,
                                int64_t cols, uint8_t* out) {
  constexpr int64_t bb = llmrt_kernels::kquant_block_bytes(KIND);
  const int64_t nb = k / kQK;
  alignas(32) static const uint8_t zero_block[bb] = {};
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* src[kCols];
    for (int c = 0; c < kCols; ++c) src[c] = c < cols ? w + (n0 + c) * rb + blk * bb : zero_block;
    for (int gi = 0; gi < 8; ++gi) {
      __m256i v[kCols];
      for (int c = 0; c < kCols; ++c) v[c] = group_avx2<KIND>(src[c], gi);
      store_steps(v, out + (blk * 8 + gi) * kGroupBytes);
    }
    float a[16], b[16];
    for (int64_t c = 0; c < kCols; ++c) {
      if (c < cols) {
        llmrt_kernels::kquant_unpack_scales(src[c], KIND, a, b);
      } else {
        std::fill(a, a + 16, 0.0f);
        std::fill(b, b + 16, 0.0f);
      }
      for (int gi = 0; gi < 8; ++gi) {
        float* f = reinterpret_cast<float*>(out + (blk * 8 + gi) * kGroupBytes + 256);
        f[c] = a[2 * gi];
        f[kCols + c] = a[2 * gi + 1];
        f[2 * kCols + c] = b[2 * gi];
        f[3 * kCols + c] = b[2 * gi + 1];
      }
    }
  }
}

// pack_panel_avx2 for Q4_0 / Q4_1 in the interleaved layout (interleaved_layout.h): each
// 32-weight block is one group, its nibbles split into bytes (low: weights 0-15, high:
// 16-31), a = d and b = -m for both halves (Q4_0: m = -8 d).
template <int64_t BASE>
LLMRT_AVX2 void pack_panel_q4_avx2(const uint8_t* w, int64_t rb, int64_t k, int64_t n0,
                                   int64_t cols, uint8_t* out) {
  const int64_t nb = k / 32;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nb; ++blk) {
    __m256i v[kCols];
    float a[kCols], b[kCols];
    for (int c = 0; c < kCols; ++c) {
      if (c >= cols) {
        v[c] = _mm256_setzero_si256();
        a[c] = b[c] = 0.0f;
        continue;
      }
      const llmrt_kernels::BlockRef ref = llmrt_kernels::block_at(w + (n0 + c) * rb, BASE, nb, blk);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ref.q));
      v[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
      a[c] = ref.d;
      b[c] = -ref.m;
    }
    uint8_t* o = out + blk * kGroupBytes;
    store_steps(v, o);
    float* f = reinterpret_cast<float*>(o + 256);
    for (int c = 0; c < kCols; ++c) {
      f[c] = f[kCols + c] = a[c];
      f[2 * kCols + c] = f[3 * kCols + c] = b[c];
    }
  }
}

LLMRT_AVX2 inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [0, RT) of prepared x (``px``, ``groups`` per row) against one packed panel, into
// y[r * ldy + 0 .. cols).
template <int64_t KIND, int RT>
LLMRT_AVX2 void tile_avx2(const PGroup* px, int64_t groups, const uint8_t* panel, float* y,
                          int64_t ldy, int64_t cols) {
  // Steps summed in int16 before widening, and steps per scale (16 weights for Q6_K).
  constexpr int kSteps16 = KIND == kQ4_K ? 8 : (KIND == kQ5_K ? 4 : 2);
  constexpr int kHalves = KIND == kQ6_K ? 2 : 1;
  constexpr int kStepsPerScale = 8 / kHalves;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* o = panel + g * kGroupBytes;
    const float* f = reinterpret_cast<const float*>(o + 256);
    for (int half = 0; half < kHalves; ++half) {
      __m256i iv[RT];
      for (int r = 0; r < RT; ++r) iv[r] = _mm256_setzero_si256();
      for (int s0 = half * kStepsPerScale; s0 < (half + 1) * kStepsPerScale; s0 += kSteps16) {
        // One level at a time (the weight vectors reload from L1): fewer live registers than
        // both levels' int16 sums, which spilled.
#pragma GCC unroll 1
        for (int lev = 0; lev < 2; ++lev) {
          __m256i t[RT];
          for (int r = 0; r < RT; ++r) t[r] = _mm256_setzero_si256();
          for (int s = s0; s < s0 + kSteps16; ++s) {
            const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(o + 32 * s));
            for (int r = 0; r < RT; ++r) {
              t[r] = _mm256_add_epi16(
                  t[r], _mm256_maddubs_epi16(wv, bcast4(px[r * groups + g].q[lev] + 4 * s)));
              // Keep the sum a chain: gcc otherwise computes every step's products first and
              // spills them (about half the loop's instructions were stack moves).
              asm("" : "+x"(t[r]));
            }
          }
          // 256 h + l: the widening vpmaddwd multiplies the high level's pairs by 256 (one
          // instruction where a shift after it took two).
          const __m256i weight = lev == 0 ? _mm256_set1_epi16(256) : ones;
          for (int r = 0; r < RT; ++r)
            iv[r] = _mm256_add_epi32(iv[r], _mm256_madd_epi16(t[r], weight));
        }
      }
      const __m256 av = _mm256_loadu_ps(f + kCols * half);
      const __m256 bv = _mm256_loadu_ps(f + 2 * kCols + kCols * half);
      for (int r = 0; r < RT; ++r) {
        const PGroup& p = px[r * groups + g];
        const float c = kHalves == 2 ? p.c[half] : p.c[0] + p.c[1];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv[r]),
                                 _mm256_mul_ps(av, _mm256_set1_ps(p.d[1])), acc[r]);
        acc[r] = _mm256_fnmadd_ps(bv, _mm256_set1_ps(c), acc[r]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) {
    if (cols == kCols) {
      _mm256_storeu_ps(y + r * ldy, acc[r]);
    } else {
      alignas(32) float t[kCols];
      _mm256_store_ps(t, acc[r]);
      std::memcpy(y + r * ldy, t, static_cast<size_t>(cols) * 4);
    }
  }
}

template <int64_t KIND>
LLMRT_AVX2 void rows_avx2(const PGroup* px, int64_t rows, int64_t groups, const uint8_t* panel,
                          float* y, int64_t ldy, int64_t cols) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    tile_avx2<KIND, kRows>(px + r * groups, groups, panel, y + r * ldy, ldy, cols);
  switch (rows - r) {
    case 3: tile_avx2<KIND, 3>(px + r * groups, groups, panel, y + r * ldy, ldy, cols); break;
    case 2: tile_avx2<KIND, 2>(px + r * groups, groups, panel, y + r * ldy, ldy, cols); break;
    case 1: tile_avx2<KIND, 1>(px + r * groups, groups, panel, y + r * ldy, ldy, cols); break;
    default: break;
  }
}

// tile_avx2 with AVX-512 VNNI's vpdpbusd on 256-bit vectors: the u8 x s8 products of a
// step sum straight into int32 (no int16 stage, no widening), and the 32 vector registers hold
// taller tiles.
template <int64_t KIND, int RT>
LLMRT_VNNI void tile_vnni(const PGroup* px, int64_t groups, const uint8_t* panel, float* y,
                          int64_t ldy, int64_t cols) {
  constexpr int kHalves = KIND == kQ6_K ? 2 : 1;
  constexpr int kStepsPerScale = 8 / kHalves;
  __m256 acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* o = panel + g * kGroupBytes;
    const float* f = reinterpret_cast<const float*>(o + 256);
    for (int half = 0; half < kHalves; ++half) {
      __m256i th[RT], tl[RT];
      for (int r = 0; r < RT; ++r) th[r] = tl[r] = _mm256_setzero_si256();
      for (int s = half * kStepsPerScale; s < (half + 1) * kStepsPerScale; ++s) {
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(o + 32 * s));
        for (int r = 0; r < RT; ++r) {
          const PGroup& p = px[r * groups + g];
          th[r] = _mm256_dpbusd_epi32(th[r], wv, bcast4(p.q[0] + 4 * s));
          tl[r] = _mm256_dpbusd_epi32(tl[r], wv, bcast4(p.q[1] + 4 * s));
        }
      }
      const __m256 av = _mm256_loadu_ps(f + kCols * half);
      const __m256 bv = _mm256_loadu_ps(f + 2 * kCols + kCols * half);
      for (int r = 0; r < RT; ++r) {
        const PGroup& p = px[r * groups + g];
        const float c = kHalves == 2 ? p.c[half] : p.c[0] + p.c[1];
        const __m256i iv = _mm256_add_epi32(_mm256_slli_epi32(th[r], 8), tl[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv),
                                 _mm256_mul_ps(av, _mm256_set1_ps(p.d[1])), acc[r]);
        acc[r] = _mm256_fnmadd_ps(bv, _mm256_set1_ps(c), acc[r]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) {
    if (cols == kCols) {
      _mm256_storeu_ps(y + r * ldy, acc[r]);
    } else {
      alignas(32) float t[kCols];
      _mm256_store_ps(t, acc[r]);
      std::memcpy(y + r * ldy, t, static_cast<size_t>(cols) * 4);
    }
  }
}

template <int64_t KIND>
LLMRT_VNNI void rows_vnni(const PGroup* px, int64_t rows, int64_t groups, const uint8_t* panel,
                          float* y, int64_t ldy, int64_t cols) {
  int64_t r = 0;
  for (; r + kRowsVnni <= rows; r += kRowsVnni)
    tile_vnni<KIND, kRowsVnni>(px + r * groups, groups, panel, y + r * ldy, ldy, cols);
  const PGroup* pr = px + r * groups;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 5: tile_vnni<KIND, 5>(pr, groups, panel, yr, ldy, cols); break;
    case 4: tile_vnni<KIND, 4>(pr, groups, panel, yr, ldy, cols); break;
    case 3: tile_vnni<KIND, 3>(pr, groups, panel, yr, ldy, cols); break;
    case 2: tile_vnni<KIND, 2>(pr, groups, panel, yr, ldy, cols); break;
    case 1: tile_vnni<KIND, 1>(pr, groups, panel, yr, ldy, cols); break;
    default: break;
  }
}

void pack_kind(const uint8_t* w, int64_t rb, int64_t kind, int64_t k, int64_t n0, int64_t cols,
               uint8_t* out) {
  switch (kind) {
    case kQ4_0 | kInterleaved: pack_panel_q4_avx2<kQ4_0>(w, rb, k, n0, cols, out); break;
    case kQ4_1 | kInterleaved: pack_panel_q4_avx2<kQ4_1>(w, rb, k, n0, cols, out); break;
    case kQ4_K: pack_panel_avx2<kQ4_K>(w, rb, k, n0, cols, out); break;
    case kQ5_K: pack_panel_avx2<kQ5_K>(w, rb, k, n0, cols, out); break;
    default: pack_panel_avx2<kQ6_K>(w, rb, k, n0, cols, out); break;
  }
}

void rows_kind(const PGroup* px, int64_t rows, int64_t groups, const uint8_t* panel, float* y,
               int64_t ldy, int64_t cols, int64_t kind) {
  if (llmrt_kernels::has_avx512_vnni()) {
    switch (kind) {
      case kQ4_K: rows_vnni<kQ4_K>(px, rows, groups, panel, y, ldy, cols); break;
      case kQ5_K: rows_vnni<kQ5_K>(px, rows, groups, panel, y, ldy, cols); break;
      default: rows_vnni<kQ6_K>(px, rows, groups, panel, y, ldy, cols); break;
    }
    return;
  }
  switch (kind) {
    case kQ4_0 | kInterleaved:  // 4-bit quants, one scale per 32: the Q4_K loop
    case kQ4_1 | kInterleaved:
    case kQ4_K: rows_avx2<kQ4_K>(px, rows, groups, panel, y, ldy, cols); break;
    case kQ5_K: rows_avx2<kQ5_K>(px, rows, groups, panel, y, ldy, cols); break;
    default: rows_avx2<kQ6_K>(px, rows, groups, panel, y, ldy, cols); break;
  }
}
#endif  // LLMRT_X86

}  // namespace

namespace llmrt_kernels {

int64_t kquant_gemm_max_rows(int64_t kind) {
  if (kind == (kQ4_0 | kInterleaved) || kind == (kQ4_1 | kInterleaved))
    return has_avx2() && !has_avx512_vnni() ? INT64_MAX : 0;
  if (kind != kQ4_K && kind != kQ5_K && kind != kQ6_K) return 0;
  if (has_avx512_vnni()) return kKquantGemmMaxRowsVnni;
  return has_avx2() ? INT64_MAX : 0;
}

int64_t kquant_gemm_min_rows(int64_t kind) {
  return (kind & kInterleaved) ? kQ4GemmMinRowsAvx2 : kKquantGemmMinRows;
}

bool takes_kquant_gemm(int64_t kind, int64_t rows, int64_t n, int64_t k) {
  if (kind & kInterleaved) {  // narrower / shallower ones run interleaved_gemm.cpp's loop
    const bool panels = has_avx_vnni() ? n >= kQ4GemmMinColsAvxVnni || k >= kQ4GemmMinDepthAvxVnni
                                       : n >= kQ4GemmMinColsAvx2;
    if (!panels) return false;
  }  // interleaved_gemm.cpp's
  return rows >= kquant_gemm_min_rows(kind) && rows <= kquant_gemm_max_rows(kind);
}

void kquant_gemm(const float* x, int64_t rows, const uint8_t* w, int64_t rb, int64_t kind,
                 int64_t k, float* y, int64_t n) {
#if defined(LLMRT_X86)
  TORCH_CHECK(kquant_gemm_max_rows(kind) > 0, "llmrt_kernels: no K-quant GEMM for type ", kind);
  const int64_t groups = k / 32;
  std::vector<uint8_t> prep(static_cast<size_t>(rows * groups) * sizeof(PGroup));
  llmrt_kernels::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    kquant_prepare_groups(x, r0, r1, k, prep.data());
  });
  const PGroup* px = reinterpret_cast<const PGroup*>(prep.data());
  const int64_t panels = (n + kCols - 1) / kCols, panel_bytes = groups * kGroupBytes;
  const int64_t per_block = std::clamp<int64_t>(kPackBytes / panel_bytes, 1, 16);
  const int64_t blocks = (panels + per_block - 1) / per_block;
  const int64_t tile_rows = has_avx512_vnni() ? kRowsVnni : kRows;
  // Pack blocks from a shared counter (as interleaved_gemm.cpp's panels): a core that runs
  // slower (another tenant's time slice) takes fewer instead of holding the other at the end.
  std::atomic<int64_t> next{0};
  llmrt_kernels::parallel_for(0, blocks, 1, [&](int64_t, int64_t) {
    std::vector<uint8_t> raw(
        static_cast<size_t>(per_block * panel_bytes + 32));
    uint8_t* packed = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(raw.data()) + 31) & ~static_cast<uintptr_t>(31));
    for (int64_t blk = next.fetch_add(1); blk < blocks; blk = next.fetch_add(1)) {
      const int64_t p0 = blk * per_block, p1 = std::min(panels, p0 + per_block);
      for (int64_t p = p0; p < p1; ++p)
        pack_kind(w, rb, kind, k, p * kCols, std::min<int64_t>(kCols, n - p * kCols),
                  packed + (p - p0) * panel_bytes);
      for (int64_t r = 0; r < rows; r += tile_rows) {
        const int64_t rt = std::min<int64_t>(tile_rows, rows - r);
        for (int64_t p = p0; p < p1; ++p)
          rows_kind(px + r * groups, rt, groups, packed + (p - p0) * panel_bytes, y + r * n + p * kCols,
                    n, std::min<int64_t>(kCols, n - p * kCols), kind);
      }
    }
  });
#else
  (void)x, (void)rows, (void)w, (void)rb, (void)kind, (void)k, (void)y, (void)n;
  TORCH_CHECK(false, "llmrt_kernels: the K-quant GEMM needs x86 AVX2");
#endif
}

}  // namespace llmrt_kernels

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("kquant_gemm_max_rows(int kind) -> int", &llmrt_kernels::kquant_gemm_max_rows);
}
