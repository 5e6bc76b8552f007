// Many activation rows against interleaved Q4_0 / Q4_1 / Q8_0 blocks with the activations in
// ONE 8-bit level per 32 values (ops ``interleaved_gemm_q8``, ``interleaved_gemm_q8_supported``).
//
// Why: interleaved_gemm.cpp and kquant_gemm.cpp multiply two 8-bit levels per activation
// (~16 bits), two products per weight and activation. One level (llama.cpp's Q8_0
// activations) halves the products; it is opt-in (``device.gemm_dtype: int8``) because it
// moves the logits more. Llama-3.2-1B's shapes at 512 rows, one thread, against what runs
// today: forced avx2 1.9-2.2x (4-bit, ~115 GMAC/s) and 1.16-1.29x (Q8_0, against dequantize +
// sgemm); avx_vnni 2.2-2.9x; AVX-512 VNNI 1.26-1.66x; from 16 rows it wins at every level.
//
// Activation numerics, per 32-value block of a row of x (float32 throughout):
//   amax = max |x|;  d_x = amax / 127;  q = nearbyint(x / d_x)  (round half to even;
//   |q| <= 127), and d_x = 0, q = 0 where amax is 0; s_x = d_x * sum(q) (float32).
// Per output and block b, with the weight w = d_w * u + m_w (u its unsigned quants; Q4_0:
// u = q_w, m_w = -8 d_w; Q4_1: its m; Q8_0: u = q_w + 128 as stored, m_w = -128 d_w) and
// I = sum(u * q) (exact), the float32 sum over the blocks in order is
//   acc = fma(float(I), d_w * d_x, acc);  acc = fma(m_w, s_x, acc)
// and the same at every level (so every level gives the same bits).
//
// The loops (the weight's panels packed per call, shared by every row; rows prepared once per
// row chunk):
// - AVX2: a panel is 8 * kVecs2 output columns (Q8_0: 8 * kVecs2Q8); per 32-weight block its
//   unsigned quant bytes are ordered [k/4 step][column][4 k] (one 32-byte vector = 8 columns
//   x 4 k), then d_w and m_w as floats. vpmaddubsw multiplies a vector by a row's four
//   broadcast int8s; a 4-bit weight's pair sums (<= 2 * 15 * 127) add up in int16 over the
//   block's 8 steps (<= 30480), then one vpmaddwd widens them. Q8_0's stored bytes (0..255)
//   would saturate vpmaddubsw, so its panel holds them as two nibble planes (u = 16 hi + lo),
//   each summed as a 4-bit weight in the same pass.
// - avx_vnni: the AVX2 panel (Q8_0 in one plane) and AVX-VNNI's 256-bit vpdpbusd, which sums
//   a step's u8 x s8 products straight into int32.
// - AVX-512 VNNI: the panel is 16 * kVecsV columns of 64-byte vectors, vpdpbusd into int32.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "blocks.h"
#include "cpu.h"
#include "interleaved_layout.h"
#include "linear.h"
#include "parallel.h"
#include "transpose.h"

namespace {

using llmrt_kernels::kBlock;
using llmrt_kernels::kInterleaved;
using llmrt_kernels::kQ4_0;
using llmrt_kernels::kQ4_1;
using llmrt_kernels::kQ8_0;

// Prepared row: q[k] int8, then per block d (nb floats) and d * sum(q) (nb floats).
constexpr int64_t q8_stride(int64_t k) { return k + 8 * (k / kBlock); }

// A panel's shape: ``vecs`` vectors of ``vb`` bytes (vb / 4 columns each) per k/4 step,
// ``planes`` quant planes per block (2: Q8_0 as nibbles at AVX2).
struct PanelShape {
  int vb, vecs, planes;
  int64_t cols() const { return static_cast<int64_t>(vecs) * vb / 4; }
  int64_t quant_bytes() const { return static_cast<int64_t>(planes) * 8 * vecs * vb; }
  int64_t block_bytes() const { return quant_bytes() + 8 * cols(); }
};

// AVX2 tiles (vectors x rows; 16 ymm registers): 4-bit kinds 2 x 3 (6 int16 sums, 6 float
// sums), Q8_0 1 x 3 (both planes' int16 sums: 6, and 3 float sums). Measured in-process at
// 512 rows on Llama-3.2-1B's shapes, 2 threads, forced avx2: Q8_0 1 x 3 at 58-65 GMAC/s/core
// against 52-59 at 1 x 2, 53-59 at 1 x 4, 46-47 at 2 x 1 and 36-43 at 2 x 2; Q4_0 2 x 3 ahead
// of 1 x 4, 1 x 6 and 2 x 2 by 3-10%. (LLMRT_Q8_TILES: a standalone build's other shapes.)
#if !defined(LLMRT_Q8_TILES)
#define LLMRT_Q8_VECS2 2
#define LLMRT_Q8_ROWS2 3
#define LLMRT_Q8_ROWS2_Q8 3
#define LLMRT_Q8_VECS2_Q8 1
#endif
[[maybe_unused]] constexpr int kVecs2 = LLMRT_Q8_VECS2;
[[maybe_unused]] constexpr int kRows2 = LLMRT_Q8_ROWS2;
[[maybe_unused]] constexpr int kRows2Q8 = LLMRT_Q8_ROWS2_Q8;
[[maybe_unused]] constexpr int kVecs2Q8 = LLMRT_Q8_VECS2_Q8;
[[maybe_unused]] constexpr int kVecsV = 2;
[[maybe_unused]] constexpr int kRowsV = 6;
// Prepared activation bytes per row chunk (each chunk packs every panel again): 1B's
// 8192-deep down projection at 512 rows, one thread, 174 GMAC/s at 512 KiB, 207-220 from
// 2 MiB (AVX-512 VNNI); 101 against 111-114 (avx2). The rows stream past a panel held in L2.
#if !defined(LLMRT_Q8_CHUNK)
#define LLMRT_Q8_CHUNK (8 << 20)
#endif
[[maybe_unused]] constexpr int64_t kChunkBytes = LLMRT_Q8_CHUNK;

#if defined(LLMRT_X86)
// Rows [r0, r1) of x (k floats each) quantized into ``out`` (q8_stride(k) bytes per row).
LLMRT_AVX2 void prepare_q8_rows(const float* x, int64_t r0, int64_t r1, int64_t k, uint8_t* out) {
  const int64_t nb = k / kBlock, stride = q8_stride(k);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t r = r0; r < r1; ++r) {
    int8_t* q = reinterpret_cast<int8_t*>(out + r * stride);
    float* dq = reinterpret_cast<float*>(out + r * stride + k);
    float* sq = dq + nb;
    const float* xr = x + r * k;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xr + b * kBlock + 8 * i);
      const __m256 m = _mm256_max_ps(
          _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.0f;
      const __m256 dv = _mm256_set1_ps(amax > 0.0f ? d : 1.0f);
      __m256i iv[4];
      for (int i = 0; i < 4; ++i)
        iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[i], dv), kRound));
      const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]),
                                           _mm256_add_epi32(iv[2], iv[3]));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[0], iv[1]), 0xD8);
      const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[2], iv[3]), 0xD8);
      const __m256i p8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(p01, p23), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p8);
      dq[b] = d;
      sq[b] = d * static_cast<float>(_mm_cvtsi128_si32(t));
    }
  }
}

// Weight rows [n0, n0 + cols) (cols <= shape.cols(); the rest zero) packed into ``out``
// (nb * shape.block_bytes()): per block and eight columns, each column's 32 quant bytes (one
// dword per k/4 step) transposed into the steps; then d_w[cols()] and m_w[cols()].
LLMRT_AVX2 void pack_q8_panel(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t nb,
                              int64_t n0, int64_t cols, const PanelShape& shape, uint8_t* out) {
  alignas(32) static const uint8_t zeros[32] = {};
  const __m128i low = _mm_set1_epi8(15);
  const __m256i low8 = _mm256_set1_epi8(15);
  const int64_t pc = shape.cols(), groups = pc / 8;
  const int64_t step_bytes = static_cast<int64_t>(shape.vecs) * shape.vb;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = out + b * shape.block_bytes();
    float* dm = reinterpret_cast<float*>(o + shape.quant_bytes());
    for (int64_t g = 0; g < groups; ++g) {
      // Group g's columns sit in vector g / (vb / 32) of a step, at byte 32 * (g % (vb / 32)).
      const int64_t at = (g / (shape.vb / 32)) * shape.vb + 32 * (g % (shape.vb / 32));
      __m256i first[8], second[8];
      alignas(16) uint16_t dh[8], mh[8];
      for (int j = 0; j < 8; ++j) {
        const int64_t col = 8 * g + j;
        const uint8_t* q = zeros;
        dh[j] = mh[j] = 0;
        if (col < cols) {
          const llmrt_kernels::BlockBytes bb =
              llmrt_kernels::block_bytes_at(w + (n0 + col) * row_bytes, base, nb, b);
          q = bb.q;
          std::memcpy(&dh[j], bb.d, 2);
          if (bb.m != nullptr) std::memcpy(&mh[j], bb.m, 2);
        }
        if (base == kQ8_0) {
          const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
          if (shape.planes == 2) {
            first[j] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low8);  // high nibbles
            second[j] = _mm256_and_si256(z, low8);                       // low nibbles
          } else {
            first[j] = z;
          }
        } else {
          const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          first[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(z, 4), low), _mm_and_si128(z, low));
        }
      }
      llmrt_kernels::transpose8x8(first);
      for (int s = 0; s < 8; ++s)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + s * step_bytes + at), first[s]);
      if (shape.planes == 2) {
        llmrt_kernels::transpose8x8(second);
        for (int s = 0; s < 8; ++s)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (8 + s) * step_bytes + at), second[s]);
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
      const __m256 mv =
          base == kQ4_1
              ? _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(mh)))
              : _mm256_mul_ps(dv, _mm256_set1_ps(base == kQ8_0 ? -128.0f : -8.0f));
      _mm256_storeu_ps(dm + 8 * g, dv);
      _mm256_storeu_ps(dm + pc + 8 * g, mv);
    }
  }
}

LLMRT_AVX2 inline __m256i bcast4_epi8(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [0, R) of the prepared chunk (``px``, ``stride`` bytes per row) against one AVX2 panel
// of V vectors into y (row stride ``ldy``). PLANES 2: Q8_0's nibble planes (high, then low),
// both summed in the same pass over the steps.
template <int R, int V, int PLANES>
LLMRT_AVX2 void tile_avx2(const uint8_t* px, int64_t stride, int64_t k, int64_t nb,
                          const uint8_t* panel, const PanelShape& shape, float* y, int64_t ldy) {
  const int64_t bbytes = shape.block_bytes(), qbytes = shape.quant_bytes();
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  __m256 f[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) f[r][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = panel + b * bbytes;
    const int8_t* xb = reinterpret_cast<const int8_t*>(px) + b * kBlock;
    __m256i t[PLANES][R][V];
    for (int p = 0; p < PLANES; ++p)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) t[p][r][v] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      __m256i wv[PLANES][V];
      for (int p = 0; p < PLANES; ++p)
        for (int v = 0; v < V; ++v)
          wv[p][v] = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(o + ((p * 8 + s) * V + v) * 32));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = bcast4_epi8(xb + r * stride + 4 * s);
        for (int p = 0; p < PLANES; ++p)
          for (int v = 0; v < V; ++v) {
            t[p][r][v] = _mm256_add_epi16(t[p][r][v], _mm256_maddubs_epi16(wv[p][v], xv));
            // Keep each sum a chain (gcc otherwise computes every step's products first and
            // spills them).
            asm("" : "+x"(t[p][r][v]));
          }
      }
    }
    const float* dm = reinterpret_cast<const float*>(o + qbytes);
    for (int r = 0; r < R; ++r) {
      const float* sc = reinterpret_cast<const float*>(px + r * stride + k);
      const __m256 dx = _mm256_set1_ps(sc[b]);
      const __m256 sx = _mm256_set1_ps(sc[nb + b]);
      for (int v = 0; v < V; ++v) {
        __m256i iv = _mm256_madd_epi16(t[0][r][v], PLANES == 2 ? sixteen : ones);
        if constexpr (PLANES == 2) iv = _mm256_add_epi32(iv, _mm256_madd_epi16(t[1][r][v], ones));
        f[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv),
                                  _mm256_mul_ps(_mm256_loadu_ps(dm + 8 * v), dx), f[r][v]);
        f[r][v] = _mm256_fmadd_ps(_mm256_loadu_ps(dm + shape.cols() + 8 * v), sx, f[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + r * ldy + 8 * v, f[r][v]);
}

// Rows [0, rows) (rows <= R) in one tile of that height.
template <int R, int V, int PLANES>
void rows_avx2(int64_t rows, const uint8_t* px, int64_t stride, int64_t k, int64_t nb,
               const uint8_t* panel, const PanelShape& shape, float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) {
      rows_avx2<R - 1, V, PLANES>(rows, px, stride, k, nb, panel, shape, y, ldy);
      return;
    }
  }
  tile_avx2<R, V, PLANES>(px, stride, k, nb, panel, shape, y, ldy);
}

// tile_avx2 at the avx_vnni level: AVX-VNNI's vpdpbusd sums a step's u8 x s8 products into
// int32 (one instruction where AVX2 takes vpmaddubsw + vpaddw; Q8_0's stored bytes in one plane).
template <int R, int V>
LLMRT_AVX_VNNI void tile_avx_vnni(const uint8_t* px, int64_t stride, int64_t k, int64_t nb,
                                  const uint8_t* panel, const PanelShape& shape, float* y,
                                  int64_t ldy) {
  const int64_t bbytes = shape.block_bytes(), qbytes = shape.quant_bytes();
  __m256 f[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) f[r][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = panel + b * bbytes;
    const int8_t* xb = reinterpret_cast<const int8_t*>(px) + b * kBlock;
    __m256i acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      __m256i wv[V];
      for (int v = 0; v < V; ++v)
        wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + (s * V + v) * 32));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xb + r * stride + 4 * s, 4);
        const __m256i xv = _mm256_set1_epi32(four);
        for (int v = 0; v < V; ++v) acc[r][v] = _mm256_dpbusd_avx_epi32(acc[r][v], wv[v], xv);
      }
    }
    const float* dm = reinterpret_cast<const float*>(o + qbytes);
    for (int r = 0; r < R; ++r) {
      const float* sc = reinterpret_cast<const float*>(px + r * stride + k);
      const __m256 dx = _mm256_set1_ps(sc[b]);
      const __m256 sx = _mm256_set1_ps(sc[nb + b]);
      for (int v = 0; v < V; ++v) {
        f[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]),
                                  _mm256_mul_ps(_mm256_loadu_ps(dm + 8 * v), dx), f[r][v]);
        f[r][v] = _mm256_fmadd_ps(_mm256_loadu_ps(dm + shape.cols() + 8 * v), sx, f[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + r * ldy + 8 * v, f[r][v]);
}

template <int R>
void rows_avx_vnni(int64_t rows, const uint8_t* px, int64_t stride, int64_t k, int64_t nb,
                   const uint8_t* panel, const PanelShape& shape, float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) {
      rows_avx_vnni<R - 1>(rows, px, stride, k, nb, panel, shape, y, ldy);
      return;
    }
  }
  tile_avx_vnni<R, kVecs2>(px, stride, k, nb, panel, shape, y, ldy);
}

// tile_avx2 at AVX-512 VNNI: 64-byte vectors (16 columns), vpdpbusd into int32 per block.
template <int R>
LLMRT_VNNI void tile_vnni(const uint8_t* px, int64_t stride, int64_t k, int64_t nb,
                          const uint8_t* panel, const PanelShape& shape, float* y, int64_t ldy) {
  constexpr int V = kVecsV;
  const int64_t bbytes = shape.block_bytes(), qbytes = shape.quant_bytes();
  __m512 f[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) f[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = panel + b * bbytes;
    const int8_t* xb = reinterpret_cast<const int8_t*>(px) + b * kBlock;
    __m512i acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      __m512i wv[V];
      for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_si512(o + (s * V + v) * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xb + r * stride + 4 * s, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], wv[v], xv);
      }
    }
    const float* dm = reinterpret_cast<const float*>(o + qbytes);
    for (int r = 0; r < R; ++r) {
      const float* sc = reinterpret_cast<const float*>(px + r * stride + k);
      const __m512 dx = _mm512_set1_ps(sc[b]);
      const __m512 sx = _mm512_set1_ps(sc[nb + b]);
      for (int v = 0; v < V; ++v) {
        f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][v]),
                                  _mm512_mul_ps(_mm512_loadu_ps(dm + 16 * v), dx), f[r][v]);
        f[r][v] = _mm512_fmadd_ps(_mm512_loadu_ps(dm + shape.cols() + 16 * v), sx, f[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, f[r][v]);
}

void rows_vnni(int64_t rows, const uint8_t* px, int64_t stride, int64_t k, int64_t nb,
               const uint8_t* panel, const PanelShape& shape, float* y, int64_t ldy) {
  switch (rows) {
    case 6: tile_vnni<6>(px, stride, k, nb, panel, shape, y, ldy); break;
    case 5: tile_vnni<5>(px, stride, k, nb, panel, shape, y, ldy); break;
    case 4: tile_vnni<4>(px, stride, k, nb, panel, shape, y, ldy); break;
    case 3: tile_vnni<3>(px, stride, k, nb, panel, shape, y, ldy); break;
    case 2: tile_vnni<2>(px, stride, k, nb, panel, shape, y, ldy); break;
    default: tile_vnni<1>(px, stride, k, nb, panel, shape, y, ldy); break;
  }
}
static_assert(kRowsV == 6, "rows_vnni's cases cover 1..kRowsV");

// The running level's panel shape and tile rows for ``base``.
enum class Loop { kAvx2, kAvxVnni, kAvx512Vnni };

struct Plan {
  PanelShape shape;
  int64_t tile_rows;
  Loop loop;
};

Plan plan_for(int64_t base) {
  if (llmrt_kernels::has_avx512_vnni()) return {{64, kVecsV, 1}, kRowsV, Loop::kAvx512Vnni};
  if (llmrt_kernels::has_avx_vnni()) return {{32, kVecs2, 1}, kRows2, Loop::kAvxVnni};
  if (base == kQ8_0) return {{32, kVecs2Q8, 2}, kRows2Q8, Loop::kAvx2};
  return {{32, kVecs2, 1}, kRows2, Loop::kAvx2};
}

void run_rows(const Plan& plan, int64_t rows, const uint8_t* px, int64_t stride, int64_t k,
              int64_t nb, const uint8_t* panel, float* y, int64_t ldy) {
  if (plan.loop == Loop::kAvx512Vnni)
    rows_vnni(rows, px, stride, k, nb, panel, plan.shape, y, ldy);
  else if (plan.loop == Loop::kAvxVnni)
    rows_avx_vnni<kRows2>(rows, px, stride, k, nb, panel, plan.shape, y, ldy);
  else if (plan.shape.planes == 2)
    rows_avx2<kRows2Q8, kVecs2Q8, 2>(rows, px, stride, k, nb, panel, plan.shape, y, ldy);
  else
    rows_avx2<kRows2, kVecs2, 1>(rows, px, stride, k, nb, panel, plan.shape, y, ldy);
}

uint8_t* panel_buffer(int64_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < bytes) buffer.resize(static_cast<size_t>(bytes));
  return buffer.data();
}

// y[rows_m, n] = x W^T for interleaved blocks of ``base`` (the GEMM of the op).
void q8_gemm(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes, int64_t base,
             int64_t k, float* y, int64_t n) {
  if (rows_m <= 0 || n <= 0) return;
  const Plan plan = plan_for(base);
  const int64_t nb = k / kBlock, stride = q8_stride(k), tr = plan.tile_rows;
  const int64_t chunk = std::max<int64_t>(tr, kChunkBytes / stride / tr * tr);
  std::vector<uint8_t> prep(static_cast<size_t>(std::min(rows_m, chunk) * stride));
  const int64_t cols = plan.shape.cols();
  const int64_t panels = (n + cols - 1) / cols;
  const int64_t panel_bytes = nb * plan.shape.block_bytes();
  for (int64_t c0 = 0; c0 < rows_m; c0 += chunk) {
    const int64_t rows = std::min(chunk, rows_m - c0);
    const float* xc = x + c0 * k;
    uint8_t* px = prep.data();
    llmrt_kernels::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      prepare_q8_rows(xc, r0, r1, k, px);
    });
    float* yc = y + c0 * n;
    // Panels from a shared counter: a core another tenant slows takes fewer.
    std::atomic<int64_t> next{0};
    llmrt_kernels::parallel_for(0, panels, 1, [&](int64_t, int64_t) {
      uint8_t* panel = panel_buffer(panel_bytes);
      std::vector<float> edge(static_cast<size_t>(tr * cols));
      for (int64_t p = next.fetch_add(1); p < panels; p = next.fetch_add(1)) {
        const int64_t p0 = p * cols, pc = std::min(cols, n - p0);
        pack_q8_panel(w, row_bytes, base, nb, p0, pc, plan.shape, panel);
        for (int64_t r = 0; r < rows; r += tr) {
          const int64_t t = std::min(tr, rows - r);
          if (pc == cols) {
            run_rows(plan, t, px + r * stride, stride, k, nb, panel, yc + r * n + p0, n);
          } else {
            run_rows(plan, t, px + r * stride, stride, k, nb, panel, edge.data(), cols);
            for (int64_t i = 0; i < t; ++i)
              std::memcpy(yc + (r + i) * n + p0, edge.data() + i * cols,
                          static_cast<size_t>(pc) * sizeof(float));
          }
        }
      }
    });
  }
}
#endif  // LLMRT_X86

bool is_q8_kind(int64_t kind) {
  return kind == (kQ4_0 | kInterleaved) || kind == (kQ4_1 | kInterleaved) ||
         kind == (kQ8_0 | kInterleaved);
}

}  // namespace

namespace llmrt_kernels {

// Whether interleaved_gemm_q8 runs ``kind`` at the running level (x86 AVX2 and above).
bool interleaved_gemm_q8_supported(int64_t kind) { return is_q8_kind(kind) && has_avx2(); }

// x[..., k] (float32) times interleaved blocks ``blocks`` [n, row bytes] of ``kind``, plus
// ``bias`` [n]: float32 [..., n], the activations in one 8-bit level per 32 values (the file's
// header states the rounding).
at::Tensor interleaved_gemm_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                               int64_t k, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(is_q8_kind(kind), "interleaved_gemm_q8: kind must be interleaved Q4_0, Q4_1 or ",
              "Q8_0 (", kQ4_0 | kInterleaved, ", ", kQ4_1 | kInterleaved, ", ",
              kQ8_0 | kInterleaved, "), got ", kind);
  TORCH_CHECK(interleaved_gemm_q8_supported(kind),
              "interleaved_gemm_q8: needs x86 AVX2 or above (running level: ", isa_name(), ")");
  TORCH_CHECK(k > 0 && k % kBlock == 0, "interleaved_gemm_q8: k must be a positive multiple of ",
              kBlock, ", got ", k);
  const int64_t base = kind & ~kInterleaved;
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(),
              "interleaved_gemm_q8: blocks must be a contiguous uint8 [n, row bytes] CPU tensor");
  TORCH_CHECK(blocks.size(1) == k / kBlock * block_bytes_of(base), "interleaved_gemm_q8: blocks ",
              "rows of ", blocks.size(1), " bytes do not hold k = ", k, " weights of kind ", kind);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "interleaved_gemm_q8: x must be a float32 CPU tensor");
  TORCH_CHECK(x.size(-1) == k, "interleaved_gemm_q8: x has ", x.size(-1), " features, k is ", k);
  const int64_t n = blocks.size(0);
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == n,
                "interleaved_gemm_q8: bias must be float32 [", n, "], got ", bias->sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
#if defined(LLMRT_X86)
  q8_gemm(xc.const_data_ptr<float>(), rows, blocks.const_data_ptr<uint8_t>(), blocks.size(1), base,
          k, y.mutable_data_ptr<float>(), n);
#else
  (void)rows;
#endif
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace llmrt_kernels

// LLMRT_Q8_LIBRARY: another op namespace for a standalone build of this file alone.
#if !defined(LLMRT_Q8_LIBRARY)
#define LLMRT_Q8_LIBRARY llmrt_kernels
#endif

TORCH_LIBRARY_FRAGMENT(LLMRT_Q8_LIBRARY, m) {
  m.def("interleaved_gemm_q8(Tensor x, Tensor blocks, int kind, int k, Tensor? bias) -> Tensor");
  m.def("interleaved_gemm_q8_supported(int kind) -> bool",
        &llmrt_kernels::interleaved_gemm_q8_supported);
}

TORCH_LIBRARY_IMPL(LLMRT_Q8_LIBRARY, CPU, m) {
  m.impl("interleaved_gemm_q8", &llmrt_kernels::interleaved_gemm_q8);
}
