// The interleaved layout's integer-dot kernels for arm64 (declared in interleaved_neon.h).
//
// The sums are the x86 tiles' (interleaved.cpp): per 32-wide block, 256 * (w . h) + (w . l)
// as exact integers, scaled once by the block's d and dx / 256, plus the m (or -8 d) term
// against the prepared sum of x. Only how the integer dot products are formed differs:
//   neon     smull/smlal of 8 bytes into 16-bit sums, sadalp into 32-bit lanes (4-bit weights:
//            four products of at most 15 * 127 per 16-bit lane; Q8_0: two of at most
//            128 * 127, so neither overflows)
//   dotprod  sdot: four int8 products into each 32-bit lane
//   i8mm     smmla for two activation rows against two weight rows (Q4_0, Q4_1 and Q8_0):
//            each 16-byte half block of both weight rows, and of both activation rows,
//            zipped into 2x8 matrices
//            (llama.cpp's repack does the weights' zip once at load; here both sides are
//            zipped in registers, so the layout stays the one every level shares)
// Q8_0's stored quants carry +128; they are flipped back to int8 here, so its prepared
// correction term is not used.
#include "interleaved_neon.h"

#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "blocks.h"
#include "cpu.h"
#include "interleaved_layout.h"
#include "neon_dot.h"
#include "prefetch.h"
#include "tiles.h"

namespace llmrt_kernels {
namespace {

// ---- activations -------------------------------------------------------------------------

// two_level_block (interleaved_layout.h) in NEON: the same roundings (nearest, ties to even)
// in the same order, so the same bytes.
inline TwoLevel two_level_block_neon(const float* x, int8_t* h0, int8_t* l0, int8_t* h1,
                                     int8_t* l1) {
  float32x4_t v[8];
  for (int i = 0; i < 8; ++i) v[i] = vld1q_f32(x + 4 * i);
  float32x4_t m = vabsq_f32(v[0]);
  for (int i = 1; i < 8; ++i) m = vmaxq_f32(m, vabsq_f32(v[i]));
  const float amax = vmaxvq_f32(m);
  const float32x4_t inv = vdupq_n_f32(amax > 0.0f ? 127.0f / amax : 0.0f);
  int32x4_t hi[8], li[8];
  int32x4_t sh = vdupq_n_s32(0), sl = vdupq_n_s32(0);
  for (int i = 0; i < 8; ++i) {
    const float32x4_t s = vmulq_f32(v[i], inv);
    const float32x4_t hv = vrndnq_f32(s);
    const float32x4_t lv =
        vminq_f32(vmaxq_f32(vrndnq_f32(vmulq_f32(vsubq_f32(s, hv), vdupq_n_f32(256.0f))),
                            vdupq_n_f32(-127.0f)),
                  vdupq_n_f32(127.0f));
    hi[i] = vcvtq_s32_f32(hv);
    li[i] = vcvtq_s32_f32(lv);
    sh = vaddq_s32(sh, hi[i]);
    sl = vaddq_s32(sl, li[i]);
  }
  auto pack = [](const int32x4_t* a) {
    const int16x8_t lo = vcombine_s16(vqmovn_s32(a[0]), vqmovn_s32(a[1]));
    const int16x8_t hi16 = vcombine_s16(vqmovn_s32(a[2]), vqmovn_s32(a[3]));
    return vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi16));
  };
  vst1q_s8(h0, pack(hi));
  vst1q_s8(h1, pack(hi + 4));
  vst1q_s8(l0, pack(li));
  vst1q_s8(l1, pack(li + 4));
  return {amax / 127.0f, vaddvq_s32(sh), vaddvq_s32(sl)};
}

// ---- the integer dot products: neon_dot.h; i8mm's matrix multiply -----------------------

// (mmla and zip_rows: neon_dot.h)

// ---- weights -----------------------------------------------------------------------------

// fp16 values at p (n <= 4 of them; the rest 0) as float32.
inline float32x4_t halves4(const uint8_t* p, int64_t n) {
  uint16_t h[4] = {0, 0, 0, 0};
  std::memcpy(h, p, 2 * n);
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
}

// One group of a 4-bit row: the c <= 4 blocks' low and high nibbles (missing blocks 0) and
// their d and m (Q4_0: -8 d) as vectors over the blocks.
struct Q4Group {
  int8x16_t wl[4], wh[4];
  float32x4_t d, m;
};

template <int64_t BASE>
inline Q4Group q4_group(const uint8_t* o, int64_t c) {
  Q4Group g;
  const uint8x16_t low = vdupq_n_u8(15);
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t q = i < c ? vld1q_u8(o + 16 * i) : vdupq_n_u8(0);
    g.wl[i] = vreinterpretq_s8_u8(vandq_u8(q, low));
    g.wh[i] = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
  }
  g.d = halves4(o + 16 * c, c);
  g.m = BASE == kQ4_1 ? halves4(o + 18 * c, c) : vmulq_n_f32(g.d, -8.0f);
  return g;
}

// acc += one group of one prepared activation row against a 4-bit group.
template <typename Dot>
inline float32x4_t q4_group_dot(const Q4Group& g, const uint8_t* p, float32x4_t acc) {
  const int8_t* h = reinterpret_cast<const int8_t*>(p);
  const int8_t* l = reinterpret_cast<const int8_t*>(p + 128);
  int32x4_t iv[4];
  for (int i = 0; i < 4; ++i) {
    const int32x4_t z = vdupq_n_s32(0);
    const int32x4_t ih = Dot::dot2(z, g.wl[i], vld1q_s8(h + 16 * i), g.wh[i], vld1q_s8(h + 64 + 16 * i));
    const int32x4_t il = Dot::dot2(z, g.wl[i], vld1q_s8(l + 16 * i), g.wh[i], vld1q_s8(l + 64 + 16 * i));
    iv[i] = vaddq_s32(vshlq_n_s32(ih, 8), il);
  }
  const int32x4_t sums = vpaddq_s32(vpaddq_s32(iv[0], iv[1]), vpaddq_s32(iv[2], iv[3]));
  const float* f = reinterpret_cast<const float*>(p + 256);
  const float32x4_t scale = vld4q_f32(f).val[0];  // dx / 256 of blocks 0..3 (lanes 0, 4, 8, 12)
  acc = vfmaq_f32(acc, vcvtq_f32_s32(sums), vmulq_f32(g.d, scale));
  return vfmaq_f32(acc, g.m, vld1q_f32(reinterpret_cast<const float*>(p + 320) + 4));
}

template <typename Dot, int64_t BASE, int MT>
inline void q4_tile(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                    int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                    int64_t n1) {
  constexpr int64_t gb = 4 * block_bytes_of(BASE);
  const int64_t groups = (nb + 3) / 4;
  AheadPrefetch pf(w + n0 * row_bytes, w + n1 * row_bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float32x4_t acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t gi = 0; gi < groups; ++gi) {
      if constexpr (MT == 1) pf.upto(row + gi * gb);
      const Q4Group g = q4_group<BASE>(row + gi * gb, std::min<int64_t>(4, nb - 4 * gi));
      for (int r = 0; r < MT; ++r)
        acc[r] = q4_group_dot<Dot>(g, prep + r * prep_stride + gi * kInterleavedGroupPrep, acc[r]);
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = vaddvq_f32(acc[r]);
  }
}

template <typename Dot, int MT>
inline void q8_tile(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                    int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                    int64_t n1) {
  const int64_t ng = (nb + 1) / 2;
  const uint8x16_t flip = vdupq_n_u8(0x80);
  AheadPrefetch pf(w + n0 * row_bytes, w + n1 * row_bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float32x4_t acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t c = std::min<int64_t>(2, nb - 2 * gi);
      const uint8_t* o = row + gi * 2 * 34;
      if constexpr (MT == 1) pf.upto(o);
      int8x16_t q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = i < 2 * c ? vreinterpretq_s8_u8(veorq_u8(vld1q_u8(o + 16 * i), flip)) : vdupq_n_s8(0);
      const float32x4_t d = halves4(o + 32 * c, c);  // lanes: block 0, block 1, 0, 0
      const float32x4_t d2 = vzip1q_f32(d, d);        // block 0, block 0, block 1, block 1
      for (int r = 0; r < MT; ++r) {
        const uint8_t* p = prep + r * prep_stride + gi * kInterleavedGroupPrep;
        const int8_t* h = reinterpret_cast<const int8_t*>(p);
        const int8_t* l = reinterpret_cast<const int8_t*>(p + 128);
        int32x4_t iv[2];
        for (int i = 0; i < 2; ++i) {
          const int32x4_t z = vdupq_n_s32(0);
          const int32x4_t ih = Dot::dot(Dot::dot(z, q[2 * i], vld1q_s8(h + 32 * i)), q[2 * i + 1],
                                        vld1q_s8(h + 32 * i + 16));
          const int32x4_t il = Dot::dot(Dot::dot(z, q[2 * i], vld1q_s8(l + 32 * i)), q[2 * i + 1],
                                        vld1q_s8(l + 32 * i + 16));
          iv[i] = vaddq_s32(vshlq_n_s32(ih, 8), il);
        }
        // lanes: block 0 (two partial sums), block 1 (two partial sums)
        const int32x4_t sums = vpaddq_s32(iv[0], iv[1]);
        const float* f = reinterpret_cast<const float*>(p + 256);
        const float32x4_t scale = {f[0], f[0], f[8], f[8]};
        acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(sums), vmulq_f32(d2, scale));
      }
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = vaddvq_f32(acc[r]);
  }
}

// ---- i8mm: two activation rows x two weight rows ------------------------------------------

// 4-bit weight rows n, n + 1 against activation rows r, r + 1 (pairs of prepared rows at
// pa, pb): lanes of the result are (r, n), (r, n + 1), (r + 1, n), (r + 1, n + 1).
template <int64_t BASE>
LLMRT_I8MM inline float32x4_t q4_pair(const uint8_t* wa, const uint8_t* wb, int64_t nb,
                                      const uint8_t* pa, const uint8_t* pb) {
  constexpr int64_t gb = 4 * block_bytes_of(BASE);
  const int64_t groups = (nb + 3) / 4;
  float32x4_t acc = vdupq_n_f32(0.0f);
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t c = std::min<int64_t>(4, nb - 4 * gi);
    const Q4Group ga = q4_group<BASE>(wa + gi * gb, c), gw = q4_group<BASE>(wb + gi * gb, c);
    const uint8_t* qa = pa + gi * kInterleavedGroupPrep;
    const uint8_t* qb = pb + gi * kInterleavedGroupPrep;
    const float* fa = reinterpret_cast<const float*>(qa + 256);
    const float* fb = reinterpret_cast<const float*>(qb + 256);
    for (int i = 0; i < c; ++i) {
      int8x16_t w[4], a[4];
      zip_rows(ga.wl[i], gw.wl[i], w[0], w[1]);
      zip_rows(ga.wh[i], gw.wh[i], w[2], w[3]);
      int32x4_t ih = vdupq_n_s32(0), il = vdupq_n_s32(0);
      for (int lvl = 0; lvl < 2; ++lvl) {
        const int8_t* ha = reinterpret_cast<const int8_t*>(qa + 128 * lvl);
        const int8_t* hb = reinterpret_cast<const int8_t*>(qb + 128 * lvl);
        zip_rows(vld1q_s8(ha + 16 * i), vld1q_s8(hb + 16 * i), a[0], a[1]);
        zip_rows(vld1q_s8(ha + 64 + 16 * i), vld1q_s8(hb + 64 + 16 * i), a[2], a[3]);
        int32x4_t& s = lvl == 0 ? ih : il;
        for (int j = 0; j < 4; ++j) s = mmla(s, a[j], w[j]);
      }
      const int32x4_t iv = vaddq_s32(vshlq_n_s32(ih, 8), il);
      float dw[4], sw[4];
      vst1q_f32(dw, ga.d);
      vst1q_f32(sw, gw.d);
      const float32x4_t dv = {dw[i], sw[i], dw[i], sw[i]};
      const float32x4_t sv = {fa[4 * i], fa[4 * i], fb[4 * i], fb[4 * i]};
      acc = vfmaq_f32(acc, vcvtq_f32_s32(iv), vmulq_f32(dv, sv));
    }
    // the m terms: row r's sums against both weight rows, then row r + 1's
    const float32x4_t sxa = vld1q_f32(reinterpret_cast<const float*>(qa + 320) + 4);
    const float32x4_t sxb = vld1q_f32(reinterpret_cast<const float*>(qb + 320) + 4);
    const float32x4_t m_ra = vmulq_f32(ga.m, sxa), m_rb = vmulq_f32(gw.m, sxa);
    const float32x4_t m_sa = vmulq_f32(ga.m, sxb), m_sb = vmulq_f32(gw.m, sxb);
    const float32x4_t mt = {vaddvq_f32(m_ra), vaddvq_f32(m_rb), vaddvq_f32(m_sa), vaddvq_f32(m_sb)};
    acc = vaddq_f32(acc, mt);
  }
  return acc;
}

template <int64_t BASE, int MT>
LLMRT_I8MM void q4_tile_i8mm(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                             int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                             int64_t n1) {
  static_assert(MT % 2 == 0, "smmla pairs activation rows");
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint8_t* wa = w + n * row_bytes;
    for (int r = 0; r < MT; r += 2) {
      const float32x4_t v = q4_pair<BASE>(wa, wa + row_bytes, nb, prep + r * prep_stride,
                                          prep + (r + 1) * prep_stride);
      y[r * ldy + n] = vgetq_lane_f32(v, 0);
      y[r * ldy + n + 1] = vgetq_lane_f32(v, 1);
      y[(r + 1) * ldy + n] = vgetq_lane_f32(v, 2);
      y[(r + 1) * ldy + n + 1] = vgetq_lane_f32(v, 3);
    }
  }
  if (n < n1) q4_tile<DotprodDot, BASE, MT>(prep, prep_stride, w, row_bytes, nb, y, ldy, n, n1);
}

// Q8_0 weight rows n, n + 1 (int8 after the flip) against activation rows r, r + 1: the
// same lanes as q4_pair. Per block, each level's two 16-byte halves of both weight rows and
// both activation rows zipped into smmla's 2x8 operands; the levels joined as 256 h + l in
// integers (at most 32 * 128 * 127 * 257, far inside int32) and scaled once per block.
LLMRT_I8MM inline float32x4_t q8_pair(const uint8_t* wa, const uint8_t* wb, int64_t nb,
                                      const uint8_t* pa, const uint8_t* pb) {
  const int64_t ng = (nb + 1) / 2;
  const uint8x16_t flip = vdupq_n_u8(0x80);
  float32x4_t acc = vdupq_n_f32(0.0f);
  for (int64_t gi = 0; gi < ng; ++gi) {
    const int64_t c = std::min<int64_t>(2, nb - 2 * gi);
    const uint8_t* oa = wa + gi * 2 * 34;
    const uint8_t* ob = wb + gi * 2 * 34;
    const uint8_t* qa = pa + gi * kInterleavedGroupPrep;
    const uint8_t* qb = pb + gi * kInterleavedGroupPrep;
    const float* fa = reinterpret_cast<const float*>(qa + 256);
    const float* fb = reinterpret_cast<const float*>(qb + 256);
    float da[4], db[4];
    vst1q_f32(da, halves4(oa + 32 * c, c));
    vst1q_f32(db, halves4(ob + 32 * c, c));
    for (int i = 0; i < c; ++i) {
      int8x16_t w[4];
      for (int j = 0; j < 2; ++j)
        zip_rows(vreinterpretq_s8_u8(veorq_u8(vld1q_u8(oa + 32 * i + 16 * j), flip)),
                 vreinterpretq_s8_u8(veorq_u8(vld1q_u8(ob + 32 * i + 16 * j), flip)), w[2 * j],
                 w[2 * j + 1]);
      int32x4_t ih = vdupq_n_s32(0), il = vdupq_n_s32(0);
      for (int lvl = 0; lvl < 2; ++lvl) {
        const int8_t* ha = reinterpret_cast<const int8_t*>(qa + 128 * lvl + 32 * i);
        const int8_t* hb = reinterpret_cast<const int8_t*>(qb + 128 * lvl + 32 * i);
        int32x4_t& s = lvl == 0 ? ih : il;
        for (int j = 0; j < 2; ++j) {
          int8x16_t a0, a1;
          zip_rows(vld1q_s8(ha + 16 * j), vld1q_s8(hb + 16 * j), a0, a1);
          s = mmla(mmla(s, a0, w[2 * j]), a1, w[2 * j + 1]);
        }
      }
      const int32x4_t iv = vaddq_s32(vshlq_n_s32(ih, 8), il);
      const float32x4_t dv = {da[i], db[i], da[i], db[i]};
      const float32x4_t sv = {fa[8 * i], fa[8 * i], fb[8 * i], fb[8 * i]};
      acc = vfmaq_f32(acc, vcvtq_f32_s32(iv), vmulq_f32(dv, sv));
    }
  }
  return acc;
}

template <int MT>
LLMRT_I8MM void q8_tile_i8mm(const uint8_t* prep, int64_t prep_stride, const uint8_t* w,
                             int64_t row_bytes, int64_t nb, float* y, int64_t ldy, int64_t n0,
                             int64_t n1) {
  static_assert(MT % 2 == 0, "smmla pairs activation rows");
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint8_t* wa = w + n * row_bytes;
    for (int r = 0; r < MT; r += 2) {
      const float32x4_t v = q8_pair(wa, wa + row_bytes, nb, prep + r * prep_stride,
                                    prep + (r + 1) * prep_stride);
      y[r * ldy + n] = vgetq_lane_f32(v, 0);
      y[r * ldy + n + 1] = vgetq_lane_f32(v, 1);
      y[(r + 1) * ldy + n] = vgetq_lane_f32(v, 2);
      y[(r + 1) * ldy + n + 1] = vgetq_lane_f32(v, 3);
    }
  }
  if (n < n1) q8_tile<DotprodDot, MT>(prep, prep_stride, w, row_bytes, nb, y, ldy, n, n1);
}

// ---- entry points per level --------------------------------------------------------------

// Each level's entry is flattened (LLMRT_FLATTEN, neon_dot.h): the baseline entry never
// contains sdot/smmla, and the others never call them.

// The NEON kernels for InterleavedTile (interleaved_layout.h) with ``Dot``'s integer dots.
template <typename Dot>
struct NeonKernels {
  static constexpr int kMaxRows = 8;
  template <int64_t BASE, int MT, typename... Args>
  static void q4(Args... args) { q4_tile<Dot, BASE, MT>(args...); }
  template <int MT, typename... Args>
  static void q8(Args... args) { q8_tile<Dot, MT>(args...); }
};
template <typename Dot>
using NeonTile = llmrt_kernels::InterleavedTile<NeonKernels<Dot>>;

LLMRT_FLATTEN void range_neon(const NeonTile<NeonDot>& tile, int64_t rows_m, int64_t n0, int64_t n1) {
  if (rows_m == 1) return tile.run<1>(0, n0, n1);
  run_tiles(tile, rows_m, n0, n1, 16);
}

LLMRT_DOTPROD LLMRT_FLATTEN void range_dotprod(const NeonTile<DotprodDot>& tile, int64_t rows_m, int64_t n0,
                                 int64_t n1) {
  if (rows_m == 1) return tile.run<1>(0, n0, n1);
  run_tiles(tile, rows_m, n0, n1, 16);
}

// i8mm: even row tiles through smmla (Q4_0, Q4_1, Q8_0), odd ones as at dotprod.
struct I8mmTile {
  NeonTile<DotprodDot> dot;

  template <int MT>
  LLMRT_I8MM void run(int64_t r, int64_t c0, int64_t c1) const {
    if constexpr (MT % 2 == 0) {
      const uint8_t* p = dot.prep + r * dot.prep_stride;
      float* yr = dot.y + r * dot.ldy;
      if (dot.base == kQ8_0) {
        q8_tile_i8mm<MT>(p, dot.prep_stride, dot.w, dot.row_bytes, dot.nb, yr, dot.ldy, c0, c1);
        return;
      }
      if (dot.base == kQ4_0)
        q4_tile_i8mm<kQ4_0, MT>(p, dot.prep_stride, dot.w, dot.row_bytes, dot.nb, yr, dot.ldy, c0, c1);
      else
        q4_tile_i8mm<kQ4_1, MT>(p, dot.prep_stride, dot.w, dot.row_bytes, dot.nb, yr, dot.ldy, c0, c1);
      return;
    }
    dot.template run<MT>(r, c0, c1);
  }
};

LLMRT_I8MM LLMRT_FLATTEN void range_i8mm(const I8mmTile& tile, int64_t rows_m, int64_t n0, int64_t n1) {
  if (rows_m == 1) return tile.dot.run<1>(0, n0, n1);
  run_tiles(tile, rows_m, n0, n1, 16);
}

}  // namespace

void interleaved_prepare_row_neon(const float* x, int64_t k, int64_t base, uint8_t* prep) {
  const int64_t nb = k / kBlock, g = group_of(base), ng = (nb + g - 1) / g;
  std::memset(prep, 0, ng * kInterleavedGroupPrep);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t gi = b / g, i = b % g;
    uint8_t* p = prep + gi * kInterleavedGroupPrep;
    int8_t* h = reinterpret_cast<int8_t*>(p);
    int8_t* l = reinterpret_cast<int8_t*>(p + 128);
    float* scale = reinterpret_cast<float*>(p + 256);
    const int64_t off0 = base == kQ8_0 ? 32 * i : 16 * i;
    const int64_t off1 = base == kQ8_0 ? 32 * i + 16 : 64 + 16 * i;
    const TwoLevel two = two_level_block_neon(x + b * kBlock, h + off0, l + off0, h + off1, l + off1);
    const int64_t lanes = 16 / g;
    for (int64_t t = 0; t < lanes; ++t) scale[lanes * i + t] = two.dx / 256.0f;
    if (base == kQ8_0) {
      reinterpret_cast<int32_t*>(p + 320)[lanes * i] = 128 * (256 * two.sum_h + two.sum_l);
    } else {
      reinterpret_cast<float*>(p + 320)[4 + i] =
          two.dx * (static_cast<float>(two.sum_h) + static_cast<float>(two.sum_l) / 256.0f);
    }
  }
}

void interleaved_range_neon(const uint8_t* prep, int64_t prep_stride, int64_t rows_m,
                            const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k,
                            float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = k / kBlock;
  if (has_i8mm()) {
    range_i8mm(I8mmTile{{base, prep, prep_stride, w, row_bytes, nb, y, ldy}}, rows_m, n0, n1);
  } else if (has_dotprod()) {
    range_dotprod({base, prep, prep_stride, w, row_bytes, nb, y, ldy}, rows_m, n0, n1);
  } else {
    range_neon({base, prep, prep_stride, w, row_bytes, nb, y, ldy}, rows_m, n0, n1);
  }
}

}  // namespace llmrt_kernels

#endif  // __aarch64__
