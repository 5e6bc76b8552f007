// One pre-norm decoder layer of a decode step on the CPU, as a single op.
//
// Why: a decode step at batch 1 moves ~2 MB of weights per layer, which takes ~0.1 ms; run as
// ~60 eager torch ops, the same layer costs ~0.5 ms of dispatch. This op does the whole layer
// (RMSNorm, fused q/k/v, RoPE, paged K/V write, grouped-query attention over the row's pages,
// output projection, residual, RMSNorm, gated or plain MLP, residual) with the shared linear
// kernels (ggml blocks or dense float32) and no allocations besides its scratch.
//
// Semantics follow llmrt/families/paged_attention.py for one query per row:
// - a row writes its K/V at ``positions[r]`` through ``page_table[r]`` unless the position is
//   negative, past the table, or on a ``-1`` page;
// - it attends to keys 0..max(pos, 0) (clipped to the table's span), within ``window`` most
//   recent positions when ``window`` > 0; a ``-1`` page reads block 0 (only padding rows do).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <thread>
#include <memory>
#include <tuple>
#include <utility>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cpu.h"
#include "layer_norm.h"
#include "linear.h"
#include "rms_norm.h"
#include "vecmath.h"

namespace {

using llmrt_kernels::activate;
using llmrt_kernels::has_avx512;
using llmrt_kernels::kSilu;
#if defined(LLMRT_X86)
using llmrt_kernels::exp512;
using llmrt_kernels::lanes;
using llmrt_kernels::load16;
#endif
using llmrt_kernels::NormRef;
using llmrt_kernels::norm_rows;
using llmrt_kernels::has_avx2;

// Rotate the leading ``rot`` channels of one head by the row's tables (rotate-half convention).
void rope_head(float* v, const float* cos, const float* sin, int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t c = 0; c < half; ++c) {
    const float a = v[c];
    const float b = v[c + half];
    v[c] = a * cos[c] - b * sin[c];
    v[c + half] = b * cos[c + half] + a * sin[c + half];
  }
}

#if defined(LLMRT_X86)
template <typename T>
LLMRT_AVX512 float dot_avx512(const float* a, const T* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + j), load16(b + j, m), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// y += w * x
template <typename T>
LLMRT_AVX512 void axpy_avx512(float w, const T* x, float* y, int64_t n) {
  const __m512 vw = _mm512_set1_ps(w);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    _mm512_mask_storeu_ps(y + j, m,
                          _mm512_fmadd_ps(vw, load16(x + j, m), _mm512_maskz_loadu_ps(m, y + j)));
  }
}

// s[t] = exp(s[t] - top); returns the sum.
LLMRT_AVX512 float exp_shift_sum_avx512(float* s, int64_t n, float top) {
  const __m512 shift = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, e);
    total = _mm512_add_ps(total, e);
  }
  if (t < n) {
    const __mmask16 tail = lanes(n - t);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), shift));
    _mm512_mask_storeu_ps(s + t, tail, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
  }
  return _mm512_reduce_add_ps(total);
}

// a[j] = silu(g[j]) * u[j] (u == nullptr: silu(g[j])), 16 lanes at a time.
LLMRT_AVX512 void silu_avx512(const float* g, const float* u, float* a, int64_t n) {
  int64_t j = 0;
  for (; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(m, g + j);
    __m512 out = llmrt_kernels::silu512(v);
    if (u != nullptr) out = _mm512_mul_ps(out, _mm512_maskz_loadu_ps(m, u + j));
    _mm512_mask_storeu_ps(a + j, m, out);
  }
}

template <typename T>
LLMRT_AVX2 float dot_avx2(const float* a, const T* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), llmrt_kernels::load8(b + j), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), llmrt_kernels::load8(b + j + 8), acc1);
  }
  for (; j + 8 <= n; j += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), llmrt_kernels::load8(b + j), acc0);
  if (j < n)
    acc1 = _mm256_fmadd_ps(llmrt_kernels::load8_tail(a + j, n - j),
                           llmrt_kernels::load8_tail(b + j, n - j), acc1);
  return llmrt_kernels::hadd8(_mm256_add_ps(acc0, acc1));
}

template <typename T>
LLMRT_AVX2 void axpy_avx2(float w, const T* x, float* y, int64_t n) {
  const __m256 vw = _mm256_set1_ps(w);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(y + j, _mm256_fmadd_ps(vw, llmrt_kernels::load8(x + j), _mm256_loadu_ps(y + j)));
  for (; j < n; ++j) y[j] += w * static_cast<float>(x[j]);
}

LLMRT_AVX2 float exp_shift_sum_avx2(float* s, int64_t n, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = llmrt_kernels::exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = llmrt_kernels::hadd8(total);
  if (t < n) {
    alignas(32) float buf[8];
    const __m256 e = llmrt_kernels::exp256(
        _mm256_sub_ps(llmrt_kernels::load8_tail(s + t, n - t), shift));
    _mm256_store_ps(buf, e);
    for (int64_t i = 0; i < n - t; ++i) {
      s[t + i] = buf[i];
      sum += buf[i];
    }
  }
  return sum;
}

#endif  // LLMRT_X86

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
#if defined(LLMRT_X86)
  if (has_avx512()) return dot_avx512(a, b, n);
  if (has_avx2()) return dot_avx2(a, b, n);
#endif
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) s += a[j] * static_cast<float>(b[j]);
  return s;
}

template <typename T>
inline void axpy(float w, const T* x, float* y, int64_t n) {
#if defined(LLMRT_X86)
  if (has_avx512()) {
    axpy_avx512(w, x, y, n);
    return;
  }
  if (has_avx2()) {
    axpy_avx2(w, x, y, n);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) y[j] += w * static_cast<float>(x[j]);
}

template <typename T>
struct Paged {
  T* k;
  T* v;
  int64_t s0, s1, s2;  // strides of [block, head, offset] (the last dim is contiguous)
  int64_t block_size;
  const int64_t* table;  // [rows, width] as int64
  int64_t width;
};

// The keys from ``key`` on that share its page (at most ``left``): returns how many, and sets
// ``at`` to the element offset of ``key``'s row for KV head ``g`` (into ``kv.k`` or ``kv.v``;
// a ``-1`` page reads block 0). Consecutive keys of a run are ``kv.s2`` elements apart.
template <typename T>
inline int64_t page_run(const Paged<T>& kv, const int64_t* row_table, int64_t g, int64_t key,
                        int64_t left, int64_t& at) {
  const int64_t page = key / kv.block_size;
  const int64_t off = key - page * kv.block_size;
  const int64_t block = std::max<int64_t>(row_table[page], 0);
  at = block * kv.s0 + g * kv.s1 + off * kv.s2;
  return std::min(kv.block_size - off, left);
}

#if defined(LLMRT_X86)
// One row's attention for one KV head with head_dim = 16 * NV (AVX-512): keys are walked
// page by page (no division per key), each key's K is loaded once for all the group's
// query heads, and the outputs of up to GC heads accumulate in registers over the values.
// Same math as the generic loop: scaled dot products, max-shifted exp, normalised weights.
template <typename T, int NV, int GC>
LLMRT_AVX512 void weigh_values(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                               int64_t first, int64_t count, const float* scores,
                               int64_t score_stride, float* out, int64_t head_dim) {
  __m512 acc[GC][NV];
  for (int j = 0; j < GC; ++j)
    for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t t = 0, n = 0; t < count; t += n) {
    int64_t at;
    n = page_run(kv, row_table, g, first + t, count - t, at);
    const T* vp = kv.v + at;
    for (int64_t i = 0; i < n; ++i, vp += kv.s2) {
      __m512 v[NV];
      for (int c = 0; c < NV; ++c) v[c] = load16(vp + 16 * c, static_cast<__mmask16>(0xFFFF));
      for (int j = 0; j < GC; ++j) {
        const __m512 w = _mm512_set1_ps(scores[j * score_stride + t + i]);
        for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_fmadd_ps(w, v[c], acc[j][c]);
      }
    }
  }
  for (int j = 0; j < GC; ++j)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + j * head_dim + 16 * c, acc[j][c]);
}

// Keys the scoring loop requests ahead of the one it reads, and the values of the key it reads
// (weigh_values reads them after the softmax). Why: a head's keys are contiguous only within a
// page, so the hardware prefetchers restart at every page; without this, SmolLM2's attention
// at 512 keys took 1.35-1.40 ms of a batch-1 step and 0.89-0.99 ms with it (per-phase timing,
// 2-core Emerald Rapids); 4, 8 and 16 keys ahead gave 5.39, 5.40, 5.20 against 5.84 ms steps.
constexpr int64_t kKeysAhead = 16;

// Requests the lines of ``n`` K or V rows of one head (``row_bytes`` each, ``stride``
// elements apart).
template <typename T>
inline void prefetch_keys(const T* p, int64_t n, int64_t stride, int64_t row_bytes) {
  for (int64_t i = 0; i < n; ++i, p += stride)
    for (int64_t off = 0; off < row_bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p) + off, 0, 3);
}

template <typename T, int NV>
LLMRT_AVX512 void score_keys(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                             int64_t first, int64_t count, const float* q, int64_t group,
                             float scale, float* scores) {
  const int64_t head_dim = 16 * NV;
  constexpr int64_t kRowBytes = 16 * NV * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0, n = 0; t < count; t += n) {
    int64_t at;
    n = page_run(kv, row_table, g, first + t, count - t, at);
    const T* kp = kv.k + at;
    const T* vp = kv.v + at;
    if (t == 0) prefetch_keys(kp, std::min(kKeysAhead, n), kv.s2, kRowBytes);
    if (t + n < count) {  // the next page's first keys, on their way by this run's end
      int64_t next_at;
      const int64_t m = page_run(kv, row_table, g, first + t + n, count - t - n, next_at);
      prefetch_keys(kv.k + next_at, std::min(kKeysAhead, m), kv.s2, kRowBytes);
    }
    for (int64_t i = 0; i < n; ++i, kp += kv.s2, vp += kv.s2) {
      if (i + kKeysAhead < n) prefetch_keys(kp + kKeysAhead * kv.s2, 1, kv.s2, kRowBytes);
      prefetch_keys(vp, 1, kv.s2, kRowBytes);  // read by weigh_values after the softmax
      __m512 k[NV];
      for (int c = 0; c < NV; ++c) k[c] = load16(kp + 16 * c, static_cast<__mmask16>(0xFFFF));
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = q + j * head_dim;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qj), k[0]);
        for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), k[c], a);
        scores[j * count + t + i] = _mm512_reduce_add_ps(a) * scale;
      }
    }
  }
}

template <typename T, int NV>
LLMRT_AVX512 void attend_task_avx512(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                                     int64_t first, int64_t count, const float* q,
                                     int64_t group, float scale, float* out,
                                     std::vector<float>& scores, float* stats) {
  constexpr int kMaxHeads = NV <= 4 ? 4 : 2;  // output registers: kMaxHeads * NV <= 16
  const int64_t head_dim = 16 * NV;
  scores.resize(static_cast<size_t>(group * count));
  float* s = scores.data();
  score_keys<T, NV>(kv, row_table, g, first, count, q, group, scale, s);
  for (int64_t j = 0; j < group; ++j) {
    float* sj = s + j * count;
    const float top = *std::max_element(sj, sj + count);
    const float total = exp_shift_sum_avx512(sj, count, top);
    if (stats != nullptr) {
      stats[2 * j] = top;
      stats[2 * j + 1] = total;
    }
    const float inv = 1.0f / total;
    const __m512 vinv = _mm512_set1_ps(inv);
    int64_t t = 0;
    for (; t + 16 <= count; t += 16)
      _mm512_storeu_ps(sj + t, _mm512_mul_ps(_mm512_loadu_ps(sj + t), vinv));
    for (; t < count; ++t) sj[t] *= inv;
  }
  for (int64_t j0 = 0; j0 < group; j0 += kMaxHeads) {
    const float* sj = s + j0 * count;
    float* oj = out + j0 * head_dim;
    switch (std::min<int64_t>(kMaxHeads, group - j0)) {
      case 4: weigh_values<T, NV, 4>(kv, row_table, g, first, count, sj, count, oj, head_dim); break;
      case 3: weigh_values<T, NV, 3>(kv, row_table, g, first, count, sj, count, oj, head_dim); break;
      case 2: weigh_values<T, NV, 2>(kv, row_table, g, first, count, sj, count, oj, head_dim); break;
      default: weigh_values<T, NV, 1>(kv, row_table, g, first, count, sj, count, oj, head_dim); break;
    }
  }
}


// ---- the same attention in AVX2 (head_dim a multiple of 8, at most kMaxDimAvx2) ----------
//
// Why: without it an AVX2 CPU ran the generic loop, a page lookup (a division) per key and
// per head, and an axpy per key and query head that loaded and stored the head's whole output
// row; SmolLM2's attention took ~9% of a forced-avx2 batch-1 step at 128 keys (0.9 ms of
// 9.8 ms, one thread) against ~6% in AVX-512.
constexpr int64_t kMaxDimAvx2 = 256;

template <typename T>
LLMRT_AVX2 void score_keys_avx2(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                                int64_t first, int64_t count, const float* q, int64_t group,
                                int64_t head_dim, float scale, float* scores) {
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
  alignas(32) float k[kMaxDimAvx2];
  for (int64_t t = 0, n = 0; t < count; t += n) {
    int64_t at;
    n = page_run(kv, row_table, g, first + t, count - t, at);
    const T* kp = kv.k + at;
    const T* vp = kv.v + at;
    if (t == 0) prefetch_keys(kp, std::min(kKeysAhead, n), kv.s2, row_bytes);
    if (t + n < count) {
      int64_t next_at;
      const int64_t m = page_run(kv, row_table, g, first + t + n, count - t - n, next_at);
      prefetch_keys(kv.k + next_at, std::min(kKeysAhead, m), kv.s2, row_bytes);
    }
    for (int64_t i = 0; i < n; ++i, kp += kv.s2, vp += kv.s2) {
      if (i + kKeysAhead < n) prefetch_keys(kp + kKeysAhead * kv.s2, 1, kv.s2, row_bytes);
      prefetch_keys(vp, 1, kv.s2, row_bytes);  // read by weigh_values_avx2 after the softmax
      // The key once as float32 (L1), then every query head of the group against it.
      for (int64_t c = 0; c < head_dim; c += 8) _mm256_store_ps(k + c, llmrt_kernels::load8(kp + c));
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = q + j * head_dim;
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qj), _mm256_load_ps(k));
        __m256 a1 = _mm256_setzero_ps();
        int64_t c = 8;
        for (; c + 16 <= head_dim; c += 16) {
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c), _mm256_load_ps(k + c), a1);
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c + 8), _mm256_load_ps(k + c + 8), a0);
        }
        if (c < head_dim) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c), _mm256_load_ps(k + c), a1);
        scores[j * count + t + i] = llmrt_kernels::hadd8(_mm256_add_ps(a0, a1)) * scale;
      }
    }
  }
}

// Columns [c0, c0 + 8 * CV) of GC query heads' outputs: the softmax-weighted values, in
// registers over the keys (each value loaded once for the GC heads).
template <typename T, int CV, int GC>
LLMRT_AVX2 void weigh_values_avx2(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                                  int64_t first, int64_t count, const float* scores,
                                  int64_t score_stride, float* out, int64_t head_dim,
                                  int64_t c0) {
  __m256 acc[GC][CV];
  for (int j = 0; j < GC; ++j)
    for (int c = 0; c < CV; ++c) acc[j][c] = _mm256_setzero_ps();
  for (int64_t t = 0, n = 0; t < count; t += n) {
    int64_t at;
    n = page_run(kv, row_table, g, first + t, count - t, at);
    const T* vp = kv.v + at + c0;
    for (int64_t i = 0; i < n; ++i, vp += kv.s2) {
      __m256 v[CV];
      for (int c = 0; c < CV; ++c) v[c] = llmrt_kernels::load8(vp + 8 * c);
      for (int j = 0; j < GC; ++j) {
        const __m256 w = _mm256_broadcast_ss(scores + j * score_stride + t + i);
        for (int c = 0; c < CV; ++c) acc[j][c] = _mm256_fmadd_ps(w, v[c], acc[j][c]);
      }
    }
  }
  for (int j = 0; j < GC; ++j)
    for (int c = 0; c < CV; ++c) _mm256_storeu_ps(out + j * head_dim + c0 + 8 * c, acc[j][c]);
}

template <typename T, int GC>
LLMRT_AVX2 void weigh_heads_avx2(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                                 int64_t first, int64_t count, const float* scores,
                                 int64_t score_stride, float* out, int64_t head_dim) {
  int64_t c0 = 0;
  for (; c0 + 32 <= head_dim; c0 += 32)
    weigh_values_avx2<T, 4, GC>(kv, row_table, g, first, count, scores, score_stride, out,
                                head_dim, c0);
  for (; c0 < head_dim; c0 += 8)
    weigh_values_avx2<T, 1, GC>(kv, row_table, g, first, count, scores, score_stride, out,
                                head_dim, c0);
}

// ``attend_task_avx512`` in AVX2: scores, max-shifted exp, normalised weights, values.
template <typename T>
LLMRT_AVX2 void attend_task_avx2(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                                 int64_t first, int64_t count, const float* q, int64_t group,
                                 int64_t head_dim, float scale, float* out,
                                 std::vector<float>& scores, float* stats) {
  scores.resize(static_cast<size_t>(group * count));
  float* s = scores.data();
  score_keys_avx2<T>(kv, row_table, g, first, count, q, group, head_dim, scale, s);
  for (int64_t j = 0; j < group; ++j) {
    float* sj = s + j * count;
    const float top = *std::max_element(sj, sj + count);
    const float total = exp_shift_sum_avx2(sj, count, top);
    if (stats != nullptr) {
      stats[2 * j] = top;
      stats[2 * j + 1] = total;
    }
    const float inv = 1.0f / total;
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t t = 0;
    for (; t + 8 <= count; t += 8)
      _mm256_storeu_ps(sj + t, _mm256_mul_ps(_mm256_loadu_ps(sj + t), vinv));
    for (; t < count; ++t) sj[t] *= inv;
  }
  for (int64_t j0 = 0; j0 < group; j0 += 3) {
    const float* sj = s + j0 * count;
    float* oj = out + j0 * head_dim;
    switch (std::min<int64_t>(3, group - j0)) {
      case 3: weigh_heads_avx2<T, 3>(kv, row_table, g, first, count, sj, count, oj, head_dim); break;
      case 2: weigh_heads_avx2<T, 2>(kv, row_table, g, first, count, sj, count, oj, head_dim); break;
      default: weigh_heads_avx2<T, 1>(kv, row_table, g, first, count, sj, count, oj, head_dim); break;
    }
  }
}

#endif  // LLMRT_X86

template <typename T>
Paged<T> paged(const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
               int64_t width) {
  return {k_cache.mutable_data_ptr<T>(), v_cache.mutable_data_ptr<T>(), k_cache.stride(0),
          k_cache.stride(1), k_cache.stride(2), k_cache.size(2), table, width};
}

// ---- one step over a stack of layers, run by a team of threads -----------------------------
//
// A step runs every layer inside one OpenMP parallel region. Why: a region per kernel call
// costs a fork/join each (5 per layer, ~3-4 us apiece at 2 threads), and a torch op per layer
// ~15 us of dispatch, against ~0.1 ms of weight streaming per SmolLM2 layer.
//
// Five phases per layer end in a barrier: q/k/v, attention, output projection, MLP up (with
// its activation), MLP down (a sixth, the K/V writes, goes before attention in a layer where
// a row reads a ``-1`` page). Each is shared out as it goes (``for_chunks``: a thread's own
// share of output columns first, then the others' leftovers; attention tasks from a counter),
// so a core that runs slower (another process's time slice, a cold cache) does less instead
// of holding the others at the barrier (at batch 1 on a 2-core VM, fixed halves left one
// thread waiting ~15% of the step). With few rows, the work between the phases (activation
// prep, residual, RMSNorm) is done by every thread on its own copy, which costs less than the
// barrier a split would need.

// Rows up to which every thread keeps its own residual stream and prepared activations.
constexpr int64_t kPrivateRows = 4;

// A barrier for the team: waiters spin on the generation word for a bounded while (pausing),
// then sleep on it (``std::atomic::wait``: a futex on Linux) until the last arrival wakes
// them. Why not ``omp barrier``: libgomp's took ~0.3 us per crossing at two threads in a loop
// of barriers (this one ~0.03 us), and a step crosses ~150; SmolLM2's batch-1 step measured
// 2% faster (median of 50, interleaved in one process). Why sleep rather than spin or yield
// on: with the cores oversubscribed (other processes, or a team larger than the CPUs) a
// waiter that keeps running takes the time slices the late thread needs; a spin that fell
// back to ``sched_yield`` stalled a step for minutes on a loaded 2-core host.
struct SpinBarrier {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> generation{0};
  // Waiters past their spin (asleep or about to be); the last arrival wakes them only then.
  alignas(64) std::atomic<int> sleepers{0};
  int size = 1;
  // Pauses before a waiter sleeps (~0.1-0.5 ms, longer than a phase's usual imbalance); none
  // when the team outnumbers the CPUs (a spinning waiter would hold the core the last
  // arrival needs).
  int spins = 4096;
};

// CPUs this process may run on (its affinity mask, which containers and taskset narrow),
// or the machine's count where the mask cannot be read.
inline int usable_cpus() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return static_cast<int>(std::thread::hardware_concurrency());
}

struct Team {
  int tid;
  int nt;
  SpinBarrier* bar;
  // One counter per shared phase of the step, zeroed before the team starts; every thread
  // walks the phases in the same order, so ``phase`` names the same counter on each.
  std::atomic<int64_t>* counters;
  int64_t phase = 0;
  mutable int generation = 0;  // barrier crossings so far

  // [a, b): this thread's share of n items.
  void split(int64_t n, int64_t& a, int64_t& b) const {
    a = n * tid / nt;
    b = n * (tid + 1) / nt;
  }

  // The next phase's ``nt`` words (one per thread; a counter uses the first).
  std::atomic<int64_t>* next_phase() { return counters + nt * phase++; }
};

// Calls ``f(a, b)`` on chunks of a phase's items [0, n) (``words``: the phase's one word per
// thread). Each thread walks its own contiguous share from the front, taking half of what is
// left each time (one stream per thread for the hardware prefetchers), then takes ``unit``
// chunks from the back of the others' shares, so a slower thread does less. A word holds its
// share's remaining [lo, hi), packed with a set-once flag; whichever thread reaches a share
// first fills it. Why: guided chunks from one shared counter scattered each thread's reads
// over the matrix; SmolLM2's batch-1 step was ~8% slower with them (median of 40,
// interleaved in one process).
constexpr uint64_t kFilled = 1ULL << 63;

inline uint64_t packed(int64_t lo, int64_t hi) {
  return kFilled | (static_cast<uint64_t>(hi) << 32) | static_cast<uint64_t>(lo);
}

template <typename F>
void for_chunks(Team& team, int64_t n, int64_t unit, const F& f) {
  std::atomic<int64_t>* words = team.next_phase();
  const int nt = team.nt;
  const int64_t units = (n + unit - 1) / unit;
  for (int step = 0; step < nt; ++step) {
    const int t = (team.tid + step) % nt;
    std::atomic<int64_t>& word = words[t];
    int64_t cur = 0;
    const int64_t start = std::min(n, units * t / nt * unit);
    const int64_t end = std::min(n, units * (t + 1) / nt * unit);
    if (word.compare_exchange_strong(cur, static_cast<int64_t>(packed(start, end)),
                                     std::memory_order_relaxed))
      cur = static_cast<int64_t>(packed(start, end));
    const bool own = step == 0;
    for (;;) {
      const uint64_t bits = static_cast<uint64_t>(cur);
      const int64_t lo = static_cast<int64_t>(bits & 0xFFFFFFFFULL);
      const int64_t hi = static_cast<int64_t>((bits >> 32) & 0x7FFFFFFFULL);
      if (lo >= hi) break;
      const int64_t c = std::min(hi - lo, own ? std::max(unit, (hi - lo) / 2 / unit * unit) : unit);
      const int64_t a = own ? lo : hi - c;
      const uint64_t next = own ? packed(lo + c, hi) : packed(lo, hi - c);
      if (word.compare_exchange_weak(cur, static_cast<int64_t>(next), std::memory_order_relaxed))
        f(a, a + c);
    }
  }
}

inline void team_barrier(const Team& team) {
  SpinBarrier& b = *team.bar;
  const int gen = team.generation++;
  if (b.arrived.fetch_add(1, std::memory_order_acq_rel) == b.size - 1) {
    b.arrived.store(0, std::memory_order_relaxed);
    // seq_cst store, then load: either a waiter's seq_cst ``sleepers`` increment is seen
    // here (and it is woken), or its seq_cst re-check below sees the new generation.
    b.generation.store(gen + 1, std::memory_order_seq_cst);
    if (b.sleepers.load(std::memory_order_seq_cst) > 0) b.generation.notify_all();
    return;
  }
  for (int spins = 0; spins < b.spins; ++spins) {
    if (b.generation.load(std::memory_order_acquire) != gen) return;
    llmrt_kernels::cpu_relax();
  }
  b.sleepers.fetch_add(1, std::memory_order_seq_cst);
  // ``wait`` returns once the word differs from ``gen`` (it re-checks before sleeping, so a
  // store between the check and the sleep is not lost), or spuriously: hence the loop.
  while (b.generation.load(std::memory_order_seq_cst) == gen) b.generation.wait(gen);
  b.sleepers.fetch_sub(1, std::memory_order_relaxed);
}

// A layer's weights (borrowed) and shape, checked once.
struct LayerSpec {
  at::Tensor attn_norm, mlp_norm, qkv, o, up, down;
  int64_t qkv_kind, o_kind, up_kind, down_kind;
  std::optional<at::Tensor> qkv_bias, o_bias, up_bias, down_bias;
  int64_t num_heads, num_kv_heads, head_dim, window, activation, rope;
  bool gated;
  double eps, scale, mult;
  int64_t q_width, kv_width, qkv_width, up_rows, inter;
  // The parts the phases below take (``LayerParts``): norm forms and biases, parallel
  // attention + MLP, q/k/v clipping.
  std::optional<at::Tensor> attn_norm_bias, mlp_norm_bias;
  int64_t attn_norm_kind = llmrt_kernels::kNormRms;
  int64_t mlp_norm_kind = llmrt_kernels::kNormRms;  // -1: none (a parallel layer's MLP
                                                    // reads the attention's normed rows)
  bool parallel = false;
  double mlp_eps = 0.0;
  double clip = std::numeric_limits<double>::infinity();  // q/k/v clamped to [-clip, clip]
  // Per-head q/k norms (Qwen3, Cohere, StableLM, Phi): applied to every query and key head
  // after the bias and clip, before RoPE, with one [head_dim] weight (and bias) row for
  // every head or one row per head ([heads * head_dim]); kind -1: none.
  std::optional<at::Tensor> q_norm, k_norm, q_norm_bias, k_norm_bias;
  int64_t qk_norm_kind = -1;
  double qk_eps = 0.0;
};

// Heads [first, first + heads) of a q or k norm, their ``d`` values each at ``v`` (in place).
void qk_norm_heads(const LayerSpec& s, const std::optional<at::Tensor>& weight,
                   const std::optional<at::Tensor>& bias, float* v, int64_t first,
                   int64_t heads) {
  if (s.qk_norm_kind < 0) return;
  const int64_t d = s.head_dim;
  const bool per_head = weight->numel() > d;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t row = per_head ? (first + h) * d : 0;
    const NormRef n{weight->const_data_ptr<float>() + row,
                    bias.has_value() ? bias->const_data_ptr<float>() + row : nullptr,
                    s.qk_norm_kind, s.qk_eps};
    norm_rows(n, v + h * d, 1, d, v + h * d);
  }
}

NormRef attn_norm_of(const LayerSpec& s) {
  return {s.attn_norm.const_data_ptr<float>(),
          s.attn_norm_bias.has_value() ? s.attn_norm_bias->const_data_ptr<float>() : nullptr,
          s.attn_norm_kind, s.eps};
}

NormRef mlp_norm_of(const LayerSpec& s) {
  if (s.mlp_norm_kind < 0) return {};
  return {s.mlp_norm.const_data_ptr<float>(),
          s.mlp_norm_bias.has_value() ? s.mlp_norm_bias->const_data_ptr<float>() : nullptr,
          s.mlp_norm_kind, s.mlp_eps};
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
              "llmrt_kernels.decode_layer: ", name, " must be float32 on the CPU");
}

void check_vector(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return;
  check_float(*t, name);
  TORCH_CHECK(t->is_contiguous() && t->numel() == n, "llmrt_kernels.decode_layer: ", name,
              " must hold ", n, " contiguous values");
}

// Checks ``s`` against a hidden width and fills its derived sizes.
void check_spec(LayerSpec& s, int64_t width) {
  TORCH_CHECK(s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0,
              "llmrt_kernels.decode_layer: num_heads must be a multiple of num_kv_heads");
  s.q_width = s.num_heads * s.head_dim;
  s.kv_width = s.num_kv_heads * s.head_dim;
  s.qkv_width = s.q_width + 2 * s.kv_width;
  for (const auto* t : {&s.attn_norm, &s.mlp_norm}) {
    check_float(*t, "a norm weight");
    TORCH_CHECK(t->is_contiguous() && t->numel() == width,
                "llmrt_kernels.decode_layer: norm weights must hold ", width, " values");
  }
  llmrt_kernels::check_weight(s.qkv, s.qkv_kind, width);
  llmrt_kernels::check_weight(s.o, s.o_kind, s.q_width);
  llmrt_kernels::check_weight(s.up, s.up_kind, width);
  TORCH_CHECK(s.qkv.size(0) == s.qkv_width, "llmrt_kernels.decode_layer: qkv has ",
              s.qkv.size(0), " rows, the heads need ", s.qkv_width);
  TORCH_CHECK(s.o.size(0) == width, "llmrt_kernels.decode_layer: o must have ", width, " rows");
  s.up_rows = s.up.size(0);
  s.inter = s.gated ? s.up_rows / 2 : s.up_rows;
  TORCH_CHECK(!s.gated || s.up_rows % 2 == 0,
              "llmrt_kernels.decode_layer: gated up has odd rows");
  llmrt_kernels::check_weight(s.down, s.down_kind, s.inter);
  TORCH_CHECK(s.down.size(0) == width, "llmrt_kernels.decode_layer: down must have ", width,
              " rows");
  check_vector(s.qkv_bias, s.qkv_width, "qkv_bias");
  check_vector(s.o_bias, width, "o_bias");
  check_vector(s.up_bias, s.up_rows, "up_bias");
  check_vector(s.down_bias, width, "down_bias");
  check_vector(s.attn_norm_bias, width, "attn_norm_bias");
  check_vector(s.mlp_norm_bias, width, "mlp_norm_bias");
  TORCH_CHECK(s.attn_norm_kind == llmrt_kernels::kNormRms ||
                  s.attn_norm_kind == llmrt_kernels::kNormLayer,
              "llmrt_kernels.decode_layer: unknown norm kind ", s.attn_norm_kind);
  TORCH_CHECK(s.mlp_norm_kind == llmrt_kernels::kNormRms ||
                  s.mlp_norm_kind == llmrt_kernels::kNormLayer ||
                  (s.mlp_norm_kind == -1 && s.parallel),
              "llmrt_kernels.decode_layer: unknown MLP norm kind ", s.mlp_norm_kind,
              " (-1, none, only in a parallel layer)");
  TORCH_CHECK(s.clip > 0.0, "llmrt_kernels.decode_layer: q/k/v clip must be positive");
  TORCH_CHECK(s.qk_norm_kind == -1 || s.qk_norm_kind == llmrt_kernels::kNormRms ||
                  s.qk_norm_kind == llmrt_kernels::kNormLayer,
              "llmrt_kernels.decode_layer: unknown q/k norm kind ", s.qk_norm_kind);
  if (s.qk_norm_kind >= 0) {
    TORCH_CHECK(s.q_norm.has_value() && s.k_norm.has_value(),
                "llmrt_kernels.decode_layer: q/k norms need both weights");
    for (const auto& [w, b, heads, name] :
         {std::tuple{&s.q_norm, &s.q_norm_bias, s.num_heads, "q_norm"},
          std::tuple{&s.k_norm, &s.k_norm_bias, s.num_kv_heads, "k_norm"}}) {
      const int64_t n = (*w)->numel() == s.head_dim ? s.head_dim : heads * s.head_dim;
      check_vector(*w, n, name);
      check_vector(*b, n, name);
    }
  }
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const LayerSpec& s) {
  for (const auto* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && (t->scalar_type() == at::kFloat ||
                                         t->scalar_type() == at::kHalf ||
                                         t->scalar_type() == at::kBFloat16),
                "llmrt_kernels.decode_layer: the KV cache must be float32, float16 or bfloat16 "
                "on the CPU");
    TORCH_CHECK(t->dim() == 4 && t->size(1) == s.num_kv_heads && t->size(3) == s.head_dim &&
                    t->stride(3) == 1,
                "llmrt_kernels.decode_layer: KV caches must be [blocks, kv_heads, block_size, "
                "head_dim] with a contiguous last dim");
  }
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "llmrt_kernels.decode_layer: K and V caches must share a layout");
}

// Per-step buffers, sized for the largest layer, allocated before the team starts.
struct Scratch {
  float* normed;
  float* qkv;
  float* attn;
  float* proj;
  float* up;
  float* act;
  float* part;   // attention split over key parts: [rows, parts, q_width]
  float* stats;  // and each part's (max, sum) per head: [rows, parts, heads, 2]
  uint8_t* prep;
  std::vector<std::vector<float>>* scores;  // one per thread
};

// Where a thread reads the residual stream and the normed rows, and prepares activations:
// its own copies (few rows) or the team's shared buffers.
struct Stream {
  float* h;
  float* normed;
  float* attn;  // (own) the attention output merged from key parts
  float* q;     // (own) a key part's roped queries
  uint8_t* prep;
  bool own;
};

// ``x`` prepared for a linear of ``kind`` (nullptr when it reads float32 x directly): every
// row into this thread's buffer, or its share of the rows into the shared one and a barrier.
const uint8_t* prepare_x(const Team& team, const Stream& st, const float* x, int64_t rows,
                         int64_t kind, int64_t k) {
  if (llmrt_kernels::linear_prep_bytes(kind, k) == 0) return nullptr;
  if (st.own) {
    llmrt_kernels::linear_prepare(x, 0, rows, rows, kind, k, st.prep);
    return st.prep;
  }
  int64_t a, b;
  team.split(rows, a, b);
  llmrt_kernels::linear_prepare(x, a, b, rows, kind, k, st.prep);
  team_barrier(team);
  return st.prep;
}

// One linear by the whole team, output columns taken in chunks (``bias``, when given, added
// to them); the caller puts a barrier after it.
void team_linear(Team& team, const Stream& st, const float* x, int64_t rows, const at::Tensor& w,
                 int64_t kind, int64_t k, float* y, const float* bias = nullptr) {
  const uint8_t* prep = prepare_x(team, st, x, rows, kind, k);
  const int64_t n = w.size(0);
  // Weight rows a chunk is made of: what the kernel walks at a time (the tile loop 16, the
  // integer GEMM's panels 32).
  const int64_t unit = llmrt_kernels::linear_chunk_unit(kind, rows);
  for_chunks(team, n, unit, [&](int64_t a, int64_t b) {
    llmrt_kernels::linear_range(x, rows, w, kind, k, prep, y, a, b);
    if (bias != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = a; c < b; ++c) y[r * n + c] += bias[c];
  });
}

// q/k/v clipping (OLMo's ``clip_qkv``): ``v`` clamped to [-clip, clip] after its bias, as
// the torch path clamps the projection's output; nothing for an infinite clip.
inline void clip_values(float* v, int64_t n, double clip) {
  if (!std::isfinite(clip)) return;
  const float c = static_cast<float>(clip);
  for (int64_t j = 0; j < n; ++j) v[j] = std::clamp(v[j], -c, c);
}

// Row ``r``, KV head ``g``: the group's query heads with bias (and clip) and RoPE (in place, or into
// ``q_out`` leaving the row as it is), then, when ``write``, the key's bias and RoPE and the
// K/V write at the row's position (columns no other task touches).
template <typename T>
void rope_and_write(const Paged<T>& kv, const LayerSpec& s, const int64_t* pos_p,
                    const float* cos_p, const float* sin_p, int64_t rot, float* qkv_p,
                    int64_t r, int64_t g, float* q_out, bool write) {
  float* row = qkv_p + r * s.qkv_width;
  const int64_t group = s.num_heads / s.num_kv_heads, d = s.head_dim;
  const float* bias = s.qkv_bias.has_value() ? s.qkv_bias->const_data_ptr<float>() : nullptr;
  const float* q_in = row + g * group * d;
  float* q = q_out != nullptr ? q_out : row + g * group * d;
  for (int64_t j = 0; j < group * d; ++j)
    q[j] = bias != nullptr ? q_in[j] + bias[g * group * d + j] : q_in[j];
  clip_values(q, group * d, s.clip);
  qk_norm_heads(s, s.q_norm, s.q_norm_bias, q, g * group, group);
  if (rot > 0)
    for (int64_t j = 0; j < group; ++j) rope_head(q + j * d, cos_p + r * rot, sin_p + r * rot, rot);
  if (!write) return;
  float* k_new = row + s.q_width + g * d;
  float* v_new = row + s.q_width + s.kv_width + g * d;
  if (bias != nullptr)
    for (int64_t j = 0; j < d; ++j) {
      k_new[j] += bias[s.q_width + g * d + j];
      v_new[j] += bias[s.q_width + s.kv_width + g * d + j];
    }
  clip_values(k_new, d, s.clip);
  clip_values(v_new, d, s.clip);
  qk_norm_heads(s, s.k_norm, s.k_norm_bias, k_new, g, 1);
  if (rot > 0) rope_head(k_new, cos_p + r * rot, sin_p + r * rot, rot);
  const int64_t p = pos_p[r];
  if (p < 0 || p / kv.block_size >= kv.width) return;
  const int64_t block = kv.table[r * kv.width + p / kv.block_size];
  if (block < 0) return;
  const int64_t at = block * kv.s0 + g * kv.s1 + (p % kv.block_size) * kv.s2;
  for (int64_t c = 0; c < d; ++c) {
    kv.k[at + c] = static_cast<T>(k_new[c]);
    kv.v[at + c] = static_cast<T>(v_new[c]);
  }
}

// Keys [first, last] row ``r`` attends to (see the file comment).
inline void key_span(const LayerSpec& s, int64_t pos, int64_t span, int64_t& first,
                     int64_t& last) {
  const int64_t p = std::max<int64_t>(pos, 0);
  last = std::min(p, span - 1);
  first = s.window > 0 ? std::max<int64_t>(0, p - s.window + 1) : 0;
}

// Whether some row's key span reaches a ``-1`` page (read as block 0, which a row of this
// step may be writing). Every thread computes the same answer.
template <typename T>
bool reads_missing_pages(const Paged<T>& kv, const LayerSpec& s, const int64_t* pos_p,
                         int64_t rows) {
  const int64_t span = kv.width * kv.block_size;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t first, last;
    key_span(s, pos_p[r], span, first, last);
    for (int64_t page = first / kv.block_size; first <= last && page <= last / kv.block_size;
         ++page)
      if (kv.table[r * kv.width + page] < 0) return true;
  }
  return false;
}

// Row ``r``'s attention for KV head ``g`` over keys [first, first + count): the group's
// softmax-weighted values into ``out``; with ``stats``, each query head's largest score and
// sum of exponentials (what merging parts of a key range needs; a part with no keys gives
// -inf and 0).
template <typename T>
void attend_keys(const Paged<T>& kv, const LayerSpec& s, int64_t r, int64_t g, int64_t first,
                 int64_t count, const float* q, float* out, std::vector<float>& scores,
                 float* stats) {
  const int64_t head_dim = s.head_dim;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const float fscale = static_cast<float>(s.scale);
  const bool simd = has_avx512();
  [[maybe_unused]] const int nv = simd && head_dim % 16 == 0 ? static_cast<int>(head_dim / 16) : 0;
  std::fill_n(out, group * head_dim, 0.0f);
  if (count <= 0) {
    if (stats != nullptr)
      for (int64_t j = 0; j < group; ++j) {
        stats[2 * j] = -std::numeric_limits<float>::infinity();
        stats[2 * j + 1] = 0.0f;
      }
    return;
  }
  const int64_t* row_table = kv.table + r * kv.width;
#if defined(LLMRT_X86)
  switch (nv) {
    case 1: attend_task_avx512<T, 1>(kv, row_table, g, first, count, q, group, fscale, out, scores, stats); return;
    case 2: attend_task_avx512<T, 2>(kv, row_table, g, first, count, q, group, fscale, out, scores, stats); return;
    case 4: attend_task_avx512<T, 4>(kv, row_table, g, first, count, q, group, fscale, out, scores, stats); return;
    case 8: attend_task_avx512<T, 8>(kv, row_table, g, first, count, q, group, fscale, out, scores, stats); return;
    default: break;
  }
  if (!simd && has_avx2() && head_dim % 8 == 0 && head_dim <= kMaxDimAvx2) {
    attend_task_avx2<T>(kv, row_table, g, first, count, q, group, head_dim, fscale, out, scores,
                        stats);
    return;
  }
#endif
  scores.assign(static_cast<size_t>(group * count), 0.0f);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t key = first + t;
    const int64_t block = std::max<int64_t>(row_table[key / kv.block_size], 0);
    const T* k = kv.k + block * kv.s0 + g * kv.s1 + (key % kv.block_size) * kv.s2;
    for (int64_t j = 0; j < group; ++j)
      scores[j * count + t] = dot(q + j * head_dim, k, head_dim) * fscale;
  }
  for (int64_t j = 0; j < group; ++j) {
    float* sc = scores.data() + j * count;
    const float top = *std::max_element(sc, sc + count);
    float total = 0.0f;
#if defined(LLMRT_X86)
    if (simd) {
      total = exp_shift_sum_avx512(sc, count, top);
    } else if (has_avx2()) {
      total = exp_shift_sum_avx2(sc, count, top);
    } else
#endif
    {
      for (int64_t t = 0; t < count; ++t) {
        sc[t] = std::exp(sc[t] - top);
        total += sc[t];
      }
    }
    if (stats != nullptr) {
      stats[2 * j] = top;
      stats[2 * j + 1] = total;
    }
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < count; ++t) sc[t] *= inv;
  }
  for (int64_t t = 0; t < count; ++t) {
    const int64_t key = first + t;
    const int64_t block = std::max<int64_t>(row_table[key / kv.block_size], 0);
    const T* v = kv.v + block * kv.s0 + g * kv.s1 + (key % kv.block_size) * kv.s2;
    for (int64_t j = 0; j < group; ++j) axpy(scores[j * count + t], v, out + j * head_dim, head_dim);
  }
}

// Attention task ``task`` of rows * num_kv_heads over the row's whole key span.
template <typename T>
void attend_task(const Paged<T>& kv, const LayerSpec& s, const int64_t* pos_p,
                 const float* qkv_p, float* attn_p, int64_t task, std::vector<float>& scores) {
  const int64_t r = task / s.num_kv_heads, g = task % s.num_kv_heads;
  const int64_t offset = g * (s.num_heads / s.num_kv_heads) * s.head_dim;
  int64_t first, last;
  key_span(s, pos_p[r], kv.width * kv.block_size, first, last);
  attend_keys<T>(kv, s, r, g, first, last - first + 1, qkv_p + r * s.qkv_width + offset,
                 attn_p + r * s.q_width + offset, scores, nullptr);
}

// Each row's attention from ``parts`` parts of its key span (``part`` [rows, parts, q_width],
// ``stats`` [rows, parts, heads, 2]): out = sum_p w_p out_p / sum_p w_p with
// w_p = total_p * exp(top_p - max top), the softmax over the whole span.
void merge_parts(const LayerSpec& s, int64_t rows, int64_t parts, const float* part,
                 const float* stats, float* out) {
  const int64_t d = s.head_dim;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < s.num_heads; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p)
        top = std::max(top, stats[((r * parts + p) * s.num_heads + h) * 2]);
      float* o = out + r * s.q_width + h * d;
      std::fill_n(o, d, 0.0f);
      float total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) {
        const float* st = stats + ((r * parts + p) * s.num_heads + h) * 2;
        if (st[1] == 0.0f) continue;
        const float w = st[1] * std::exp(st[0] - top);
        total += w;
        const float* src = part + (r * parts + p) * s.q_width + h * d;
        for (int64_t c = 0; c < d; ++c) o[c] += w * src[c];
      }
      if (total == 0.0f) continue;  // no keys in any part (a position past its pages): zeros
      const float inv = 1.0f / total;
      for (int64_t c = 0; c < d; ++c) o[c] *= inv;
    }
}

// Rows [r0, r1): h += mult * (proj + bias), then (when ``norm.w``) normed = norm(h).
void residual_rows(float* h, const float* proj, const std::optional<at::Tensor>& bias,
                   double mult, int64_t width, const NormRef& norm, float* normed,
                   int64_t r0, int64_t r1) {
  const float m = static_cast<float>(mult);
  const float* b = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  for (int64_t r = r0; r < r1; ++r) {
    float* hr = h + r * width;
    const float* pr = proj + r * width;
    for (int64_t j = 0; j < width; ++j) hr[j] += m * (b != nullptr ? pr[j] + b[j] : pr[j]);
    if (norm.w != nullptr) norm_rows(norm, hr, 1, width, normed + r * width);
  }
}

// A parallel layer's attention residual (Phi, Cohere, GPT-NeoX: attention and MLP both read
// the layer's input), rows [r0, r1): first normed = mlp_norm(h) where the MLP has its own
// norm (else the attention's normed rows stay its input), then h += mult * (proj + bias).
// The MLP's residual is then added as a sequential layer's, so h = (x + attn) + mlp in the
// torch path's order.
void parallel_residual_rows(float* h, const float* proj, const std::optional<at::Tensor>& bias,
                            double mult, int64_t width, const NormRef& mlp_norm, float* normed,
                            int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (mlp_norm.w != nullptr) norm_rows(mlp_norm, h + r * width, 1, width, normed + r * width);
    residual_rows(h, proj, bias, mult, width, NormRef{}, normed, r, r + 1);
  }
}

// Columns [c0, c1) of every row: up bias, then the (gated) activation.
void activate_cols(const LayerSpec& s, float* up_p, float* act_p, int64_t rows, int64_t c0,
                   int64_t c1) {
  const float* b = s.up_bias.has_value() ? s.up_bias->const_data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    float* gate_row = up_p + r * s.up_rows;
    float* up_row = s.gated ? gate_row + s.inter : nullptr;
    if (b != nullptr) {
      for (int64_t j = c0; j < c1; ++j) gate_row[j] += b[j];
      if (up_row != nullptr)
        for (int64_t j = c0; j < c1; ++j) up_row[j] += b[s.inter + j];
    }
    float* a = act_p + r * s.inter;
#if defined(LLMRT_X86)
    if (s.activation == kSilu && has_avx512()) {
      silu_avx512(gate_row + c0, up_row == nullptr ? nullptr : up_row + c0, a + c0, c1 - c0);
      continue;
    }
    if (s.activation == kSilu && has_avx2()) {
      llmrt_kernels::silu_row_avx2<float>(gate_row + c0, up_row == nullptr ? nullptr : up_row + c0,
                                         a + c0, c1 - c0);
      continue;
    }
#endif
    if (up_row != nullptr) {
      for (int64_t j = c0; j < c1; ++j) a[j] = activate(gate_row[j], s.activation) * up_row[j];
    } else {
      for (int64_t j = c0; j < c1; ++j) a[j] = activate(gate_row[j], s.activation);
    }
  }
}

// Inputs of one step besides the layers: checked, converted once.
struct StepInputs {
  float* h;
  int64_t rows, width;
  const int64_t* pos;
  const int64_t* table;
  int64_t table_width;
  std::vector<at::Tensor> cos, sin;
  std::vector<at::Tensor> k, v;
};

// The residual after a linear (``proj``), then ``norm``(h) into the normed rows: every row
// on this thread's copy, or its share of the shared rows and a barrier.
void team_residual(const Team& team, const Stream& st, int64_t rows, int64_t width,
                   const float* proj, const std::optional<at::Tensor>& bias, double mult,
                   const NormRef& norm) {
  if (st.own) {
    residual_rows(st.h, proj, bias, mult, width, norm, st.normed, 0, rows);
    return;
  }
  int64_t a, b;
  team.split(rows, a, b);
  residual_rows(st.h, proj, bias, mult, width, norm, st.normed, a, b);
  team_barrier(team);
}

// ``parallel_residual_rows`` by the team, as ``team_residual``.
void team_parallel_residual(const Team& team, const Stream& st, const LayerSpec& s,
                            int64_t rows, int64_t width, const float* proj) {
  if (st.own) {
    parallel_residual_rows(st.h, proj, s.o_bias, s.mult, width, mlp_norm_of(s), st.normed, 0,
                           rows);
    return;
  }
  int64_t a, b;
  team.split(rows, a, b);
  parallel_residual_rows(st.h, proj, s.o_bias, s.mult, width, mlp_norm_of(s), st.normed, a, b);
  team_barrier(team);
}

// The MLP's up projection and activation, in chunks of intermediate columns: a chunk's gate
// and up columns, then their activation (no barrier between the two).
void team_mlp_up(Team& team, const Stream& st, const LayerSpec& s, int64_t rows, int64_t width,
                 Scratch& sc) {
  const uint8_t* prep = prepare_x(team, st, st.normed, rows, s.up_kind, width);
  const int64_t unit = llmrt_kernels::linear_chunk_unit(s.up_kind, rows);
  for_chunks(team, s.inter, unit, [&](int64_t a, int64_t b) {
    llmrt_kernels::linear_range(st.normed, rows, s.up, s.up_kind, width, prep, sc.up, a, b);
    if (s.gated)
      llmrt_kernels::linear_range(st.normed, rows, s.up, s.up_kind, width, prep, sc.up,
                                  s.inter + a, s.inter + b);
    activate_cols(s, sc.up, sc.act, rows, a, b);
  });
}

// One layer; its last residual writes ``next_norm``(h) into the normed rows (the next layer's
// pre-norm, or the final norm before the LM head).
template <typename T>
void layer_by_team(Team& team, const Stream& st, const LayerSpec& s, const NormRef& next_norm,
                   const StepInputs& in, size_t li, Scratch& sc) {
  const int64_t rows = in.rows, width = in.width;
  const Paged<T> kv = paged<T>(in.k[li], in.v[li], in.table, in.table_width);
  // q/k/v of the pre-normed rows.
  team_linear(team, st, st.normed, rows, s.qkv, s.qkv_kind, width, sc.qkv);
  team_barrier(team);
  // Per (row, KV head): bias, RoPE and the K/V write of that head, then its attention.
  // With fewer such tasks than twice the team (batch 1: 3 KV heads on 2 threads left one
  // thread a whole task behind), each task's keys are split in ``parts`` parts instead: a
  // part's task ropes its own copy of the queries, the last part (the only one that reads
  // the row's position) writes the K/V first, and every thread merges the parts into its
  // own copy after the barrier. A row that reads a ``-1`` page (padding) reads block 0,
  // which another row may be writing: then every write goes first, behind a barrier.
  const bool has_rope = s.rope >= 0;
  const int64_t rot = has_rope ? in.cos[s.rope].size(1) : 0;
  const float* cos_p = has_rope ? in.cos[s.rope].const_data_ptr<float>() : nullptr;
  const float* sin_p = has_rope ? in.sin[s.rope].const_data_ptr<float>() : nullptr;
  const int64_t tasks = rows * s.num_kv_heads;
  const int64_t parts = st.own && tasks < 2 * team.nt ? team.nt : 1;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const bool writes_first = reads_missing_pages(kv, s, in.pos, rows);
  if (writes_first) {
    std::atomic<int64_t>& next = *team.next_phase();
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < tasks;
         task = next.fetch_add(1, std::memory_order_relaxed))
      rope_and_write<T>(kv, s, in.pos, cos_p, sin_p, rot, sc.qkv, task / s.num_kv_heads,
                        task % s.num_kv_heads, nullptr, true);
    team_barrier(team);
  }
  std::vector<float>& scores = (*sc.scores)[team.tid];
  std::atomic<int64_t>& next = *team.next_phase();
  for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < tasks * parts;
       task = next.fetch_add(1, std::memory_order_relaxed)) {
    const int64_t r = task / (s.num_kv_heads * parts);
    const int64_t g = task / parts % s.num_kv_heads, part = task % parts;
    const int64_t head = g * group;
    if (parts == 1) {
      if (!writes_first)
        rope_and_write<T>(kv, s, in.pos, cos_p, sin_p, rot, sc.qkv, r, g, nullptr, true);
      attend_task<T>(kv, s, in.pos, sc.qkv, sc.attn, task, scores);
      continue;
    }
    float* q = sc.qkv + r * s.qkv_width + head * s.head_dim;  // roped by the write phase
    if (!writes_first) {
      q = st.q;
      rope_and_write<T>(kv, s, in.pos, cos_p, sin_p, rot, sc.qkv, r, g, q, part == parts - 1);
    }
    int64_t first, last;
    key_span(s, in.pos[r], kv.width * kv.block_size, first, last);
    const int64_t count = last - first + 1;
    const int64_t a = first + count * part / parts, b = first + count * (part + 1) / parts;
    attend_keys<T>(kv, s, r, g, a, b - a, q,
                   sc.part + (r * parts + part) * s.q_width + head * s.head_dim, scores,
                   sc.stats + ((r * parts + part) * s.num_heads + head) * 2);
  }
  team_barrier(team);
  if (parts > 1) merge_parts(s, rows, parts, sc.part, sc.stats, st.attn);
  const float* attn = parts > 1 ? st.attn : sc.attn;
  // Output projection, residual, MLP pre-norm.
  team_linear(team, st, attn, rows, s.o, s.o_kind, s.q_width, sc.proj);
  team_barrier(team);
  if (s.parallel) {
    team_parallel_residual(team, st, s, rows, width, sc.proj);
  } else {
    team_residual(team, st, rows, width, sc.proj, s.o_bias, s.mult, mlp_norm_of(s));
  }
  // MLP, residual, and the next layer's pre-norm.
  team_mlp_up(team, st, s, rows, width, sc);
  team_barrier(team);
  team_linear(team, st, sc.act, rows, s.down, s.down_kind, s.inter, sc.proj);
  team_barrier(team);
  team_residual(team, st, rows, width, sc.proj, s.down_bias, s.mult, next_norm);
}

// A step's ends besides the layers (borrowed): the token embedding (ggml blocks or dense
// float32 rows, times ``embed_scale``) and the final RMSNorm + LM head (+ bias).
struct Ends {
  at::Tensor embed;
  int64_t embed_kind;
  double embed_scale;
  at::Tensor norm;
  double eps;
  at::Tensor head;
  int64_t head_kind;
  std::optional<at::Tensor> head_bias;
  std::optional<at::Tensor> norm_bias;
  int64_t norm_kind = llmrt_kernels::kNormRms;
};

NormRef final_norm_of(const Ends& e) {
  return {e.norm.const_data_ptr<float>(),
          e.norm_bias.has_value() ? e.norm_bias->const_data_ptr<float>() : nullptr, e.norm_kind,
          e.eps};
}

// Every layer over ``in.h``; with ``ends``, then the final norm and the LM head into
// ``logits`` ``[rows, vocab]`` in the same team.
void run_stack(const std::vector<LayerSpec>& layers, StepInputs& in, const Ends* ends = nullptr,
               float* logits = nullptr) {
  const int64_t rows = in.rows, width = in.width;
  if (rows == 0 || layers.empty()) return;
  int64_t max_qkv = 0, max_q = 0, max_up = 0, max_inter = 0, max_prep = 0, max_heads = 0;
  for (const auto& s : layers) {
    max_heads = std::max(max_heads, s.num_heads);
    max_qkv = std::max(max_qkv, s.qkv_width);
    max_q = std::max(max_q, s.q_width);
    max_up = std::max(max_up, s.up_rows);
    max_inter = std::max(max_inter, s.inter);
    max_prep = std::max({max_prep, llmrt_kernels::linear_prep_bytes(s.qkv_kind, width),
                         llmrt_kernels::linear_prep_bytes(s.o_kind, s.q_width),
                         llmrt_kernels::linear_prep_bytes(s.up_kind, width),
                         llmrt_kernels::linear_prep_bytes(s.down_kind, s.inter)});
  }
  if (ends != nullptr)
    max_prep = std::max(max_prep, llmrt_kernels::linear_prep_bytes(ends->head_kind, width));
  const int nt = std::max(1, at::get_num_threads());
  const bool own = rows <= kPrivateRows;
  // Shared: normed, proj, qkv, attn, up, act, (few rows) attention parts and their stats,
  // prep; per thread (few rows): h, normed, attn, prep.
  const auto lines = [](int64_t n) { return (n + 63) / 64 * 64; };  // whole cache lines
  const int64_t part_floats = own ? rows * nt * (max_q + 2 * max_heads) : 0;
  const int64_t shared =
      lines((rows * (2 * width + max_qkv + max_q + max_up + max_inter) + part_floats) * 4 +
            rows * max_prep);
  const int64_t per_thread = own ? lines(rows * ((2 * width + max_q) * 4 + max_prep) + max_q * 4) : 0;
  at::Tensor buffer = at::empty({shared + nt * per_thread},
                                at::TensorOptions().dtype(at::kByte));
  uint8_t* bytes = buffer.mutable_data_ptr<uint8_t>();
  float* base = reinterpret_cast<float*>(bytes);
  Scratch sc{};
  sc.normed = base;
  sc.proj = sc.normed + rows * width;
  sc.qkv = sc.proj + rows * width;
  sc.attn = sc.qkv + rows * max_qkv;
  sc.up = sc.attn + rows * max_q;
  sc.act = sc.up + rows * max_up;
  sc.part = sc.act + rows * max_inter;
  sc.stats = sc.part + (own ? rows * nt * max_q : 0);
  sc.prep = reinterpret_cast<uint8_t*>(sc.part + part_floats);
  std::vector<std::vector<float>> scores(static_cast<size_t>(nt));
  sc.scores = &scores;
  // Counters of the shared phases: at most six per layer and the LM head.
  const int64_t phases = 6 * static_cast<int64_t>(layers.size()) + 1;
  SpinBarrier bar;
  std::unique_ptr<std::atomic<int64_t>[]> counters(new std::atomic<int64_t>[phases * nt]);
  for (int64_t i = 0; i < phases * nt; ++i) counters[i].store(0, std::memory_order_relaxed);
  const auto body = [&](Team& team) {
    Stream st{in.h, sc.normed, sc.attn, nullptr, sc.prep, false};
    if (own) {
      // This thread's copy of the residual stream (every copy takes the same steps, so they
      // stay bit-equal) and its pre-norm.
      uint8_t* mine = bytes + shared + team.tid * per_thread;
      st.h = reinterpret_cast<float*>(mine);
      st.normed = st.h + rows * width;
      st.attn = st.normed + rows * width;
      st.q = st.attn + rows * max_q;
      st.prep = reinterpret_cast<uint8_t*>(st.q + max_q);
      st.own = true;
      std::copy_n(in.h, rows * width, st.h);
    }
    if (own || team.tid == 0) norm_rows(attn_norm_of(layers[0]), st.h, rows, width, st.normed);
    if (!own) team_barrier(team);
    for (size_t i = 0; i < layers.size(); ++i) {
      const bool last = i + 1 == layers.size();
      const NormRef norm = !last ? attn_norm_of(layers[i + 1])
                                 : (ends != nullptr ? final_norm_of(*ends) : NormRef{});
      switch (in.k[i].scalar_type()) {
        case at::kHalf:
          layer_by_team<c10::Half>(team, st, layers[i], norm, in, i, sc);
          break;
        case at::kBFloat16:
          layer_by_team<c10::BFloat16>(team, st, layers[i], norm, in, i, sc);
          break;
        default: layer_by_team<float>(team, st, layers[i], norm, in, i, sc); break;
      }
    }
    if (own && team.tid == 0) std::copy_n(st.h, rows * width, in.h);
    if (ends == nullptr) return;
    team_linear(team, st, st.normed, rows, ends->head, ends->head_kind, width, logits,
                ends->head_bias.has_value() ? ends->head_bias->const_data_ptr<float>()
                                            : nullptr);
  };
  if (nt == 1 || at::in_parallel_region()) {
    Team team{0, 1, &bar, counters.get()};
    body(team);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
#pragma omp single
    {
      bar.size = omp_get_num_threads();
      const int cpus = usable_cpus();
      if (cpus > 0 && bar.size > cpus) bar.spins = 0;
    }
    Team team{omp_get_thread_num(), omp_get_num_threads(), &bar, counters.get()};
    body(team);
  }
}

// ``t``'s integer values as int64: ``t``'s own data when it is contiguous int64, else a copy
// in ``store`` (which must outlive their use). Why: ``to(kLong)`` is three dispatched ATen
// ops, ~10 us each right after a step has streamed the weights through the caches, for a
// handful of ids; a step converted its positions twice and its page table once.
const int64_t* int64_values(const at::Tensor& t, std::vector<int64_t>& store) {
  TORCH_CHECK(!t.is_floating_point() && !t.is_complex(),
              "llmrt_kernels.decode_layer: positions, tokens and page tables must be integers");
  if (t.scalar_type() == at::kLong && t.is_contiguous()) return t.const_data_ptr<int64_t>();
  const int64_t n = t.numel();
  store.resize(static_cast<size_t>(n));
  if (t.scalar_type() == at::kInt && t.is_contiguous()) {
    std::copy_n(t.const_data_ptr<int32_t>(), n, store.begin());
  } else {
    const at::Tensor wide = t.to(at::kLong).contiguous();
    std::copy_n(wide.const_data_ptr<int64_t>(), n, store.begin());
  }
  return store.data();
}

// Every page-table entry is a block of every layer's KV pool or -1 (no page), checked once
// per step before any kernel writes. Why: a row writes its K/V through the table and reads
// its keys through it; an entry past the pool would write outside it. Positions need no
// check of their own: a position before 0 or past its table's span writes nothing and its
// keys are clipped to the span (the file comment), so only the table can point outside.
void check_bounds(const int64_t* table, int64_t rows, int64_t width,
                  const std::vector<at::Tensor>& k) {
  int64_t blocks = std::numeric_limits<int64_t>::max();
  for (const at::Tensor& t : k) blocks = std::min<int64_t>(blocks, t.size(0));
  for (int64_t i = 0; i < rows * width; ++i) {
    const int64_t e = table[i];
    TORCH_CHECK_INDEX(e >= -1 && e < blocks, "llmrt_kernels.bounds: page_table[", i / width, ", ",
                      i % width, "] = ", e, " is not a block of the KV pool (0..", blocks - 1,
                      ") or -1; nothing was written");
  }
}

// Checks the per-step tensors against the layers and fills ``in`` (page table and positions
// as int64, copied into ``table`` / ``pos`` where they are not, which must outlive the step).
void prepare_step(const std::vector<LayerSpec>& layers, const at::Tensor& hidden,
                  const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                  const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                  const at::Tensor& page_table, const at::Tensor& positions,
                  std::vector<int64_t>& table, std::vector<int64_t>& pos, StepInputs& in) {
  check_float(hidden, "hidden");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "llmrt_kernels.decode_layer: hidden must be a contiguous [rows, hidden] tensor");
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(k.size() == layers.size() && v.size() == layers.size(),
              "llmrt_kernels.decode_layer: one K and one V cache per layer (", layers.size(),
              "), got ", k.size(), " and ", v.size());
  TORCH_CHECK(cos.size() == sin.size(), "llmrt_kernels.decode_layer: cos and sin lists differ");
  for (size_t i = 0; i < cos.size(); ++i) {
    check_float(cos[i], "cos");
    check_float(sin[i], "sin");
    TORCH_CHECK(cos[i].dim() == 2 && cos[i].size(0) == rows && cos[i].is_contiguous() &&
                    sin[i].sizes() == cos[i].sizes() && sin[i].is_contiguous() &&
                    cos[i].size(1) % 2 == 0,
                "llmrt_kernels.decode_layer: cos/sin must be contiguous [rows, rotary_dim]");
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSpec& s = layers[i];
    TORCH_CHECK(s.attn_norm.numel() == hidden.size(1),
                "llmrt_kernels.decode_layer: hidden has ", hidden.size(1),
                " features, the layers ", s.attn_norm.numel());
    TORCH_CHECK(s.rope < static_cast<int64_t>(cos.size()),
                "llmrt_kernels.decode_layer: a layer's RoPE table ", s.rope, " is not given");
    if (s.rope >= 0)
      TORCH_CHECK(cos[s.rope].size(1) <= s.head_dim,
                  "llmrt_kernels.decode_layer: cos/sin must be contiguous [rows, rotary_dim]");
    check_cache(k[i], v[i], s);
  }
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == rows,
              "llmrt_kernels.decode_layer: page_table must be [rows, width]");
  TORCH_CHECK(positions.numel() == rows, "llmrt_kernels.decode_layer: one position per row");
  in.h = hidden.mutable_data_ptr<float>();
  in.rows = rows;
  in.width = hidden.size(1);
  in.pos = int64_values(positions, pos);
  in.table = int64_values(page_table, table);
  check_bounds(in.table, rows, page_table.size(1), k);
  in.table_width = page_table.size(1);
  in.cos = cos;
  in.sin = sin;
  in.k = k;
  in.v = v;
}

// A layer's parts beyond the single-layer op's arguments (its defaults: pre-norm RMSNorm
// without bias, sequential residuals, no clipping).
struct LayerParts {
  std::optional<at::Tensor> attn_norm_bias, mlp_norm_bias;
  int64_t attn_norm_kind = llmrt_kernels::kNormRms;
  int64_t mlp_norm_kind = llmrt_kernels::kNormRms;
  bool parallel = false;
  double mlp_eps = std::numeric_limits<double>::quiet_NaN();  // NaN: the attention norm's
  double clip = std::numeric_limits<double>::infinity();
  std::optional<at::Tensor> q_norm, k_norm, q_norm_bias, k_norm_bias;
  int64_t qk_norm_kind = -1;
  double qk_eps = 0.0;
};

LayerSpec spec_of(const at::Tensor& attn_norm, const at::Tensor& mlp_norm, const at::Tensor& qkv,
                  int64_t qkv_kind, const std::optional<at::Tensor>& qkv_bias,
                  const at::Tensor& o, int64_t o_kind, const std::optional<at::Tensor>& o_bias,
                  const at::Tensor& up, int64_t up_kind, const std::optional<at::Tensor>& up_bias,
                  const at::Tensor& down, int64_t down_kind,
                  const std::optional<at::Tensor>& down_bias, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                  int64_t window, int64_t activation, bool gated, double mult, int64_t rope,
                  const LayerParts& parts = {}) {
  LayerSpec s{attn_norm, mlp_norm, qkv, o, up, down, qkv_kind, o_kind, up_kind, down_kind,
              qkv_bias, o_bias, up_bias, down_bias, num_heads, num_kv_heads, head_dim, window,
              activation, rope, gated, eps, scale, mult, 0, 0, 0, 0, 0};
  s.attn_norm_bias = parts.attn_norm_bias;
  s.mlp_norm_bias = parts.mlp_norm_bias;
  s.attn_norm_kind = parts.attn_norm_kind;
  s.mlp_norm_kind = parts.mlp_norm_kind;
  s.parallel = parts.parallel;
  s.mlp_eps = std::isnan(parts.mlp_eps) ? eps : parts.mlp_eps;
  s.clip = parts.clip;
  s.q_norm = parts.q_norm;
  s.k_norm = parts.k_norm;
  s.q_norm_bias = parts.q_norm_bias;
  s.k_norm_bias = parts.k_norm_bias;
  s.qk_norm_kind = parts.qk_norm_kind;
  s.qk_eps = parts.qk_eps;
  check_spec(s, attn_norm.numel());
  return s;
}

// The single-layer op (one layer's stack).
void decode_layer(const at::Tensor& hidden, const at::Tensor& attn_norm,
                  const at::Tensor& mlp_norm, const at::Tensor& qkv, int64_t qkv_kind,
                  const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o, int64_t o_kind,
                  const std::optional<at::Tensor>& o_bias, const at::Tensor& up, int64_t up_kind,
                  const std::optional<at::Tensor>& up_bias, const at::Tensor& down,
                  int64_t down_kind, const std::optional<at::Tensor>& down_bias,
                  const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& page_table,
                  const at::Tensor& positions, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, double eps, double scale, int64_t window, int64_t activation,
                  bool gated, double residual_multiplier) {
  // The layer reads RoPE table 0: [rows, 0] tables rotate nothing.
  const std::vector<LayerSpec> layers{spec_of(
      attn_norm, mlp_norm, qkv, qkv_kind, qkv_bias, o, o_kind, o_bias, up, up_kind, up_bias, down,
      down_kind, down_bias, num_heads, num_kv_heads, head_dim, eps, scale, window, activation,
      gated, residual_multiplier, 0)};
  std::vector<int64_t> table, pos;
  StepInputs in{};
  prepare_step(layers, hidden, {cos}, {sin}, {k_cache}, {v_cache}, page_table, positions, table,
               pos, in);
  run_stack(layers, in);
}

// Every decoder layer of a model's decode step, built once from the layers' weights
// (borrowed: the modules own them) and run per step with one call.
struct DecodeStack : torch::CustomClassHolder {
  std::vector<LayerSpec> layers;

  // Per layer: tensors (attn_norm, mlp_norm, qkv, o, up, down), optional tensors (qkv, o,
  // up, down biases; attn_norm, mlp_norm biases; q_norm, k_norm weights and biases), ints
  // (qkv_kind,
  // o_kind, up_kind, down_kind, num_heads, num_kv_heads, head_dim, window, activation,
  // gated, rope table index or -1, attn_norm kind, mlp_norm kind or -1, parallel, q/k norm
  // kind or -1), floats (eps, scale, residual_multiplier, mlp_norm eps, q/k/v clip or inf,
  // q/k norm eps).
  DecodeStack(std::vector<at::Tensor> tensors, c10::List<std::optional<at::Tensor>> biases,
              std::vector<int64_t> ints, std::vector<double> floats) {
    const size_t n = tensors.size() / 6;
    TORCH_CHECK(tensors.size() == 6 * n && biases.size() == 10 * n && ints.size() == 15 * n &&
                    floats.size() == 6 * n && n > 0,
                "llmrt_kernels.DecodeStack: per layer 6 tensors, 10 optional tensors, 15 ints "
                "and 6 floats; given ", tensors.size(), ", ", biases.size(), ", ", ints.size(),
                ", ", floats.size());
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor* t = tensors.data() + 6 * i;
      const int64_t* q = ints.data() + 15 * i;
      const double* f = floats.data() + 6 * i;
      LayerParts parts;
      parts.attn_norm_bias = biases.get(10 * i + 4);
      parts.mlp_norm_bias = biases.get(10 * i + 5);
      parts.q_norm = biases.get(10 * i + 6);
      parts.k_norm = biases.get(10 * i + 7);
      parts.q_norm_bias = biases.get(10 * i + 8);
      parts.k_norm_bias = biases.get(10 * i + 9);
      parts.attn_norm_kind = q[11];
      parts.mlp_norm_kind = q[12];
      parts.parallel = q[13] != 0;
      parts.qk_norm_kind = q[14];
      parts.mlp_eps = f[3];
      parts.clip = f[4];
      parts.qk_eps = f[5];
      layers.push_back(spec_of(t[0], t[1], t[2], q[0], biases.get(10 * i), t[3], q[1],
                               biases.get(10 * i + 1), t[4], q[2], biases.get(10 * i + 2), t[5],
                               q[3], biases.get(10 * i + 3), q[4], q[5], q[6], f[0], f[1], q[7],
                               q[8], q[9] != 0, f[2], q[10], parts));
      TORCH_CHECK(layers.back().attn_norm.numel() == layers[0].attn_norm.numel(),
                  "llmrt_kernels.DecodeStack: layers of different widths");
    }
  }

  std::optional<Ends> ends;

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // The embedding before the layers and the final norm + LM head after them (borrowed), so
  // that ``step`` runs a whole decode step: token ids in, logits out.
  // ``norm_bias`` and ``norm_kind`` (``layer_norm.h``) give the final norm's form.
  void set_ends(at::Tensor embed, int64_t embed_kind, double embed_scale, at::Tensor norm,
                double eps, at::Tensor head, int64_t head_kind,
                std::optional<at::Tensor> head_bias, std::optional<at::Tensor> norm_bias,
                int64_t norm_kind) {
    const int64_t width = layers[0].attn_norm.numel();
    llmrt_kernels::check_weight(embed, embed_kind, width);
    TORCH_CHECK(embed.size(0) > 0, "llmrt_kernels.DecodeStack: an empty embedding");
    check_float(norm, "the final norm weight");
    TORCH_CHECK(norm.is_contiguous() && norm.numel() == width,
                "llmrt_kernels.DecodeStack: the final norm weight must hold ", width, " values");
    llmrt_kernels::check_weight(head, head_kind, width);
    check_vector(head_bias, head.size(0), "head_bias");
    check_vector(norm_bias, width, "the final norm bias");
    TORCH_CHECK(norm_kind == llmrt_kernels::kNormRms || norm_kind == llmrt_kernels::kNormLayer,
                "llmrt_kernels.DecodeStack: unknown final norm kind ", norm_kind);
    ends = Ends{embed, embed_kind, embed_scale, norm, eps, head, head_kind, head_bias,
                norm_bias, norm_kind};
  }

  bool has_ends() const { return ends.has_value(); }

  // One decode step from token ids: embedding (ids clamped to the table), every layer, final
  // norm and LM head. ``cos_tables``/``sin_tables`` are the RoPE caches ``[positions,
  // rotary_dim / 2]``, read at each row's position clamped to them (padding rows, negative,
  // read row 0). Returns float32 logits ``[rows, vocab]``.
  at::Tensor step(at::Tensor tokens, at::Tensor positions, at::Tensor page_table,
                  std::vector<at::Tensor> cos_tables, std::vector<at::Tensor> sin_tables,
                  std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches) {
    TORCH_CHECK(ends.has_value(), "llmrt_kernels.DecodeStack: step needs set_ends first");
    const Ends& e = *ends;
    TORCH_CHECK(tokens.dim() == 1 && !tokens.is_floating_point(),
                "llmrt_kernels.DecodeStack: tokens must be integer ids [rows]");
    TORCH_CHECK(positions.dim() == 1 && positions.numel() == tokens.numel(),
                "llmrt_kernels.DecodeStack: one position per token");
    TORCH_CHECK(cos_tables.size() == sin_tables.size(),
                "llmrt_kernels.DecodeStack: cos and sin lists differ");
    const int64_t rows = tokens.size(0), width = layers[0].attn_norm.numel();
    std::vector<int64_t> tok_store, pos_store;
    const int64_t* tok_p = int64_values(tokens, tok_store);
    const int64_t* pos_p = int64_values(positions, pos_store);
    at::Tensor hidden = at::empty({rows, width}, tokens.options().dtype(at::kFloat));
    float* h = hidden.mutable_data_ptr<float>();
    const int64_t last_id = e.embed.size(0) - 1;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t id = std::clamp<int64_t>(tok_p[r], 0, last_id);
      if (e.embed_kind == llmrt_kernels::kDenseF32) {
        std::copy_n(e.embed.const_data_ptr<float>() + id * width, width, h + r * width);
      } else {
        const int64_t rb = e.embed.size(1);
        llmrt_kernels::dequantize_rows(e.embed.const_data_ptr<uint8_t>() + id * rb, rb,
                                       e.embed_kind, width, h + r * width, 1);
      }
      if (e.embed_scale != 1.0) {
        const float scale = static_cast<float>(e.embed_scale);
        for (int64_t j = 0; j < width; ++j) h[r * width + j] *= scale;
      }
    }
    std::vector<at::Tensor> cos(cos_tables.size()), sin(sin_tables.size());
    for (size_t i = 0; i < cos_tables.size(); ++i) {
      const at::Tensor& ct = cos_tables[i];
      const at::Tensor& st = sin_tables[i];
      check_float(ct, "cos");
      check_float(st, "sin");
      TORCH_CHECK(ct.dim() == 2 && ct.size(0) > 0 && ct.is_contiguous() &&
                      st.sizes() == ct.sizes() && st.is_contiguous(),
                  "llmrt_kernels.DecodeStack: RoPE tables must be contiguous [positions, "
                  "rotary_dim / 2]");
      const int64_t half = ct.size(1), n = ct.size(0);
      cos[i] = at::empty({rows, 2 * half}, ct.options());
      sin[i] = at::empty({rows, 2 * half}, ct.options());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = std::clamp<int64_t>(pos_p[r], 0, n - 1) * half;
        for (const auto& [table, out] : {std::pair{&ct, &cos[i]}, std::pair{&st, &sin[i]}}) {
          const float* src = table->const_data_ptr<float>() + at;
          float* dst = out->mutable_data_ptr<float>() + r * 2 * half;
          std::copy_n(src, half, dst);
          std::copy_n(src, half, dst + half);
        }
      }
    }
    at::Tensor logits = at::empty({rows, e.head.size(0)}, hidden.options());
    if (rows == 0) return logits;
    std::vector<int64_t> table, pos;
    StepInputs in{};
    prepare_step(layers, hidden, cos, sin, k_caches, v_caches, page_table, positions, table, pos,
                 in);
    run_stack(layers, in, &e, logits.mutable_data_ptr<float>());
    return logits;
  }

  // The RoPE tables and KV caches ``step_bound`` reads (borrowed until ``release_cache``),
  // bound once per KV cache instead of passed (and converted) on every step.
  std::vector<at::Tensor> bound_cos, bound_sin, bound_k, bound_v;
  bool bound = false;

  void bind_cache(std::vector<at::Tensor> cos_tables, std::vector<at::Tensor> sin_tables,
                  std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches) {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
                "llmrt_kernels.DecodeStack: bind_cache needs one K and one V cache per layer (",
                layers.size(), "), got ", k_caches.size(), " and ", v_caches.size());
    TORCH_CHECK(cos_tables.size() == sin_tables.size(),
                "llmrt_kernels.DecodeStack: cos and sin lists differ");
    bound_cos = std::move(cos_tables);
    bound_sin = std::move(sin_tables);
    bound_k = std::move(k_caches);
    bound_v = std::move(v_caches);
    bound = true;
  }

  void release_cache() {
    bound_cos.clear();
    bound_sin.clear();
    bound_k.clear();
    bound_v.clear();
    bound = false;
  }

  bool has_cache() const { return bound; }

  // ``step`` over the bound tables and caches (every per-step check still runs).
  at::Tensor step_bound(at::Tensor tokens, at::Tensor positions, at::Tensor page_table) {
    TORCH_CHECK(bound, "llmrt_kernels.DecodeStack: step_bound needs bind_cache first");
    return step(std::move(tokens), std::move(positions), std::move(page_table), bound_cos,
                bound_sin, bound_k, bound_v);
  }

  // This object's address, for the Python entry's ``decode_step`` (python_entry.cpp; the
  // caller keeps the object alive while it uses the address).
  int64_t address() { return reinterpret_cast<int64_t>(this); }

  void run(at::Tensor hidden, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
           std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
           at::Tensor page_table, at::Tensor positions) {
    std::vector<int64_t> table, pos;
    StepInputs in{};
    prepare_step(layers, hidden, cos, sin, k_caches, v_caches, page_table, positions, table, pos,
                 in);
    run_stack(layers, in);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor attn_norm, Tensor mlp_norm, Tensor qkv, "
      "int qkv_kind, Tensor? qkv_bias, Tensor o, int o_kind, Tensor? o_bias, Tensor up, "
      "int up_kind, Tensor? up_bias, Tensor down, int down_kind, Tensor? down_bias, Tensor cos, "
      "Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor page_table, Tensor positions, "
      "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int window, "
      "int activation, bool gated, float residual_multiplier) -> ()");
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, c10::List<std::optional<at::Tensor>>,
                       std::vector<int64_t>, std::vector<double>>())
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_ends", &DecodeStack::set_ends)
      .def("has_ends", &DecodeStack::has_ends)
      .def("step", &DecodeStack::step)
      .def("bind_cache", &DecodeStack::bind_cache)
      .def("release_cache", &DecodeStack::release_cache)
      .def("has_cache", &DecodeStack::has_cache)
      .def("step_bound", &DecodeStack::step_bound)
      .def("address", &DecodeStack::address)
      .def("run", &DecodeStack::run);
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) { m.impl("decode_layer", &decode_layer); }

namespace llmrt_kernels {

at::Tensor decode_step_at(int64_t address, const at::Tensor& tokens, const at::Tensor& positions,
                          const at::Tensor& page_table) {
  TORCH_CHECK(address != 0, "llmrt_kernels: decode_step needs a DecodeStack's address");
  return reinterpret_cast<DecodeStack*>(address)->step_bound(tokens, positions, page_table);
}

}  // namespace llmrt_kernels
