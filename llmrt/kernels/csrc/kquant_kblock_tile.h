// The K-quant GEMV over block-scaled activations (kquants.cpp, "block-scaled activations"),
// included there once per x86 level: the includer defines KB_NS (the namespace), KB_TARGET
// (the functions' target attribute) and KB_ACC(acc, p16, sc) (acc + the int16 pair products
// p16 times the int16 scales sc, summed in pairs into int32: vpmaddwd + vpaddd at AVX2, one
// vpdpwssd at AVX-VNNI). Not a standalone header.

namespace KB_NS {

// Rows [0, RT) of block-prepared x against weight row n.
template <int64_t KIND, int RT>
KB_TARGET void row_tile_kblock(const KBlock* px, int64_t nb, const uint8_t* row, float* y,
                                     int64_t ldy, int64_t n) {
  constexpr int64_t bb = kquant_block_bytes(KIND);
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bb;
    __m256i scv[8];  // group g's scale(s) in every int16 lane (Q6_K: lanes 0-7 and 8-15)
    __m256 mnf0, mnf1;  // the minimum term's per-16 (Q6_K) / per-32 factors
    float dw, dm;
    if constexpr (KIND == kQ6_K) {
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      const __m256i lo2 = _mm256_permute2x128_si256(sc16, sc16, 0x00);
      const __m256i hi2 = _mm256_permute2x128_si256(sc16, sc16, 0x11);
      for (int g = 0; g < 8; ++g) {
        const char a = static_cast<char>(4 * (g % 4)), c = static_cast<char>(a + 2);
        const __m256i mask = _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a,
                                              a + 1, a, a + 1, a, a + 1, c, c + 1, c, c + 1, c,
                                              c + 1, c, c + 1, c, c + 1, c, c + 1, c, c + 1, c, c + 1);
        scv[g] = _mm256_shuffle_epi8(g < 4 ? lo2 : hi2, mask);
      }
      mnf0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8));
      mnf1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)));
      dw = half_f16c(blk + 208);
      dm = 32.0f * dw;
    } else {
      alignas(16) uint8_t sm[16];
      k4_scales_mins(blk, sm, sm + 8);
      const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(v));
      for (int g = 0; g < 8; ++g) {
        const char a = static_cast<char>(2 * g);
        scv[g] = _mm256_shuffle_epi8(sc16, _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1));
      }
      mnf0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
      mnf1 = _mm256_setzero_ps();
      dw = half_f16c(blk);
      dm = half_f16c(blk + 2);
    }
    // The block's quants, two groups per 32-byte load where the bytes give them so.
    __m256i q[8];
    if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
      const uint8_t* qs = blk + (KIND == kQ5_K ? 48 : 16);
      for (int i = 0; i < 4; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
        q[2 * i] = _mm256_and_si256(raw, low);
        q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      }
      if constexpr (KIND == kQ5_K) {
        __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        for (int g = 0; g < 8; ++g) {
          // bit g of each byte, moved to bit 4
          q[g] = _mm256_or_si256(q[g], _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
          qh = _mm256_srli_epi16(qh, 1);
        }
      }
    } else {
      const __m256i three = _mm256_set1_epi8(3);
      for (int h = 0; h < 2; ++h) {
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        for (int t2 = 0; t2 < 2; ++t2) {  // t = t2 and t2 + 2 share a 32-byte ql chunk
          const __m256i lo =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * t2));
          const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * t2), three);
          const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * t2 + 4), three);
          q[4 * h + t2] = _mm256_or_si256(_mm256_and_si256(lo, low), _mm256_slli_epi16(h0, 4));
          q[4 * h + t2 + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), low),
                                              _mm256_slli_epi16(h2, 4));
        }
      }
    }
    for (int r = 0; r < RT; ++r) {
      const KBlock& p = px[r * nb + b];
      __m256i ih = _mm256_setzero_si256(), il = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.h + 32 * g));
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.l + 32 * g));
        ih = KB_ACC(ih, _mm256_maddubs_epi16(q[g], xh), scv[g]);
        il = KB_ACC(il, _mm256_maddubs_epi16(q[g], xl), scv[g]);
      }
      const float dd = dw * p.d;
      __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_set1_ps(dd * 256.0f), acc[r]);
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_set1_ps(dd), a);
      __m256 m;
      if constexpr (KIND == kQ6_K)
        m = _mm256_fmadd_ps(mnf0, _mm256_loadu_ps(p.s16), _mm256_mul_ps(mnf1, _mm256_loadu_ps(p.s16 + 8)));
      else
        m = _mm256_mul_ps(mnf0, _mm256_loadu_ps(p.s32));
      acc[r] = _mm256_fnmadd_ps(m, _mm256_set1_ps(dm * p.d), a);
    }
  }
  // acc holds 256 x the product (d / 256 is the activations' scale)
  for (int r = 0; r < RT; ++r) y[r * ldy + n] = hsum_avx2(acc[r]) * (1.0f / 256.0f);
}

template <int64_t KIND>
KB_TARGET void range_kblock(const uint8_t* prep, int64_t rows_m, const uint8_t* w,
                                  int64_t rb, int64_t k, float* y, int64_t ldy, int64_t n0,
                                  int64_t n1) {
  const int64_t nb = k / kQK;
  const KBlock* px = reinterpret_cast<const KBlock*>(prep);
  llmrt_kernels::AheadPrefetch ahead(w + n0 * rb, w + n1 * rb);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * rb;
    ahead.upto(row + rb);
    int64_t r = 0;
    for (; r + kRowTile <= rows_m; r += kRowTile)
      row_tile_kblock<KIND, kRowTile>(px + r * nb, nb, row, y + r * ldy, ldy, n);
    switch (rows_m - r) {
      case 3: row_tile_kblock<KIND, 3>(px + r * nb, nb, row, y + r * ldy, ldy, n); break;
      case 2: row_tile_kblock<KIND, 2>(px + r * nb, nb, row, y + r * ldy, ldy, n); break;
      case 1: row_tile_kblock<KIND, 1>(px + r * nb, nb, row, y + r * ldy, ldy, n); break;
      default: break;
    }
  }
}
}  // namespace KB_NS
