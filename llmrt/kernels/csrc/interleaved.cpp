// Interleaved ggml blocks and their integer-dot kernels (AVX-512 VNNI).
//
// Why: a float32-activation GEMV over 4-bit blocks spends ~12 vector instructions per 32
// weights turning nibbles into floats, so at two threads it reads weights at ~2/3 of the
// machine's streaming rate. Multiplying the nibbles as they are (vpdpbusd: u8 x s8 -> s32,
// 64 products per instruction) needs the activations as integers and the blocks in a
// layout where one 64-byte load holds whole blocks' quants.
//
// The layout and the activations' two levels: interleaved_layout.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "blocks.h"
#include "cpu.h"
#include "prefetch.h"
#include "interleaved_avxvnni.h"
#include "interleaved_layout.h"
#include "interleaved_neon.h"
#include "linear.h"
#include "tiles.h"

namespace {

using llmrt_kernels::block_at;
using llmrt_kernels::block_bytes_of;
using llmrt_kernels::BlockRef;
using llmrt_kernels::group_of;
using llmrt_kernels::half_at;
#if defined(LLMRT_X86)
using llmrt_kernels::half_f16c;
#endif
using llmrt_kernels::kBlock;
using llmrt_kernels::kQ4_0;
using llmrt_kernels::kQ4_1;
using llmrt_kernels::kQ8_0;
using llmrt_kernels::quant_bytes;
#if defined(LLMRT_X86)
using llmrt_kernels::two_level_block;
#endif

using llmrt_kernels::has_avx512_vnni;

// ---- layout ------------------------------------------------------------------------------

void interleave_row(const uint8_t* src, uint8_t* dst, int64_t base, int64_t nb) {
  const int64_t bb = block_bytes_of(base), g = group_of(base), qb = quant_bytes(base);
  for (int64_t b0 = 0; b0 < nb; b0 += g) {
    const int64_t c = std::min(g, nb - b0);
    uint8_t* o = dst + b0 * bb;
    for (int64_t i = 0; i < c; ++i) {
      const uint8_t* blk = src + (b0 + i) * bb;
      if (base == kQ8_0) {
        for (int64_t j = 0; j < 32; ++j) o[32 * i + j] = blk[2 + j] ^ 0x80;
        std::memcpy(o + 32 * c + 2 * i, blk, 2);
      } else {
        const int64_t head = base == kQ4_1 ? 4 : 2;
        std::memcpy(o + qb * i, blk + head, 16);
        std::memcpy(o + 16 * c + 2 * i, blk, 2);
        if (base == kQ4_1) std::memcpy(o + 18 * c + 2 * i, blk + 2, 2);
      }
    }
  }
}

void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k, float* out,
                  int64_t r0, int64_t r1) {
  const int64_t nb = k / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const BlockRef ref = block_at(row, base, nb, b);
      float* o = out + r * k + b * kBlock;
      if (base == kQ8_0) {
        for (int j = 0; j < 32; ++j) o[j] = ref.d * static_cast<float>(static_cast<int>(ref.q[j]) - 128);
      } else {
        for (int j = 0; j < 16; ++j) {
          o[j] = ref.d * static_cast<float>(ref.q[j] & 15) + ref.m;
          o[j + 16] = ref.d * static_cast<float>(ref.q[j] >> 4) + ref.m;
        }
      }
    }
  }
}

#if defined(LLMRT_X86)
template <int64_t BASE>
LLMRT_VNNI void dequant_rows_avx512(const uint8_t* w, int64_t row_bytes, int64_t k, float* out,
                                    int64_t r0, int64_t r1) {
  const int64_t nb = k / kBlock, g = group_of(BASE), bb = block_bytes_of(BASE), qb = quant_bytes(BASE);
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    float* o = out + r * k;
    for (int64_t b0 = 0; b0 < nb; b0 += g) {
      const int64_t c = std::min(g, nb - b0);
      const uint8_t* grp = row + b0 * bb;
      for (int64_t i = 0; i < c; ++i) {
        const __m512 vd = _mm512_set1_ps(half_at(grp + qb * c + 2 * i));
        const uint8_t* q = grp + qb * i;
        float* ob = o + (b0 + i) * kBlock;
        if constexpr (BASE == kQ8_0) {
          const __m512i bias = _mm512_set1_epi32(128);
          for (int half = 0; half < 2; ++half) {
            const __m128i qv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * half));
            const __m512i iv = _mm512_sub_epi32(_mm512_cvtepu8_epi32(qv), bias);
            _mm512_storeu_ps(ob + 16 * half, _mm512_mul_ps(_mm512_cvtepi32_ps(iv), vd));
          }
        } else {
          const __m512 vm = BASE == kQ4_1 ? _mm512_set1_ps(half_at(grp + 18 * c + 2 * i))
                                          : _mm512_mul_ps(vd, _mm512_set1_ps(-8.0f));
          const __m512 table = _mm512_fmadd_ps(levels, vd, vm);
          const __m128i qv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          _mm512_storeu_ps(ob, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(qv), table));
          _mm512_storeu_ps(ob + 16, _mm512_permutexvar_ps(
                                        _mm512_cvtepu8_epi32(_mm_srli_epi16(qv, 4)), table));
        }
      }
    }
  }
}

// 4-bit blocks straight to bfloat16: the block's 16 levels (d * q + m, float32, one FMA as
// in the float32 dequantize) rounded to bfloat16 once, then looked up per nibble (vpermw),
// 64 bytes of output per block with no float32 row in between.
template <int64_t BASE>
LLMRT_AVX512_BF16 void
dequant_rows_bf16_q4(const uint8_t* w, int64_t row_bytes, int64_t k, uint16_t* out, int64_t r0,
                     int64_t r1) {
  const int64_t nb = k / kBlock, bb = block_bytes_of(BASE);
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i low = _mm256_set1_epi16(15);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    uint16_t* o = out + r * k;
    for (int64_t b0 = 0; b0 < nb; b0 += 4) {
      const int64_t c = std::min<int64_t>(4, nb - b0);
      const uint8_t* grp = row + b0 * bb;
      for (int64_t i = 0; i < c; ++i) {
        const __m512 vd = _mm512_set1_ps(half_at(grp + 16 * c + 2 * i));
        const __m512 vm = BASE == kQ4_1 ? _mm512_set1_ps(half_at(grp + 18 * c + 2 * i))
                                        : _mm512_mul_ps(vd, _mm512_set1_ps(-8.0f));
        const __m512i table = _mm512_castsi256_si512(
            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_fmadd_ps(levels, vd, vm))));
        const __m256i q =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 16 * i)));
        const __m512i idx = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(q, low)), _mm256_srli_epi16(q, 4), 1);
        _mm512_storeu_si512(o + (b0 + i) * kBlock, _mm512_permutexvar_epi16(idx, table));
      }
    }
  }
}

// AVX2: each block's levels as d * q + m in one FMA (the AVX-512 table's rounding); Q8_0 as
// d * (q - 128).
template <int64_t BASE>
LLMRT_AVX2 void dequant_rows_avx2(const uint8_t* w, int64_t row_bytes, int64_t k, float* out,
                                  int64_t r0, int64_t r1) {
  const int64_t nb = k / kBlock;
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const BlockRef ref = block_at(row, BASE, nb, b);
      float* o = out + r * k + b * kBlock;
      const __m256 vd = _mm256_set1_ps(ref.d);
      if constexpr (BASE == kQ8_0) {
        for (int i = 0; i < 4; ++i) {
          const __m256i q = _mm256_sub_epi32(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ref.q + 8 * i))),
              _mm256_set1_epi32(128));
          _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(q)));
        }
      } else {
        const __m256 vm = _mm256_set1_ps(ref.m);
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ref.q));
        const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), vd, vm));
      }
    }
  }
}

#endif  // LLMRT_X86

// ---- activations -------------------------------------------------------------------------

// One row of x prepared for one base kind, per group of G blocks:
//   h[G*32], l[G*32]  int8 levels in the weights' quant order (4-bit: block i's elements
//                     0-15 at 16*i, 16-31 at 64 + 16*i; Q8_0: natural order)
//   scale[16]         float dx / 256 per dot-product lane (lane -> block: 4-bit 4 lanes,
//                     Q8_0 8 lanes)
//   extra[16]         4-bit: float sum of the block's x (for the m term) in lanes 4..4+G-1,
//                     zeros in lanes 0..3 (lined up with the kernel's d, m vector);
//                     Q8_0: int32 128 * (256 * sum h + sum l) in the block's first lane
//                     (removes the +128 of the stored quants)
constexpr int64_t kGroupPrep = 2 * 128 + 64 + 64;
static_assert(kGroupPrep == llmrt_kernels::kInterleavedGroupPrep);

#if defined(LLMRT_X86)
// AVX2, Q8_0: a prepared group's two levels joined into 16-bit activations in place,
// x16 = 256 h + l (|x16| <= 32639; int16, natural order, bytes 0-127), the form the AVX2
// Q8_0 loops multiply with vpmaddwd (the ``q8_avx2`` comment).
LLMRT_AVX2 void join_levels_q8_avx2(uint8_t* p) {
  __m256i x[4];
  for (int q = 0; q < 4; ++q) {
    const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q)));
    const __m256i l =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 128 + 16 * q)));
    x[q] = _mm256_add_epi16(_mm256_slli_epi16(h, 8), l);
  }
  for (int q = 0; q < 4; ++q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32 * q), x[q]);
}

template <bool AVX512>
inline void prepare_row(const float* x, int64_t k, int64_t base, uint8_t* prep) {
  const int64_t nb = k / kBlock, g = group_of(base), ng = (nb + g - 1) / g;
  std::memset(prep, 0, ng * kGroupPrep);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t gi = b / g, i = b % g;
    uint8_t* p = prep + gi * kGroupPrep;
    int8_t* h = reinterpret_cast<int8_t*>(p);
    int8_t* l = reinterpret_cast<int8_t*>(p + 128);
    float* scale = reinterpret_cast<float*>(p + 256);
    const int64_t off0 = base == kQ8_0 ? 32 * i : 16 * i;
    const int64_t off1 = base == kQ8_0 ? 32 * i + 16 : 64 + 16 * i;
    const llmrt_kernels::TwoLevel two =
        AVX512 ? two_level_block(x + b * kBlock, h + off0, l + off0, h + off1, l + off1)
               : llmrt_kernels::two_level_block_avx2(x + b * kBlock, h + off0, l + off0,
                                                     h + off1, l + off1);
    const float dx = two.dx;
    const int32_t sum_h = two.sum_h, sum_l = two.sum_l;
    const int64_t lanes = 16 / g;
    for (int64_t t = 0; t < lanes; ++t) scale[lanes * i + t] = dx / 256.0f;
    if (base == kQ8_0) {
      int32_t* corr = reinterpret_cast<int32_t*>(p + 320);
      corr[lanes * i] = 128 * (256 * sum_h + sum_l);
    } else {
      float* sx = reinterpret_cast<float*>(p + 320);
      sx[4 + i] = dx * (static_cast<float>(sum_h) + static_cast<float>(sum_l) / 256.0f);
    }
  }
  // Only the AVX2 tile reads Q8_0 groups as 16-bit values; AvxVnniTile keeps the two levels.
  if (!AVX512 && base == kQ8_0 && !llmrt_kernels::has_avx_vnni())
    for (int64_t gi = 0; gi < ng; ++gi) join_levels_q8_avx2(prep + gi * kGroupPrep);
}

// ---- kernels -----------------------------------------------------------------------------

inline __mmask64 byte_mask(int64_t n) { return n >= 64 ? ~0ULL : ((1ULL << n) - 1); }

// One group of 4-bit blocks, unpacked once for every activation row it meets: low and high
// nibbles, and each dot-product lane's block scale d (``dm`` holds d in lanes 0-3, m in 4-7).
struct Q4Group {
  __m512i wl, wh;
  __m512 dl;
  __m256 dm;
};

LLMRT_VNNI inline Q4Group q4_unpack(__m512i z, __m256 dm) {
  const __m512i low = _mm512_set1_epi8(15);
  const __m512i lane_block = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return {_mm512_and_si512(z, low), _mm512_and_si512(_mm512_srli_epi16(z, 4), low),
          _mm512_permutexvar_ps(lane_block, _mm512_castps256_ps512(dm)), dm};
}

// A group against one activation row's prepared group (levels ``h0``/``h1`` and ``l0``/``l1``
// for the low and high nibbles, per-lane ``scale``, block sums ``sx``): 4 vpdpbusd chained
// into 256 h + l (no zeroed second accumulator, no add), and the m term as one 256-bit FMA.
LLMRT_VNNI inline void q4_dot(const Q4Group& g, __m512i h0, __m512i h1, __m512i l0, __m512i l1,
                              __m512 scale, __m256 sx, __m512& acc, __m256& macc) {
  __m512i iv = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g.wl, h0);
  iv = _mm512_dpbusd_epi32(iv, g.wh, h1);
  iv = _mm512_dpbusd_epi32(_mm512_slli_epi32(iv, 8), g.wl, l0);
  iv = _mm512_dpbusd_epi32(iv, g.wh, l1);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), _mm512_mul_ps(g.dl, scale), acc);
  macc = _mm256_fmadd_ps(g.dm, sx, macc);
}

// A row's result from its accumulators: the integer-dot lanes plus the m term, summed in one
// fixed order, so the one-row loop and the tile loop give bit-equal outputs.
LLMRT_VNNI inline float q4_row_sum(__m512 acc, __m256 macc) {
  return _mm512_reduce_add_ps(_mm512_add_ps(acc, _mm512_zextps256_ps512(macc)));
}

// Eight rows' results at once (the tile loop at eight activation rows): each row's
// integer-dot lanes plus its m term summed in a shuffle tree shared by the eight, instead of
// eight separate horizontal reductions (~24 vector ops for eight sums against ~72; SmolLM2's
// linears at 16 rows 4-6% faster). Each row's lanes pair up as in ``q4_row_sum``'s
// reduction (halves, quarters, then lanes 0+2 and 1+3), so results stay bit-equal to it.
LLMRT_VNNI inline void q4_row_sums8(const __m512* acc, const __m256* macc, float* out) {
  __m512 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(macc[r]));
  // 256-bit halves: rows (2i, 2i + 1) -> 8 partial sums each.
  __m512 b[4];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  // 128-bit quarters: b[2j], b[2j + 1] -> rows 4j..4j+3, 4 partial sums each.
  __m512 c[2];
  for (int j = 0; j < 2; ++j)
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  // Within 128-bit lanes: lane k holds row k (k = 0..3 from c[0]) then row k + 4 (c[1]).
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44),
                                 _mm512_shuffle_ps(c[0], c[1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d, d, 0x88), _mm512_shuffle_ps(d, d, 0xDD));
  // e's 128-bit lane k: [row k, row k + 4, row k, row k + 4].
  alignas(64) float t[16];
  _mm512_store_ps(t, e);
  for (int k = 0; k < 4; ++k) {
    out[k] = t[4 * k];
    out[k + 4] = t[4 * k + 1];
  }
}

// One group of 4-bit blocks (quants ``z``, ``dm``) against MT activation rows.
template <int MT>
LLMRT_VNNI inline void q4_group(const uint8_t* p, int64_t prep_stride, __m512i z, __m256 dm,
                                __m512* acc, __m256* macc) {
  const Q4Group g = q4_unpack(z, dm);
  for (int r = 0; r < MT; ++r, p += prep_stride)
    q4_dot(g, _mm512_loadu_si512(p), _mm512_loadu_si512(p + 64), _mm512_loadu_si512(p + 128),
           _mm512_loadu_si512(p + 192), _mm512_loadu_ps(reinterpret_cast<const float*>(p + 256)),
           _mm256_loadu_ps(reinterpret_cast<const float*>(p + 320)), acc[r], macc[r]);
}

// d (lanes 0-3) and m (lanes 4-7; Q4_0: -8 d) of a whole group (one load of its scales).
template <int64_t BASE>
LLMRT_VNNI inline __m256 full_group_dm(const uint8_t* o) {
  if constexpr (BASE == kQ4_1) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 64)));
  } else {
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 64)));
    return _mm256_set_m128(_mm_mul_ps(d, _mm_set1_ps(-8.0f)), d);
  }
}

// d (lanes 0-3) and m (lanes 4-7; Q4_0: -8 d) of a group's ``c`` blocks.
template <int64_t BASE>
LLMRT_VNNI inline __m256 group_dm(const uint8_t* o, int64_t c) {
  const __mmask8 m = static_cast<__mmask8>((1u << c) - 1);
  const __m128 d = _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, o + 16 * c));
  const __m128 mv = BASE == kQ4_1 ? _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, o + 18 * c))
                                  : _mm_mul_ps(d, _mm_set1_ps(-8.0f));
  return _mm256_set_m128(mv, d);
}

// Weight rows one pass over a group's prepared activations serves at one activation row.
constexpr int kRowsM1 = 4;

// One activation row against R weight rows of a 4-bit kind (``row`` the first, rows
// ``row_bytes`` apart) into ``y[0..R)``. Why: at one activation row the row-by-row loop loaded
// a group's prepared activations (five vectors) again for every weight row, more load traffic
// than the weights; here they are loaded once per group for R rows. Reading R rows side by
// side hides the stream from the hardware prefetcher (that alone made SmolLM2's batch-1 step
// ~25% slower), so ``pf`` (the thread's chunk) is kept ``kAheadBytes`` ahead, a slice per
// group. Each row's arithmetic is ``q4_dot``, as in the tile loop: results are bit-equal to it.
template <int64_t BASE, int R>
LLMRT_VNNI void q4_rows_m1(const uint8_t* prep, const uint8_t* row, int64_t row_bytes,
                           int64_t nb, float* y, llmrt_kernels::AheadPrefetch& pf) {
  constexpr int64_t gb = 4 * block_bytes_of(BASE);
  const int64_t full = nb / 4, c = nb - 4 * full, groups = full + (c > 0 ? 1 : 0);
  const int64_t slice = R * row_bytes / groups;
  __m512 acc[R];
  __m256 macc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    macc[r] = _mm256_setzero_ps();
  }
  for (int64_t gi = 0; gi < groups; ++gi) {
    pf.upto(row + slice * (gi + 1));
    const uint8_t* p = prep + gi * kGroupPrep;
    const __m512i h0 = _mm512_loadu_si512(p), h1 = _mm512_loadu_si512(p + 64);
    const __m512i l0 = _mm512_loadu_si512(p + 128), l1 = _mm512_loadu_si512(p + 192);
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(p + 256));
    const __m256 sx = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 320));
    for (int r = 0; r < R; ++r) {
      const uint8_t* o = row + r * row_bytes + gi * gb;
      const bool whole = gi < full;
      const __m512i z =
          whole ? _mm512_loadu_si512(o) : _mm512_maskz_loadu_epi8(byte_mask(16 * c), o);
      const __m256 dm = whole ? full_group_dm<BASE>(o) : group_dm<BASE>(o, c);
      q4_dot(q4_unpack(z, dm), h0, h1, l0, l1, scale, sx, acc[r], macc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    y[r] = q4_row_sum(acc[r], macc[r]);
}

// MT activation rows against weight rows [n0, n1) of a 4-bit kind (whole groups with one
// load of their d and m, then the last group of fewer blocks, if any); one activation row
// takes ``q4_rows_m1``.
template <int64_t BASE, int MT>
LLMRT_VNNI void q4_tile(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                        int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                        int64_t n1) {
  if constexpr (MT == 1) {
    llmrt_kernels::AheadPrefetch pf(w + n0 * row_bytes, w + n1 * row_bytes);
    int64_t n = n0;
    for (; n + kRowsM1 <= n1; n += kRowsM1)
      q4_rows_m1<BASE, kRowsM1>(prep, w + n * row_bytes, row_bytes, nb, y + n, pf);
    for (; n < n1; ++n) q4_rows_m1<BASE, 1>(prep, w + n * row_bytes, row_bytes, nb, y + n, pf);
    return;
  }
  constexpr int64_t gb = 4 * block_bytes_of(BASE);
  const int64_t full = nb / 4;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[MT];
    __m256 macc[MT];
    for (int r = 0; r < MT; ++r) {
      acc[r] = _mm512_setzero_ps();
      macc[r] = _mm256_setzero_ps();
    }
    for (int64_t gi = 0; gi < full; ++gi) {
      const uint8_t* o = row + gi * gb;
      q4_group<MT>(prep + gi * kGroupPrep, prep_stride, _mm512_loadu_si512(o),
                   full_group_dm<BASE>(o), acc, macc);
    }
    if (4 * full < nb) {
      const int64_t c = nb - 4 * full;
      const uint8_t* o = row + full * gb;
      q4_group<MT>(prep + full * kGroupPrep, prep_stride,
                   _mm512_maskz_loadu_epi8(byte_mask(16 * c), o), group_dm<BASE>(o, c), acc,
                   macc);
    }
    if constexpr (MT == 8) {
      float sums[8];
      q4_row_sums8(acc, macc, sums);
      for (int r = 0; r < 8; ++r) y[r * ldy + n] = sums[r];
    } else {
      for (int r = 0; r < MT; ++r) y[r * ldy + n] = q4_row_sum(acc[r], macc[r]);
    }
  }
}

template <int MT>
LLMRT_VNNI void q8_tile(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                        int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                        int64_t n1) {
  const __m512i lane_block = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const int64_t ng = (nb + 1) / 2;
  llmrt_kernels::AheadPrefetch pf(w + n0 * row_bytes, w + n1 * row_bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if constexpr (MT == 1) pf.upto(row + row_bytes);
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t c = std::min<int64_t>(2, nb - 2 * gi);
      const uint8_t* o = row + gi * 2 * 34;
      const __m512i z = c == 2 ? _mm512_loadu_si512(o) : _mm512_maskz_loadu_epi8(byte_mask(32), o);
      const __m128 d2 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << c) - 1), o + 32 * c));
      const __m512 dl = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(d2));
      for (int r = 0; r < MT; ++r) {
        const uint8_t* p = prep + r * prep_stride + gi * kGroupPrep;
        const __m512i ih = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, _mm512_loadu_si512(p));
        const __m512i il = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, _mm512_loadu_si512(p + 128));
        const __m512i iv = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(ih, 8), il),
                                            _mm512_loadu_si512(p + 320));
        const __m512 s = _mm512_mul_ps(dl, _mm512_loadu_ps(reinterpret_cast<const float*>(p + 256)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), s, acc[r]);
      }
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

// The VNNI kernels for InterleavedTile (interleaved_layout.h): 8 activation rows per pass.
struct VnniKernels {
  static constexpr int kMaxRows = 8;
  template <int64_t BASE, int MT, typename... Args>
  static void q4(Args... args) { q4_tile<BASE, MT>(args...); }
  template <int MT, typename... Args>
  static void q8(Args... args) { q8_tile<MT>(args...); }
};
using VnniTile = llmrt_kernels::InterleavedTile<VnniKernels>;

// ---- AVX2 (+FMA, F16C): the same layout, 256 bits at a time ---------------------------
//
// 4-bit: the prepared activations as they are; vpmaddubsw (u8 x s8 -> pairs summed to s16)
// then vpmaddwd (-> s32, 4 bytes per lane), as ggml's AVX2 quant dots do. A lane's four bytes
// belong to one block, so each half of a 4-bit group (two blocks, 32 bytes) lines up with 8
// of the prepared 16 per-lane scales. The low and high nibbles' s16 pair sums are added
// before widening (each at most 2 * 15 * 127, the sum fits s16). Q8_0: the two levels joined
// into 16 bits at preparation and 16-bit products (``q8_block_avx2``).

LLMRT_AVX2 inline __m256i dot_u4(__m256i wl, __m256i wh, const uint8_t* a_lo, const uint8_t* a_hi,
                                 __m256i widen) {
  const __m256i p = _mm256_add_epi16(
      _mm256_maddubs_epi16(wl, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a_lo))),
      _mm256_maddubs_epi16(wh, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a_hi))));
  return _mm256_madd_epi16(p, widen);
}

// The widening multipliers of the two levels: the high level's pair sums times 256 in the
// same vpmaddwd that widens them (the exact integer ``(sum << 8)`` was, one shift fewer per
// 64 weights), the low level's times 1.
LLMRT_AVX2 inline __m256i widen_high() { return _mm256_set1_epi16(256); }
LLMRT_AVX2 inline __m256i widen_low() { return _mm256_set1_epi16(1); }

LLMRT_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ``c`` (1-3) fp16 values at ``p`` in the low words of a vector, zeros above, read with loads
// of exactly their bytes into a general register. Why not a copy into a zeroed stack array and
// a vector load: the load spans the copy's narrower stores and waits out a failed store
// forward, for every weight row's last group (SmolLM2's 576-wide linears: ~20% of the
// one-row kernel's samples).
inline __m128i halves_of(const uint8_t* p, int64_t c) {
  uint32_t lo = 0;
  uint16_t hi = 0;
  if (c >= 2) {
    std::memcpy(&lo, p, 4);
    if (c == 3) std::memcpy(&hi, p + 4, 2);
  } else {
    uint16_t one;
    std::memcpy(&one, p, 2);
    lo = one;
  }
  return _mm_cvtsi64_si128(static_cast<long long>((static_cast<uint64_t>(hi) << 32) | lo));
}

// d (lanes 0-3) and m (lanes 4-7; Q4_0: -8 d) of a group's ``c`` blocks (zeros past c).
template <int64_t BASE>
LLMRT_AVX2 inline __m256 group_dm_avx2(const uint8_t* o, int64_t c) {
  if (c == 4) {
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 64)));
    const __m128 m = BASE == kQ4_1
                         ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 72)))
                         : _mm_mul_ps(d, _mm_set1_ps(-8.0f));
    return _mm256_set_m128(m, d);
  }
  const __m128 d = _mm_cvtph_ps(halves_of(o + 16 * c, c));
  const __m128 m = BASE == kQ4_1 ? _mm_cvtph_ps(halves_of(o + 18 * c, c))
                                 : _mm_mul_ps(d, _mm_set1_ps(-8.0f));
  return _mm256_set_m128(m, d);
}

// Quants of blocks [2 * half, 2 * half + 2) of a group of ``c`` (zeros past c; no read past).
LLMRT_AVX2 inline __m256i group_half(const uint8_t* o, int64_t c, int half) {
  const int64_t have = c - 2 * half;
  if (have >= 2) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32 * half));
  if (have == 1)
    return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 32 * half)));
  return _mm256_setzero_si256();
}

// One group of 4-bit blocks (``o``, ``c`` blocks, ``dm``) against one row's prepared group
// ``p``: integer dots per lane, scaled per lane, and the m term.
LLMRT_AVX2 inline void q4_group_avx2(const uint8_t* o, int64_t c, __m256 dm, const uint8_t* p,
                                     __m256& acc, __m256& macc) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256 d4 = _mm256_castps128_ps256(_mm256_castps256_ps128(dm));
  const int halves = c > 2 ? 2 : 1;
  for (int half = 0; half < halves; ++half) {
    const __m256i z = group_half(o, c, half);
    const __m256i wl = _mm256_and_si256(z, low), wh = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    const __m256i ih = dot_u4(wl, wh, p + 32 * half, p + 64 + 32 * half, widen_high());
    const __m256i il = dot_u4(wl, wh, p + 128 + 32 * half, p + 192 + 32 * half, widen_low());
    const __m256i iv = _mm256_add_epi32(ih, il);
    // lanes 0-3: block 2 * half, 4-7: block 2 * half + 1
    const __m256 dl = _mm256_permutevar8x32_ps(
        d4, _mm256_setr_epi32(2 * half, 2 * half, 2 * half, 2 * half, 2 * half + 1, 2 * half + 1,
                              2 * half + 1, 2 * half + 1));
    const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256) + 8 * half);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(dl, scale), acc);
  }
  macc = _mm256_fmadd_ps(dm, _mm256_loadu_ps(reinterpret_cast<const float*>(p + 320)), macc);
}

// A 4-bit group's weights unpacked once for all the activation rows of a tile (nibbles split,
// per-lane d and m), then dotted with each row's prepared group: the same operations in the
// same order as ``q4_group_avx2``, so the same bits, without unpacking per row. The one-row
// loop keeps ``q4_group_avx2``: routed through this pair it measured 10-15% slower (forced
// avx2, one thread, SmolLM2 shapes), and one row gains nothing from the hoisting.
struct Q4GroupW {
  __m256i wl[2], wh[2];
  __m256 dl[2];
  __m256 dm;
  int halves;
};

template <int64_t BASE>
LLMRT_AVX2 inline Q4GroupW q4_group_unpack(const uint8_t* o, int64_t c) {
  Q4GroupW g;
  const __m256i low = _mm256_set1_epi8(15);
  g.dm = group_dm_avx2<BASE>(o, c);
  const __m256 d4 = _mm256_castps128_ps256(_mm256_castps256_ps128(g.dm));
  g.halves = c > 2 ? 2 : 1;
  for (int half = 0; half < g.halves; ++half) {
    const __m256i z = group_half(o, c, half);
    g.wl[half] = _mm256_and_si256(z, low);
    g.wh[half] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    g.dl[half] = _mm256_permutevar8x32_ps(
        d4, _mm256_setr_epi32(2 * half, 2 * half, 2 * half, 2 * half, 2 * half + 1, 2 * half + 1,
                              2 * half + 1, 2 * half + 1));
  }
  return g;
}

LLMRT_AVX2 inline void q4_group_dot(const Q4GroupW& g, const uint8_t* p, __m256& acc,
                                    __m256& macc) {
  for (int half = 0; half < g.halves; ++half) {
    const __m256i ih =
        dot_u4(g.wl[half], g.wh[half], p + 32 * half, p + 64 + 32 * half, widen_high());
    const __m256i il = dot_u4(g.wl[half], g.wh[half], p + 128 + 32 * half, p + 192 + 32 * half, widen_low());
    const __m256i iv = _mm256_add_epi32(ih, il);
    const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256) + 8 * half);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(g.dl[half], scale), acc);
  }
  macc = _mm256_fmadd_ps(g.dm, _mm256_loadu_ps(reinterpret_cast<const float*>(p + 320)), macc);
}

// One whole group (4 blocks) of a 4-bit kind against one row's prepared group ``p``: the
// operations of ``q4_group_avx2`` at c = 4 in the same order (so the same bits), with the
// block count known to the compiler. Why: with ``c`` a run-time value GCC kept the R rows'
// accumulators of ``q4_rows_m1_avx2`` on the stack (a load and a store around every FMA, the
// halves' loop not unrolled); SmolLM2's Q4_1 GEMV ran at 9.4-9.6 GB/s from L2, one thread.
template <int64_t BASE>
LLMRT_AVX2 __attribute__((always_inline)) inline void q4_full_group_avx2(const uint8_t* o,
                                                                         const uint8_t* p,
                                                                         __m256& acc,
                                                                         __m256& macc) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256 dm = group_dm_avx2<BASE>(o, 4);
  const __m256 d4 = _mm256_castps128_ps256(_mm256_castps256_ps128(dm));
  for (int half = 0; half < 2; ++half) {
    const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32 * half));
    const __m256i wl = _mm256_and_si256(z, low), wh = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    const __m256i ih = dot_u4(wl, wh, p + 32 * half, p + 64 + 32 * half, widen_high());
    const __m256i il = dot_u4(wl, wh, p + 128 + 32 * half, p + 192 + 32 * half, widen_low());
    const __m256i iv = _mm256_add_epi32(ih, il);
    const __m256 dl = _mm256_permutevar8x32_ps(
        d4, half == 0 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)
                      : _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
    const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256) + 8 * half);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(dl, scale), acc);
  }
  macc = _mm256_fmadd_ps(dm, _mm256_loadu_ps(reinterpret_cast<const float*>(p + 320)), macc);
}

// R weight rows against one activation row (the prepared groups loaded from L1 per row;
// ``pf`` keeps the chunk's stream requested ahead, as in ``q4_rows_m1``): whole groups
// through ``q4_full_group_avx2`` (accumulators in registers), the last group of fewer
// blocks, if any, through ``q4_group_avx2``.
template <int64_t BASE, int R>
LLMRT_AVX2 void q4_rows_m1_avx2(const uint8_t* prep, const uint8_t* row, int64_t row_bytes,
                                int64_t nb, float* y, llmrt_kernels::AheadPrefetch& pf) {
  constexpr int64_t gb = 4 * block_bytes_of(BASE);
  const int64_t full = nb / 4, c = nb - 4 * full, groups = full + (c > 0 ? 1 : 0);
  const int64_t slice = R * row_bytes / groups;
  __m256 acc[R], macc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < full; ++gi) {
    pf.upto(row + slice * (gi + 1));
    const uint8_t* p = prep + gi * kGroupPrep;
    const uint8_t* o = row + gi * gb;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) q4_full_group_avx2<BASE>(o + r * row_bytes, p, acc[r], macc[r]);
  }
  if (c > 0) {
    pf.upto(row + R * row_bytes);
    const uint8_t* p = prep + full * kGroupPrep;
    for (int r = 0; r < R; ++r) {
      const uint8_t* o = row + r * row_bytes + full * gb;
      q4_group_avx2(o, c, group_dm_avx2<BASE>(o, c), p, acc[r], macc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) y[r] = hsum8(_mm256_add_ps(acc[r], macc[r]));
}

// MT (<= 4) activation rows against weight rows [n0, n1) of a 4-bit kind.
template <int64_t BASE, int MT>
LLMRT_AVX2 void q4_tile_avx2(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                             int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                             int64_t n1) {
  if constexpr (MT == 1) {
    llmrt_kernels::AheadPrefetch pf(w + n0 * row_bytes, w + n1 * row_bytes);
    int64_t n = n0;
    for (; n + kRowsM1 <= n1; n += kRowsM1)
      q4_rows_m1_avx2<BASE, kRowsM1>(prep, w + n * row_bytes, row_bytes, nb, y + n, pf);
    for (; n < n1; ++n) q4_rows_m1_avx2<BASE, 1>(prep, w + n * row_bytes, row_bytes, nb, y + n, pf);
    return;
  }
  constexpr int64_t gb = 4 * block_bytes_of(BASE);
  const int64_t groups = (nb + 3) / 4;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MT], macc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t c = std::min<int64_t>(4, nb - 4 * gi);
      const Q4GroupW g = q4_group_unpack<BASE>(row + gi * gb, c);
      for (int r = 0; r < MT; ++r)
        q4_group_dot(g, prep + r * prep_stride + gi * kGroupPrep, acc[r], macc[r]);
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = hsum8(_mm256_add_ps(acc[r], macc[r]));
  }
}

// Q8_0 at AVX2 (``q8_avx2``): the activations joined into 16 bits at preparation
// (``join_levels_q8_avx2``) and the weights widened to 16 bits (the stored q + 128 less
// 128), so one vpmaddwd per 16 weights takes both levels, where vpmaddubsw took each level
// separately after vpsignb/vpabsb (the products' sign moved onto the activations) and a
// vpmaddwd widened each. Each lane's sum (4 products, |q| <= 128, |x16| <= 32639: below 2^24)
// converts to float32 exactly. A block's weights as two 16-lane vectors:
struct Q8Wide {
  __m256i w0, w1;
};

LLMRT_AVX2 inline Q8Wide q8_widen(const uint8_t* q) {
  const __m256i bias = _mm256_set1_epi16(128);
  return {_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), bias),
          _mm256_sub_epi16(
              _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))), bias)};
}

// One Q8_0 block (widened weights, scale ``d``) against one row's prepared block (``p`` the
// group's, ``i`` the block in it), into ``acc``.
LLMRT_AVX2 __attribute__((always_inline)) inline void q8_block_avx2(const Q8Wide& w, __m256 d,
                                                                    const uint8_t* p, int64_t i,
                                                                    __m256& acc) {
  const __m256i* x = reinterpret_cast<const __m256i*>(p + 64 * i);
  const __m256i iv = _mm256_add_epi32(_mm256_madd_epi16(w.w0, _mm256_loadu_si256(x)),
                                      _mm256_madd_epi16(w.w1, _mm256_loadu_si256(x + 1)));
  const __m256 s = _mm256_mul_ps(d, _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256) + 8 * i));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), s, acc);
}

// R Q8_0 weight rows against one activation row, whole groups (2 blocks, both scales in one
// conversion) with the accumulators in registers, then the last lone block: the same
// operations in the same order as ``q8_tile_avx2``'s, so the same bits. Why: that loop,
// one row at a time with ``c`` a run-time value and each scale converted in scalar code, read
// the Q8_0 LM head at ~9 GB/s (one thread, forced avx2).
template <int R>
LLMRT_AVX2 void q8_rows_m1_avx2(const uint8_t* prep, const uint8_t* row, int64_t row_bytes,
                                int64_t nb, float* y, llmrt_kernels::AheadPrefetch& pf) {
  const int64_t full = nb / 2, groups = full + (nb % 2);
  const int64_t slice = R * row_bytes / groups;
  __m256 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < full; ++gi) {
    pf.upto(row + slice * (gi + 1));
    const uint8_t* p = prep + gi * kGroupPrep;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* o = row + r * row_bytes + gi * 68;
      uint32_t dd;
      std::memcpy(&dd, o + 64, 4);
      const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dd)));
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        const __m256 d = _mm256_broadcastss_ps(i == 0 ? d2 : _mm_movehdup_ps(d2));
        q8_block_avx2(q8_widen(o + 32 * i), d, p, i, acc[r]);
      }
    }
  }
  if (full < groups) {
    pf.upto(row + R * row_bytes);
    const uint8_t* p = prep + full * kGroupPrep;
    for (int r = 0; r < R; ++r) {
      const uint8_t* o = row + r * row_bytes + full * 68;
      q8_block_avx2(q8_widen(o), _mm256_set1_ps(half_f16c(o + 32)), p, 0, acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) y[r] = hsum8(acc[r]);
}

// MT (<= 4) activation rows against Q8_0 weight rows [n0, n1) (one row: ``q8_rows_m1_avx2``).
template <int MT>
LLMRT_AVX2 void q8_tile_avx2(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                             int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                             int64_t n1) {
  if constexpr (MT == 1) {
    llmrt_kernels::AheadPrefetch pf(w + n0 * row_bytes, w + n1 * row_bytes);
    int64_t n = n0;
    for (; n + kRowsM1 <= n1; n += kRowsM1)
      q8_rows_m1_avx2<kRowsM1>(prep, w + n * row_bytes, row_bytes, nb, y + n, pf);
    for (; n < n1; ++n) q8_rows_m1_avx2<1>(prep, w + n * row_bytes, row_bytes, nb, y + n, pf);
    return;
  }
  const int64_t ng = (nb + 1) / 2;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t c = std::min<int64_t>(2, nb - 2 * gi);
      const uint8_t* o = row + gi * 2 * 34;
      for (int64_t i = 0; i < c; ++i) {
        const Q8Wide wq = q8_widen(o + 32 * i);
        const __m256 d = _mm256_set1_ps(half_f16c(o + 32 * c + 2 * i));
        for (int r = 0; r < MT; ++r)
          q8_block_avx2(wq, d, prep + r * prep_stride + gi * kGroupPrep, i, acc[r]);
      }
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = hsum8(acc[r]);
  }
}

// The AVX2 kernels for InterleavedTile: up to 4 activation rows per pass (16 ymm registers).
struct Avx2Kernels {
  static constexpr int kMaxRows = 4;
  template <int64_t BASE, int MT, typename... Args>
  static void q4(Args... args) { q4_tile_avx2<BASE, MT>(args...); }
  template <int MT, typename... Args>
  static void q8(Args... args) { q8_tile_avx2<MT>(args...); }
};
using Avx2Tile = llmrt_kernels::InterleavedTile<Avx2Kernels>;

LLMRT_VNNI void prepare_row_avx512(const float* x, int64_t k, int64_t base, uint8_t* prep) {
  prepare_row<true>(x, k, base, prep);
}
LLMRT_AVX2 void prepare_row_avx2(const float* x, int64_t k, int64_t base, uint8_t* prep) {
  prepare_row<false>(x, k, base, prep);
}
#endif  // LLMRT_X86

// Without VNNI: dequantize a weight row and take float32 dot products (a layout the
// automatic choice never picks on such CPUs; kept so the layout runs everywhere).
void portable_rows(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes,
                   int64_t base, int64_t k, float* y, int64_t n, int64_t n0, int64_t n1) {
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t j = n0; j < n1; ++j) {
    dequant_rows(w + j * row_bytes, row_bytes, base, k, row.data(), 0, 1);
    for (int64_t r = 0; r < rows_m; ++r) {
      float s = 0.0f;
      for (int64_t i = 0; i < k; ++i) s += row[i] * x[r * k + i];
      y[r * n + j] = s;
    }
  }
}

}  // namespace

namespace llmrt_kernels {

int64_t interleaved_prep_bytes(int64_t base, int64_t k) {
  if (!llmrt_kernels::has_avx2() && !llmrt_kernels::has_neon()) return 0;
  const int64_t nb = k / kBlock;
  return (nb + group_of(base) - 1) / group_of(base) * kGroupPrep;
}

void interleaved_prepare(const float* x, int64_t r0, int64_t r1, int64_t base, int64_t k,
                         uint8_t* prep) {
  const int64_t per_row = interleaved_prep_bytes(base, k);
  if (per_row == 0) return;
#if defined(LLMRT_X86)
  const bool vnni = has_avx512_vnni();
  for (int64_t r = r0; r < r1; ++r) {
    if (vnni)
      prepare_row_avx512(x + r * k, k, base, prep + r * per_row);
    else
      prepare_row_avx2(x + r * k, k, base, prep + r * per_row);
  }
#elif defined(LLMRT_ARM64)
  for (int64_t r = r0; r < r1; ++r)
    llmrt_kernels::interleaved_prepare_row_neon(x + r * k, k, base, prep + r * per_row);
#else
  (void)x;
  (void)r0;
  (void)r1;
#endif
}

void interleaved_range(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes,
                       int64_t base, int64_t k, const uint8_t* prep, float* y, int64_t n,
                       int64_t n0, int64_t n1) {
#if defined(LLMRT_ARM64)
  if (llmrt_kernels::has_neon()) {  // interleaved_neon.cpp: neon, dotprod, i8mm
    llmrt_kernels::interleaved_range_neon(prep, interleaved_prep_bytes(base, k), rows_m, w,
                                          row_bytes, base, k, y, n, n0, n1);
    return;
  }
#endif
  if (!llmrt_kernels::has_avx2()) {
    portable_rows(x, rows_m, w, row_bytes, base, k, y, n, n0, n1);
    return;
  }
#if defined(LLMRT_X86)
  if (!has_avx512_vnni() && llmrt_kernels::has_avx_vnni()) {  // interleaved_avxvnni.cpp
    llmrt_kernels::interleaved_range_avx_vnni(prep, interleaved_prep_bytes(base, k), rows_m, w,
                                              row_bytes, base, k, y, n, n0, n1);
    return;
  }
  if (!has_avx512_vnni()) {
    const Avx2Tile tile{base, prep, interleaved_prep_bytes(base, k), w, row_bytes, k / kBlock, y, n};
    if (rows_m == 1) {
      tile.run<1>(0, n0, n1);
      return;
    }
    llmrt_kernels::run_tiles(tile, rows_m, n0, n1, 16);
    return;
  }
  const VnniTile tile{base, prep, interleaved_prep_bytes(base, k), w, row_bytes, k / kBlock, y, n};
  if (rows_m == 1) {  // one pass over the whole chunk, so its prefetch runs ahead across it
    tile.run<1>(0, n0, n1);
    return;
  }
  llmrt_kernels::run_tiles(tile, rows_m, n0, n1, 16);
#else
  (void)prep;
#endif
}

bool interleaved_dequantize_bf16(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k,
                                 uint16_t* out, int64_t rows) {
#if defined(LLMRT_X86)
  static const bool ok = llmrt_kernels::has_avx512_bf16();
  if (!ok || base == kQ8_0) return false;
  llmrt_kernels::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    if (base == kQ4_0)
      dequant_rows_bf16_q4<kQ4_0>(w, row_bytes, k, out, r0, r1);
    else
      dequant_rows_bf16_q4<kQ4_1>(w, row_bytes, k, out, r0, r1);
  });
  return true;
#else
  (void)w, (void)row_bytes, (void)base, (void)k, (void)out, (void)rows;
  return false;
#endif
}

void interleaved_dequantize(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k,
                            float* out, int64_t rows) {
  const bool simd = llmrt_kernels::has_avx512(), avx2 = llmrt_kernels::has_avx2();
  llmrt_kernels::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
#if defined(LLMRT_X86)
    if (!simd && avx2) {
      switch (base) {
        case kQ4_0: dequant_rows_avx2<kQ4_0>(w, row_bytes, k, out, r0, r1); break;
        case kQ4_1: dequant_rows_avx2<kQ4_1>(w, row_bytes, k, out, r0, r1); break;
        default: dequant_rows_avx2<kQ8_0>(w, row_bytes, k, out, r0, r1); break;
      }
      return;
    }
    if (simd) {
      switch (base) {
        case kQ4_0: dequant_rows_avx512<kQ4_0>(w, row_bytes, k, out, r0, r1); break;
        case kQ4_1: dequant_rows_avx512<kQ4_1>(w, row_bytes, k, out, r0, r1); break;
        default: dequant_rows_avx512<kQ8_0>(w, row_bytes, k, out, r0, r1); break;
      }
      return;
    }
#else
    (void)simd;
    (void)avx2;
#endif
    dequant_rows(w, row_bytes, base, k, out, r0, r1);
  });
}

}  // namespace llmrt_kernels

namespace {

at::Tensor gguf_interleave(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  llmrt_kernels::check_weight(blocks, kind, in_features);
  TORCH_CHECK(!(kind & llmrt_kernels::kInterleaved),
              "llmrt_kernels: the blocks are interleaved already (kind ", kind, ")");
  TORCH_CHECK(kind != llmrt_kernels::kDenseF32, "llmrt_kernels: only ggml blocks interleave");
  at::Tensor out = at::empty(blocks.sizes(), blocks.options());
  const int64_t rows = blocks.size(0), rb = blocks.size(1), nb = in_features / kBlock;
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  // Up to 32 MiB on the calling thread (formats.SERIAL_COPY_BYTES): a parallel region wakes
  // torch's team, a scheduler time slice per call where other work holds the cores.
  const int64_t grain = std::max<int64_t>(64, (int64_t{32} << 20) / std::max<int64_t>(rb, 1));
  llmrt_kernels::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) interleave_row(src + r * rb, dst + r * rb, kind, nb);
  });
  return out;
}

// The decode kernels' integer dots: AVX2 (maddubs), AVX-512 VNNI (dpbusd) or arm64 NEON.
bool int8_dot_supported_op() { return llmrt_kernels::has_avx2() || llmrt_kernels::has_neon(); }
// Whether the many-row integer GEMM (interleaved_gemm.cpp) beats dequantize + float32 GEMM at
// every row count: AVX-512 VNNI. The AVX2 one runs from kInterleavedGemmMinRowsAvx2 rows but
// loses to MKL's sgemm from ~128 rows, where the Python policy dequantizes instead; arm64 has
// none yet (prefill dequantizes there).
bool integer_gemm_supported_op() { return has_avx512_vnni(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("gguf_interleave(Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("int8_dot_supported() -> bool", &int8_dot_supported_op);
  m.def("integer_gemm_supported() -> bool", &integer_gemm_supported_op);
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) { m.impl("gguf_interleave", &gguf_interleave); }
