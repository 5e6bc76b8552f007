// GGUF block-quantized linear layers for CPU: y = x W^T (+ b) straight from Q4_0 / Q4_1 / Q8_0
// blocks, dequantized in registers (float32 activations, float32 accumulation), and a
// dequantize op for large-M matmuls and embedding rows.
//
// Block layouts (32 weights per block, ggml's definitions):
//   Q4_0 (type 2): fp16 d, 16 bytes qs; w[j] = d * ((qs[j] & 15) - 8), w[j+16] = d * ((qs[j] >> 4) - 8)
//   Q4_1 (type 3): fp16 d, fp16 m, 16 bytes qs; w[j] = d * (qs[j] & 15) + m, w[j+16] = d * (qs[j] >> 4) + m
//   Q8_0 (type 8): fp16 d, 32 int8 qs; w[j] = d * qs[j]
// A weight of shape [N, K] is N rows of K/32 consecutive blocks.
//
// The AVX-512 kernels are compiled with per-function target attributes and picked at run time;
// the portable loops serve CPUs without AVX-512.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "blocks.h"
#include "cpu.h"
#include "kquant_blocks.h"
#include "prefetch.h"
#include "linear.h"
#include "tiles.h"
#include "vecmath.h"

namespace {

using llmrt_kernels::has_avx512;

using llmrt_kernels::block_bytes_of;
using llmrt_kernels::half_at;
#if defined(LLMRT_X86)
using llmrt_kernels::half_f16c;
#endif
using llmrt_kernels::kBlock;
using llmrt_kernels::kQ4_0;
using llmrt_kernels::kQ4_1;
using llmrt_kernels::kQ8_0;

int64_t block_bytes(int64_t kind) {
  const int64_t base = kind & ~llmrt_kernels::kInterleaved;
  TORCH_CHECK(base == kQ4_0 || base == kQ4_1 || base == kQ8_0,
              "llmrt_kernels: unsupported GGUF block type ", kind);
  return block_bytes_of(base);
}

// ---- portable reference loops ------------------------------------------------------------

template <int64_t KIND>
inline void dequant_block_scalar(const uint8_t* blk, float* out) {
  const float d = half_at(blk);
  if constexpr (KIND == kQ8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(qs[j]);
  } else {
    const float m = KIND == kQ4_1 ? half_at(blk + 2) : -8.0f * d;
    const uint8_t* qs = blk + (KIND == kQ4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(qs[j] & 15) + m;
      out[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
}

template <int64_t KIND>
void linear_rows_scalar(const float* x, int64_t ldx, int64_t rows_m, const uint8_t* w,
                        int64_t row_bytes, int64_t k, float* y, int64_t ldy, int64_t n0,
                        int64_t n1) {
  constexpr int64_t bb = block_bytes_of(KIND);
  float tmp[32];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t r = 0; r < rows_m; ++r) y[r * ldy + n] = 0.0f;
    for (int64_t b = 0; b < k / kBlock; ++b) {
      dequant_block_scalar<KIND>(row + b * bb, tmp);
      for (int64_t r = 0; r < rows_m; ++r) {
        const float* xr = x + r * ldx + b * kBlock;
        float s = 0.0f;
        for (int j = 0; j < 32; ++j) s += tmp[j] * xr[j];
        y[r * ldy + n] += s;
      }
    }
  }
}

#if defined(LLMRT_X86)
// ---- AVX-512 -----------------------------------------------------------------------------

// The block's 32 weights as two float32 vectors (elements 0-15 and 16-31).
// 4-bit blocks build the block's 16 possible values (d * q + m for q = 0..15, one FMA) and
// look each nibble up with a permute, which reads only the index's low 4 bits: no masking,
// no int-to-float conversion, and the values are exactly d * q + m rounded once.
template <int64_t KIND>
LLMRT_AVX512 inline void dequant_block_avx512(const uint8_t* blk, __m512& w0, __m512& w1) {
  const __m512 vd = _mm512_set1_ps(half_f16c(blk));
  if constexpr (KIND == kQ8_0) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), vd);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), vd);
  } else {
    __m512 vm;
    const uint8_t* qs;
    if constexpr (KIND == kQ4_1) {
      vm = _mm512_set1_ps(half_f16c(blk + 2));
      qs = blk + 4;
    } else {
      vm = _mm512_mul_ps(vd, _mm512_set1_ps(-8.0f));
      qs = blk + 2;
    }
    const __m512 levels =
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(levels, vd, vm);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), table);
    w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(q, 4)), table);
  }
}

// One activation row: four accumulators over pairs of blocks hide the FMA latency.
template <int64_t KIND>
LLMRT_AVX512 void linear_rows_m1_avx512(const float* x, const uint8_t* w, int64_t row_bytes,
                                        int64_t k, float* y, int64_t n0, int64_t n1) {
  constexpr int64_t bb = block_bytes_of(KIND);
  const int64_t nb = k / kBlock;
  llmrt_kernels::AheadPrefetch ahead(w + n0 * row_bytes, w + n1 * row_bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    ahead.upto(row + row_bytes);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
      __m512 w0, w1, w2, w3;
      dequant_block_avx512<KIND>(row + b * bb, w0, w1);
      dequant_block_avx512<KIND>(row + (b + 1) * bb, w2, w3);
      const float* xb = x + b * kBlock;
      a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), a0);
      a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), a1);
      a2 = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xb + 32), a2);
      a3 = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xb + 48), a3);
    }
    if (b < nb) {
      __m512 w0, w1;
      dequant_block_avx512<KIND>(row + b * bb, w0, w1);
      const float* xb = x + b * kBlock;
      a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), a0);
      a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), a1);
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}

// Up to kRowTile activation rows: each weight block is dequantized once and used by every row.
template <int64_t KIND, int64_t MT>
LLMRT_AVX512 void linear_rows_tile_avx512(const float* x, int64_t ldx, const uint8_t* w,
                                          int64_t row_bytes, int64_t k, float* y, int64_t ldy,
                                          int64_t n) {
  constexpr int64_t bb = block_bytes_of(KIND);
  const uint8_t* row = w + n * row_bytes;
  __m512 a0[MT], a1[MT];
  for (int64_t r = 0; r < MT; ++r) {
    a0[r] = _mm512_setzero_ps();
    a1[r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m512 w0, w1;
    dequant_block_avx512<KIND>(row + b * bb, w0, w1);
    for (int64_t r = 0; r < MT; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), a0[r]);
      a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), a1[r]);
    }
  }
  for (int64_t r = 0; r < MT; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

// linear_rows_tile_avx512 over the weight rows of a chunk (run_tiles drives the chunks).
template <int64_t KIND>
struct BlockTile {
  const float* x;
  int64_t ldx;
  const uint8_t* w;
  int64_t row_bytes, k;
  float* y;
  int64_t ldy;

  template <int MT>
  LLMRT_AVX512 void run(int64_t r, int64_t c0, int64_t c1) const {
    for (int64_t n = c0; n < c1; ++n)
      linear_rows_tile_avx512<KIND, MT>(x + r * ldx, ldx, w, row_bytes, k, y + r * ldy, ldy, n);
  }
};

template <int64_t KIND>
LLMRT_AVX512 void linear_rows_avx512(const float* x, int64_t ldx, int64_t rows_m,
                                     const uint8_t* w, int64_t row_bytes, int64_t k, float* y,
                                     int64_t ldy, int64_t n0, int64_t n1) {
  if (rows_m == 1) {
    linear_rows_m1_avx512<KIND>(x, w, row_bytes, k, y, n0, n1);
    return;
  }
  llmrt_kernels::run_tiles(BlockTile<KIND>{x, ldx, w, row_bytes, k, y, ldy}, rows_m, n0, n1, 32);
}

template <int64_t KIND>
LLMRT_AVX512 void dequant_rows_avx512(const uint8_t* w, int64_t row_bytes, int64_t k, float* out,
                                      int64_t r0, int64_t r1) {
  constexpr int64_t bb = block_bytes_of(KIND);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    float* o = out + r * k;
    for (int64_t b = 0; b < k / kBlock; ++b) {
      __m512 w0, w1;
      dequant_block_avx512<KIND>(row + b * bb, w0, w1);
      _mm512_storeu_ps(o + b * kBlock, w0);
      _mm512_storeu_ps(o + b * kBlock + 16, w1);
    }
  }
}

#endif  // LLMRT_X86

template <int64_t KIND>
void dequant_rows_scalar(const uint8_t* w, int64_t row_bytes, int64_t k, float* out, int64_t r0,
                         int64_t r1) {
  constexpr int64_t bb = block_bytes_of(KIND);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < k / kBlock; ++b)
      dequant_block_scalar<KIND>(w + r * row_bytes + b * bb, out + r * k + b * kBlock);
}

#if defined(LLMRT_X86)
// Dense float32 weights [N, K] (kind 0): the same row-tile loop without the dequantize step.
template <int64_t MT>
LLMRT_AVX512 void dense_rows_tile_avx512(const float* x, int64_t ldx, const float* w, int64_t k,
                                         float* y, int64_t ldy, int64_t n) {
  const float* row = w + n * k;
  __m512 acc[MT];
  for (int64_t r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512 wv = _mm512_loadu_ps(row + j);
    for (int64_t r = 0; r < MT; ++r)
      acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * ldx + j), acc[r]);
  }
  if (j < k) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (k - j)) - 1);
    const __m512 wv = _mm512_maskz_loadu_ps(tail, row + j);
    for (int64_t r = 0; r < MT; ++r)
      acc[r] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + r * ldx + j), acc[r]);
  }
  for (int64_t r = 0; r < MT; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(acc[r]);
}

struct DenseTile {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t k;
  float* y;
  int64_t ldy;

  template <int MT>
  LLMRT_AVX512 void run(int64_t r, int64_t c0, int64_t c1) const {
    for (int64_t n = c0; n < c1; ++n)
      dense_rows_tile_avx512<MT>(x + r * ldx, ldx, w, k, y + r * ldy, ldy, n);
  }
};

LLMRT_AVX512 void dense_rows_avx512(const float* x, int64_t ldx, int64_t rows_m, const float* w,
                                    int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  llmrt_kernels::run_tiles(DenseTile{x, ldx, w, k, y, ldy}, rows_m, n0, n1, 16);
}
#endif  // LLMRT_X86

void dense_rows_scalar(const float* x, int64_t ldx, int64_t rows_m, const float* w, int64_t k,
                       float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < rows_m; ++r) {
      float s = 0.0f;
      for (int64_t j = 0; j < k; ++j) s += w[n * k + j] * x[r * ldx + j];
      y[r * ldy + n] = s;
    }
}

#if defined(LLMRT_X86)
// ---- AVX2 + FMA + F16C -------------------------------------------------------------------

// The block's 32 weights as four float32 vectors; 4-bit levels as d * q + m in one FMA (the
// AVX-512 table's rounding), Q8_0 as d * q.
template <int64_t KIND>
LLMRT_AVX2 inline void dequant_block_avx2(const uint8_t* blk, __m256* w) {
  const __m256 vd = _mm256_set1_ps(half_f16c(blk));
  if constexpr (KIND == kQ8_0) {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i)))));
  } else {
    const __m256 vm = KIND == kQ4_1 ? _mm256_set1_ps(half_f16c(blk + 2))
                                    : _mm256_mul_ps(vd, _mm256_set1_ps(-8.0f));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (KIND == kQ4_1 ? 4 : 2)));
    const __m128i low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), vd, vm);
  }
}

// MT (<= 4) activation rows against ggml block rows [n0, n1), float32 activations.
template <int64_t KIND, int MT>
LLMRT_AVX2 void linear_tile_avx2(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                                 int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t bb = block_bytes_of(KIND);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MT][2];
    for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / kBlock; ++b) {
      __m256 wv[4];
      dequant_block_avx2<KIND>(row + b * bb, wv);
      for (int r = 0; r < MT; ++r) {
        const float* xr = x + r * ldx + b * kBlock;
        acc[r][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
        acc[r][0] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
      }
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = llmrt_kernels::hadd8(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
}

template <int64_t KIND>
struct BlockTileAvx2 {
  const float* x;
  int64_t ldx;
  const uint8_t* w;
  int64_t row_bytes, k;
  float* y;
  int64_t ldy;

  template <int MT>
  void run(int64_t r, int64_t c0, int64_t c1) const {
    if constexpr (MT > 4) {
      run<4>(r, c0, c1);
      run<MT - 4>(r + 4, c0, c1);
    } else {
      linear_tile_avx2<KIND, MT>(x + r * ldx, ldx, w, row_bytes, k, y + r * ldy, ldy, c0, c1);
    }
  }
};

template <int64_t KIND>
void linear_rows_avx2(const float* x, int64_t ldx, int64_t rows_m, const uint8_t* w,
                      int64_t row_bytes, int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  llmrt_kernels::run_tiles(BlockTileAvx2<KIND>{x, ldx, w, row_bytes, k, y, ldy}, rows_m, n0, n1, 16);
}

template <int64_t KIND>
LLMRT_AVX2 void dequant_rows_avx2(const uint8_t* w, int64_t row_bytes, int64_t k, float* out,
                                  int64_t r0, int64_t r1) {
  constexpr int64_t bb = block_bytes_of(KIND);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < k / kBlock; ++b) {
      __m256 wv[4];
      dequant_block_avx2<KIND>(w + r * row_bytes + b * bb, wv);
      float* o = out + r * k + b * kBlock;
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, wv[i]);
    }
}

// Dense float32 rows: MT (<= 4) activation rows per pass over a weight row.
template <int MT>
LLMRT_AVX2 void dense_tile_avx2(const float* x, int64_t ldx, const float* w, int64_t k, float* y,
                                int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* row = w + n * k;
    __m256 acc[MT][2];
    for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
      const __m256 w0 = _mm256_loadu_ps(row + j), w1 = _mm256_loadu_ps(row + j + 8);
      for (int r = 0; r < MT; ++r) {
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + j), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + j + 8), acc[r][1]);
      }
    }
    for (; j < k; j += 8) {
      const int64_t left = std::min<int64_t>(8, k - j);
      const __m256 w0 = llmrt_kernels::load8_tail(row + j, left);
      for (int r = 0; r < MT; ++r)
        acc[r][0] = _mm256_fmadd_ps(w0, llmrt_kernels::load8_tail(x + r * ldx + j, left), acc[r][0]);
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = llmrt_kernels::hadd8(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
}

struct DenseTileAvx2 {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t k;
  float* y;
  int64_t ldy;

  template <int MT>
  void run(int64_t r, int64_t c0, int64_t c1) const {
    if constexpr (MT > 4) {
      run<4>(r, c0, c1);
      run<MT - 4>(r + 4, c0, c1);
    } else {
      dense_tile_avx2<MT>(x + r * ldx, ldx, w, k, y + r * ldy, ldy, c0, c1);
    }
  }
};
#endif  // LLMRT_X86

void check_blocks(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  TORCH_CHECK(blocks.device().is_cpu(), "llmrt_kernels: blocks must be on the CPU");
  TORCH_CHECK(blocks.scalar_type() == at::kByte, "llmrt_kernels: blocks must be uint8");
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous(),
              "llmrt_kernels: blocks must be a contiguous [rows, row_bytes] tensor");
  if (llmrt_kernels::is_stacked_kind(kind)) {  // stacked.cpp's blob of row ranges
    llmrt_kernels::stacked_check(blocks, kind, in_features);
    return;
  }
  if (llmrt_kernels::is_kquant_kind(kind)) {  // kquants.cpp's types: their own block sizes
    const int64_t per = llmrt_kernels::kquant_block_weights(kind);
    TORCH_CHECK(in_features > 0 && in_features % per == 0, "llmrt_kernels: in_features of type ",
                kind, " must be a positive multiple of ", per, ", got ", in_features);
    TORCH_CHECK(blocks.size(1) == in_features / per * llmrt_kernels::kquant_block_bytes(kind),
                "llmrt_kernels: row of ", blocks.size(1), " bytes does not hold ", in_features,
                " weights of type ", kind);
    return;
  }
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0,
              "llmrt_kernels: in_features must be a positive multiple of 32, got ", in_features);
  TORCH_CHECK(blocks.size(1) == in_features / kBlock * block_bytes(kind),
              "llmrt_kernels: row of ", blocks.size(1), " bytes does not hold ", in_features,
              " weights of type ", kind);
}

// Rows per task: enough work to amortise the pool, small enough to balance two threads.
int64_t grain_for(int64_t n, int64_t rows_m) {
  const int64_t per = 64 / (rows_m < 8 ? rows_m : 8);
  return n < 2 * per ? n : per;
}

}  // namespace

namespace llmrt_kernels {

void check_weight(const at::Tensor& w, int64_t kind, int64_t in_features) {
  if (kind == kDenseF32) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 &&
                    w.is_contiguous() && w.size(1) == in_features,
                "llmrt_kernels: a dense weight must be a contiguous float32 [out, ", in_features,
                "] CPU tensor");
    return;
  }
  check_blocks(w, kind, in_features);
}

void linear_into(const float* x, int64_t rows_m, const at::Tensor& w, int64_t kind, int64_t k,
                 float* y) {
  const int64_t n = w.size(0);
  if (rows_m <= 0 || n <= 0) return;
  if (takes_kquant_gemm(kind, rows_m, n, k)) {  // per-call panels of the blocks (kquant_gemm.cpp)
    kquant_gemm(x, rows_m, w.const_data_ptr<uint8_t>(), w.size(1), kind, k, y, n);
    return;
  }
  if (takes_integer_gemm(kind, rows_m)) {  // its own row chunks and panel scheduling
    interleaved_gemm(x, rows_m, w.const_data_ptr<uint8_t>(), w.size(1), kind & ~kInterleaved, k,
                     y, n);
    return;
  }
  // The caller's scratch (a thread_local named inside the lambda would be each worker's own).
  thread_local std::vector<uint8_t> scratch;
  const int64_t prep_bytes = rows_m * linear_prep_bytes(kind, k);
  if (static_cast<int64_t>(scratch.size()) < prep_bytes)
    scratch.resize(static_cast<size_t>(prep_bytes));
  uint8_t* prep = scratch.data();
  linear_prepare(x, 0, rows_m, rows_m, kind, k, prep);
  llmrt_kernels::parallel_for(0, n, grain_for(n, rows_m), [&](int64_t n0, int64_t n1) {
    linear_range(x, rows_m, w, kind, k, prep, y, n0, n1);
  });
}

int64_t linear_prep_bytes(int64_t kind, int64_t k) {
  if (is_stacked_kind(kind)) return stacked_prep_bytes(kind, k);
  if (is_kquant_kind(kind)) return kquant_prep_bytes(kind, k);
  if (!(kind & kInterleaved)) return 0;
  const int64_t tiles = interleaved_prep_bytes(kind & ~kInterleaved, k);
  return tiles == 0 ? 0 : std::max(tiles, interleaved_gemm_prep_bytes(k));
}

void linear_prepare(const float* x, int64_t r0, int64_t r1, int64_t rows, int64_t kind, int64_t k,
                    uint8_t* prep) {
  if (is_stacked_kind(kind))
    stacked_prepare(x, r0, r1, rows, kind, k, prep);
  else if (is_kquant_kind(kind))
    kquant_prepare(x, r0, r1, kind, k, prep);
  else if (takes_integer_gemm(kind, rows))
    interleaved_gemm_prepare(x, r0, r1, k, prep);
  else if (kind & kInterleaved)
    interleaved_prepare(x, r0, r1, kind & ~kInterleaved, k, prep);
}

int64_t linear_chunk_unit(int64_t kind, int64_t rows) {
  if (is_stacked_kind(kind)) return 32;
  return takes_integer_gemm(kind, rows) ? 32 : 16;
}

void linear_range(const float* x, int64_t rows_m, const at::Tensor& w, int64_t kind, int64_t k,
                  const uint8_t* prep, float* y, int64_t n0, int64_t n1) {
  if (is_stacked_kind(kind)) {
    stacked_range(x, rows_m, w.const_data_ptr<uint8_t>(), w.size(0), kind, k, prep, y, n0, n1);
    return;
  }
  linear_range_rows(x, rows_m, w.const_data_ptr(), w.size(0), kind == kDenseF32 ? k : w.size(1),
                    kind, k, prep, y, n0, n1);
}

void linear_range_rows(const float* x, int64_t rows_m, const void* data, int64_t n, int64_t rb,
                       int64_t kind, int64_t k, const uint8_t* prep, float* y, int64_t n0,
                       int64_t n1) {
  if (rows_m <= 0 || n0 >= n1) return;
  const bool simd = has_avx512(), avx2 = llmrt_kernels::has_avx2();
  if (kind == kDenseF32) {
    const float* wp = static_cast<const float*>(data);
#if defined(LLMRT_X86)
    if (simd) {
      dense_rows_avx512(x, k, rows_m, wp, k, y, n, n0, n1);
      return;
    }
    if (avx2) {
      llmrt_kernels::run_tiles(DenseTileAvx2{x, k, wp, k, y, n}, rows_m, n0, n1, 16);
      return;
    }
#endif
    dense_rows_scalar(x, k, rows_m, wp, k, y, n, n0, n1);
    return;
  }
  const uint8_t* wp = static_cast<const uint8_t*>(data);
  if (is_kquant_kind(kind)) {
    kquant_range(x, rows_m, wp, rb, kind, k, prep, y, n, n0, n1);
    return;
  }
  if (takes_integer_gemm(kind, rows_m)) {
    interleaved_gemm_range(prep, rows_m, wp, rb, kind & ~kInterleaved, k, y, n, n0, n1);
    return;
  }
  if (kind & kInterleaved) {
    interleaved_range(x, rows_m, wp, rb, kind & ~kInterleaved, k, prep, y, n, n0, n1);
    return;
  }
#if defined(LLMRT_X86)
  switch (kind) {
    case kQ4_0:
      if (simd) linear_rows_avx512<kQ4_0>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      else if (avx2) linear_rows_avx2<kQ4_0>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      else linear_rows_scalar<kQ4_0>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      break;
    case kQ4_1:
      if (simd) linear_rows_avx512<kQ4_1>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      else if (avx2) linear_rows_avx2<kQ4_1>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      else linear_rows_scalar<kQ4_1>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      break;
    default:
      if (simd) linear_rows_avx512<kQ8_0>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      else if (avx2) linear_rows_avx2<kQ8_0>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      else linear_rows_scalar<kQ8_0>(x, k, rows_m, wp, rb, k, y, n, n0, n1);
      break;
  }
#else
  (void)simd;
  (void)avx2;
  switch (kind) {
    case kQ4_0: linear_rows_scalar<kQ4_0>(x, k, rows_m, wp, rb, k, y, n, n0, n1); break;
    case kQ4_1: linear_rows_scalar<kQ4_1>(x, k, rows_m, wp, rb, k, y, n, n0, n1); break;
    default: linear_rows_scalar<kQ8_0>(x, k, rows_m, wp, rb, k, y, n, n0, n1); break;
  }
#endif
}

}  // namespace llmrt_kernels

namespace {

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                       int64_t in_features, const std::optional<at::Tensor>& bias) {
  check_blocks(blocks, kind, in_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "llmrt_kernels: x must be float32 on the CPU");
  TORCH_CHECK(x.size(-1) == in_features, "llmrt_kernels: x has ", x.size(-1),
              " features, the weight ", in_features);
  const int64_t n = blocks.size(0);
  const at::Tensor xc = x.contiguous();
  const int64_t rows_m = xc.numel() / in_features;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  llmrt_kernels::linear_into(xc.const_data_ptr<float>(), rows_m, blocks, kind, in_features,
                             y.mutable_data_ptr<float>());
  if (bias.has_value()) y.add_(*bias);
  return y;
}

template <int64_t KIND>
void run_dequant(const uint8_t* w, int64_t row_bytes, int64_t k, float* out, int64_t rows) {
  const bool simd = has_avx512(), avx2 = llmrt_kernels::has_avx2();
  llmrt_kernels::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
#if defined(LLMRT_X86)
    if (simd) {
      dequant_rows_avx512<KIND>(w, row_bytes, k, out, r0, r1);
      return;
    }
    if (avx2) {
      dequant_rows_avx2<KIND>(w, row_bytes, k, out, r0, r1);
      return;
    }
#else
    (void)simd;
    (void)avx2;
#endif
    dequant_rows_scalar<KIND>(w, row_bytes, k, out, r0, r1);
  });
}

}  // namespace

namespace llmrt_kernels {

void dequantize_rows(const uint8_t* wp, int64_t rb, int64_t kind, int64_t k, float* op,
                     int64_t rows) {
  if (kind & kInterleaved) {
    interleaved_dequantize(wp, rb, kind & ~kInterleaved, k, op, rows);
    return;
  }
  if (is_stacked_kind(kind)) {
    stacked_dequantize(wp, kind, k, op);
    return;
  }
  if (is_kquant_kind(kind)) {
    llmrt_kernels::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      kquant_dequantize(wp, rb, kind, k, op, r0, r1);
    });
    return;
  }
  switch (kind) {
    case kQ4_0: run_dequant<kQ4_0>(wp, rb, k, op, rows); break;
    case kQ4_1: run_dequant<kQ4_1>(wp, rb, k, op, rows); break;
    default: run_dequant<kQ8_0>(wp, rb, k, op, rows); break;
  }
}

}  // namespace llmrt_kernels

namespace {

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  check_blocks(blocks, kind, in_features);
  const int64_t rows = blocks.size(0);
  at::Tensor out = at::empty({rows, in_features}, blocks.options().dtype(at::kFloat));
  if (rows > 0)
    llmrt_kernels::dequantize_rows(blocks.const_data_ptr<uint8_t>(), blocks.size(1), kind,
                                   in_features, out.mutable_data_ptr<float>(), rows);
  return out;
}


#if defined(LLMRT_X86)
LLMRT_AVX512_BF16 void to_bf16_avx512(const float* in, c10::BFloat16* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
  for (; i < n; ++i) out[i] = c10::BFloat16(in[i]);
}
#endif  // LLMRT_X86

// The bfloat16 weight a bfloat16 GEMM multiplies (``device.gemm_dtype``): dequantized to
// float32 a few rows at a time in cache, then rounded to nearest even, as ``.to(bfloat16)``
// would round the float32 weight, without writing and re-reading the float32 matrix.
at::Tensor gguf_dequantize_bf16(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  check_blocks(blocks, kind, in_features);
  TORCH_CHECK(!llmrt_kernels::is_stacked_kind(kind),
              "llmrt_kernels: gguf_dequantize_bf16 takes one block kind, not a stacked weight");
  const int64_t rows = blocks.size(0);
  at::Tensor out = at::empty({rows, in_features}, blocks.options().dtype(at::kBFloat16));
  if (rows == 0) return out;
  [[maybe_unused]] static const bool bf16_ops = llmrt_kernels::has_avx512_bf16();
  const uint8_t* wp = blocks.const_data_ptr<uint8_t>();
  c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t rb = blocks.size(1);
  if ((kind & llmrt_kernels::kInterleaved) &&
      llmrt_kernels::interleaved_dequantize_bf16(wp, rb, kind & ~llmrt_kernels::kInterleaved,
                                                 in_features, reinterpret_cast<uint16_t*>(op),
                                                 rows))
    return out;
  constexpr int64_t kRows = 16;
  llmrt_kernels::parallel_for(0, (rows + kRows - 1) / kRows, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> buf(static_cast<size_t>(kRows * in_features));
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r0 = c * kRows, n = std::min(kRows, rows - r0);
      llmrt_kernels::dequantize_rows(wp + r0 * rb, rb, kind, in_features, buf.data(), n);
      c10::BFloat16* dst = op + r0 * in_features;
#if defined(LLMRT_X86)
      if (bf16_ops) {
        to_bf16_avx512(buf.data(), dst, n * in_features);
        continue;
      }
#endif
      for (int64_t i = 0; i < n * in_features; ++i) dst[i] = c10::BFloat16(buf[i]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int kind, int in_features, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("gguf_dequantize_bf16(Tensor blocks, int kind, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_dequantize_bf16", &gguf_dequantize_bf16);
}
