// The interleaved layout's decode tiles at the avx_vnni level (declared in
// interleaved_avxvnni.h): AvxVnniTile, InterleavedTile (interleaved_layout.h) over the kernels
// below.
//
// Per 32-byte half group (two blocks) and activation row, AVX2 forms the two levels' integer
// dots with 4 vpmaddubsw, 2 vpaddw, 2 vpmaddwd, a shift and an add; here 4 vpdpbusd and a
// shift: the h level's dots, shifted left 8, are the accumulator the l level's are added to,
// so each lane ends at 256 * (w . h) + (w . l), AVX2's integer (no saturation on either side:
// AVX2's 16-bit pair sums are at most 2 * 2 * 15 * 127). Q8_0 keeps AVX2's |q| x sign(a, q)
// form (vpdpbusd multiplies unsigned by signed), at most 4 * 128 * 127 per lane before the
// shift, so it too gives AVX2's integers. The float steps (per-lane scale, FMA, the m term,
// the horizontal sum) are AVX2's, in its order: results are bit-equal to the avx2 level.
// 16 ymm registers, as at AVX2: 4 activation rows per pass.
#include "interleaved_avxvnni.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "blocks.h"
#include "cpu.h"
#include "interleaved_layout.h"
#include "interleaved_neon.h"  // kInterleavedGroupPrep
#include "prefetch.h"
#include "tiles.h"

namespace llmrt_kernels {
namespace {

constexpr int64_t kGroupPrep = kInterleavedGroupPrep;
// Weight rows one pass over a group's prepared activations serves at one activation row.
constexpr int kRowsM1 = 4;

LLMRT_AVX_VNNI inline __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 256 * (w . h) + (w . l) per lane, for nibbles ``wl`` (elements 0-15 of two blocks) and
// ``wh`` (16-31) against the prepared h and l levels at ``p`` (half ``half`` of the group).
LLMRT_AVX_VNNI inline __m256i q4_two_level(__m256i wl, __m256i wh, const uint8_t* p, int half) {
  __m256i ih = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wl, load256(p + 32 * half));
  ih = _mm256_dpbusd_avx_epi32(ih, wh, load256(p + 64 + 32 * half));
  __m256i iv = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(ih, 8), wl, load256(p + 128 + 32 * half));
  return _mm256_dpbusd_avx_epi32(iv, wh, load256(p + 192 + 32 * half));
}

LLMRT_AVX_VNNI inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// d (lanes 0-3) and m (lanes 4-7; Q4_0: -8 d) of a group's ``c`` blocks (zeros past c).
template <int64_t BASE>
LLMRT_AVX_VNNI inline __m256 group_dm(const uint8_t* o, int64_t c) {
  if (c == 4) {
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 64)));
    const __m128 m = BASE == kQ4_1
                         ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 72)))
                         : _mm_mul_ps(d, _mm_set1_ps(-8.0f));
    return _mm256_set_m128(m, d);
  }
  alignas(16) uint16_t dh[4] = {0, 0, 0, 0}, mh[4] = {0, 0, 0, 0};
  std::memcpy(dh, o + 16 * c, 2 * c);
  if (BASE == kQ4_1) std::memcpy(mh, o + 18 * c, 2 * c);
  const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dh)));
  const __m128 m = BASE == kQ4_1 ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mh)))
                                 : _mm_mul_ps(d, _mm_set1_ps(-8.0f));
  return _mm256_set_m128(m, d);
}

// Quants of blocks [2 * half, 2 * half + 2) of a group of ``c`` (zeros past c; no read past).
LLMRT_AVX_VNNI inline __m256i group_half(const uint8_t* o, int64_t c, int half) {
  const int64_t have = c - 2 * half;
  if (have >= 2) return load256(o + 32 * half);
  if (have == 1)
    return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 32 * half)));
  return _mm256_setzero_si256();
}

// Each lane's block d for half ``half`` of a group (lanes 0-3: block 2 * half, 4-7: the next).
LLMRT_AVX_VNNI inline __m256 half_d(__m256 dm, int half) {
  const __m256 d4 = _mm256_castps128_ps256(_mm256_castps256_ps128(dm));
  return _mm256_permutevar8x32_ps(
      d4, _mm256_setr_epi32(2 * half, 2 * half, 2 * half, 2 * half, 2 * half + 1, 2 * half + 1,
                            2 * half + 1, 2 * half + 1));
}

// One 4-bit group's weights unpacked once for every activation row of a tile.
struct Q4GroupW {
  __m256i wl[2], wh[2];
  __m256 dl[2];
  __m256 dm;
  int halves;
};

template <int64_t BASE>
LLMRT_AVX_VNNI inline Q4GroupW q4_group_unpack(const uint8_t* o, int64_t c) {
  Q4GroupW g;
  const __m256i low = _mm256_set1_epi8(15);
  g.dm = group_dm<BASE>(o, c);
  g.halves = c > 2 ? 2 : 1;
  for (int half = 0; half < g.halves; ++half) {
    const __m256i z = group_half(o, c, half);
    g.wl[half] = _mm256_and_si256(z, low);
    g.wh[half] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    g.dl[half] = half_d(g.dm, half);
  }
  return g;
}

// One unpacked group against one row's prepared group ``p``: scaled integer dots per lane and
// the m term.
LLMRT_AVX_VNNI inline void q4_group_dot(const Q4GroupW& g, const uint8_t* p, __m256& acc,
                                        __m256& macc) {
  for (int half = 0; half < g.halves; ++half) {
    const __m256i iv = q4_two_level(g.wl[half], g.wh[half], p, half);
    const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256) + 8 * half);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(g.dl[half], scale), acc);
  }
  macc = _mm256_fmadd_ps(g.dm, _mm256_loadu_ps(reinterpret_cast<const float*>(p + 320)), macc);
}

// One group (``o``, ``c`` blocks) against one row's prepared group ``p``, unpacked in place:
// the one-row loop's form (as AVX2's, where routing one row through the unpack-once pair
// measured 10-15% slower).
template <int64_t BASE>
LLMRT_AVX_VNNI inline void q4_group(const uint8_t* o, int64_t c, const uint8_t* p, __m256& acc,
                                    __m256& macc) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256 dm = group_dm<BASE>(o, c);
  const int halves = c > 2 ? 2 : 1;
  for (int half = 0; half < halves; ++half) {
    const __m256i z = group_half(o, c, half);
    const __m256i wl = _mm256_and_si256(z, low), wh = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    const __m256i iv = q4_two_level(wl, wh, p, half);
    const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256) + 8 * half);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(half_d(dm, half), scale), acc);
  }
  macc = _mm256_fmadd_ps(dm, _mm256_loadu_ps(reinterpret_cast<const float*>(p + 320)), macc);
}

// R weight rows against one activation row; ``pf`` keeps the chunk's stream requested ahead
// (prefetch.h), a slice per group, since R rows read side by side hide it from the hardware
// prefetcher.
template <int64_t BASE, int R>
LLMRT_AVX_VNNI void q4_rows_m1(const uint8_t* prep, const uint8_t* row, int64_t row_bytes,
                               int64_t nb, float* y, AheadPrefetch& pf) {
  constexpr int64_t gb = 4 * block_bytes_of(BASE);
  const int64_t groups = (nb + 3) / 4;
  const int64_t slice = R * row_bytes / groups;
  __m256 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    pf.upto(row + slice * (gi + 1));
    const int64_t c = std::min<int64_t>(4, nb - 4 * gi);
    const uint8_t* p = prep + gi * kGroupPrep;
    for (int r = 0; r < R; ++r) q4_group<BASE>(row + r * row_bytes + gi * gb, c, p, acc[r], macc[r]);
  }
  for (int r = 0; r < R; ++r) y[r] = hsum8(_mm256_add_ps(acc[r], macc[r]));
}

// MT (<= 4) activation rows against weight rows [n0, n1) of a 4-bit kind.
template <int64_t BASE, int MT>
LLMRT_AVX_VNNI void q4_tile(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                            int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                            int64_t n1) {
  if constexpr (MT == 1) {
    AheadPrefetch pf(w + n0 * row_bytes, w + n1 * row_bytes);
    int64_t n = n0;
    for (; n + kRowsM1 <= n1; n += kRowsM1)
      q4_rows_m1<BASE, kRowsM1>(prep, w + n * row_bytes, row_bytes, nb, y + n, pf);
    for (; n < n1; ++n) q4_rows_m1<BASE, 1>(prep, w + n * row_bytes, row_bytes, nb, y + n, pf);
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

// MT (<= 4) activation rows against Q8_0 weight rows [n0, n1).
template <int MT>
LLMRT_AVX_VNNI void q8_tile(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                            int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                            int64_t n1) {
  const int64_t ng = (nb + 1) / 2;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  AheadPrefetch pf(w + n0 * row_bytes, w + n1 * row_bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if constexpr (MT == 1) pf.upto(row + row_bytes);
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t c = std::min<int64_t>(2, nb - 2 * gi);
      const uint8_t* o = row + gi * 2 * 34;
      for (int64_t i = 0; i < c; ++i) {
        const __m256i q = _mm256_xor_si256(load256(o + 32 * i), flip);
        const __m256i aq = _mm256_abs_epi8(q);
        const __m256 d = _mm256_set1_ps(half_f16c(o + 32 * c + 2 * i));
        for (int r = 0; r < MT; ++r) {
          const uint8_t* p = prep + r * prep_stride + gi * kGroupPrep;
          const __m256i ih = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aq,
                                                     _mm256_sign_epi8(load256(p + 32 * i), q));
          const __m256i iv = _mm256_dpbusd_avx_epi32(
              _mm256_slli_epi32(ih, 8), aq, _mm256_sign_epi8(load256(p + 128 + 32 * i), q));
          const __m256 s = _mm256_mul_ps(
              d, _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256) + 8 * i));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), s, acc[r]);
        }
      }
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = hsum8(acc[r]);
  }
}

// The AVX-VNNI kernels for InterleavedTile: up to 4 activation rows per pass (16 ymm registers).
struct AvxVnniKernels {
  static constexpr int kMaxRows = 4;
  template <int64_t BASE, int MT, typename... Args>
  static void q4(Args... args) { q4_tile<BASE, MT>(args...); }
  template <int MT, typename... Args>
  static void q8(Args... args) { q8_tile<MT>(args...); }
};
using AvxVnniTile = InterleavedTile<AvxVnniKernels>;

}  // namespace

void interleaved_range_avx_vnni(const uint8_t* prep, int64_t prep_stride, int64_t rows_m,
                                const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k,
                                float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const AvxVnniTile tile{base, prep, prep_stride, w, row_bytes, k / kBlock, y, ldy};
  if (rows_m == 1) {  // one pass over the whole chunk, so its prefetch runs ahead across it
    tile.run<1>(0, n0, n1);
    return;
  }
  run_tiles(tile, rows_m, n0, n1, 16);
}

}  // namespace llmrt_kernels

#endif  // x86
