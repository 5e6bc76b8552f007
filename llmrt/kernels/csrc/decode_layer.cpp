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
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cpu.h"
#include "linear.h"

namespace {

using llmrt_kernels::has_avx512;

constexpr int64_t kSilu = 0;
constexpr int64_t kGelu = 1;
constexpr int64_t kGeluTanh = 2;
constexpr int64_t kRelu = 3;

// out = w * (x / sqrt(mean(x^2) + eps)) per row, in float32 as Hugging Face's RMSNorm.
void rms_norm_rows(const float* x, int64_t rows, int64_t width, const float* w, double eps,
                   float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    float ss = 0.0f;
    for (int64_t j = 0; j < width; ++j) ss += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
    float* o = out + r * width;
    for (int64_t j = 0; j < width; ++j) o[j] = w[j] * (xr[j] * inv);
  }
}

inline float activate(float v, int64_t kind) {
  switch (kind) {
    case kSilu: return v / (1.0f + std::exp(-v));
    case kGelu: return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
    case kGeluTanh: {
      const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + std::tanh(inner));
    }
    default: return v > 0.0f ? v : 0.0f;
  }
}

void add_bias(float* y, int64_t rows, int64_t n, const std::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return;
  const float* b = bias->const_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) y[r * n + j] += b[j];
}

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

// 16 cache values as float32 (masked lanes read as zero). The cache stores float32, float16
// (F16C conversion) or bfloat16 (the upper half of a float32).
LLMRT_AVX512 inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
LLMRT_AVX512 inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
LLMRT_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

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

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-7 Taylor polynomial
// (error below float32 rounding), then scaled by 2^n. Inputs are clamped to [-87, 88].
LLMRT_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
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
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), shift));
    _mm512_mask_storeu_ps(s + t, tail, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
  }
  return _mm512_reduce_add_ps(total);
}

// a[j] = silu(g[j]) * u[j] (u == nullptr: silu(g[j])), 16 lanes at a time.
LLMRT_AVX512 void silu_avx512(const float* g, const float* u, float* a, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t j = 0;
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                     : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, g + j);
    __m512 out = _mm512_div_ps(v, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), v))));
    if (u != nullptr) out = _mm512_mul_ps(out, _mm512_maskz_loadu_ps(m, u + j));
    _mm512_mask_storeu_ps(a + j, m, out);
  }
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  if (has_avx512()) return dot_avx512(a, b, n);
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) s += a[j] * static_cast<float>(b[j]);
  return s;
}

template <typename T>
inline void axpy(float w, const T* x, float* y, int64_t n) {
  if (has_avx512()) {
    axpy_avx512(w, x, y, n);
    return;
  }
  for (int64_t j = 0; j < n; ++j) y[j] += w * static_cast<float>(x[j]);
}

template <typename T>
struct Paged;

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
  int64_t t = 0;
  while (t < count) {
    const int64_t key = first + t;
    const int64_t page = key / kv.block_size;
    const int64_t off = key - page * kv.block_size;
    const int64_t n = std::min(kv.block_size - off, count - t);
    const int64_t block = std::max<int64_t>(row_table[page], 0);
    const T* vp = kv.v + block * kv.s0 + g * kv.s1 + off * kv.s2;
    for (int64_t i = 0; i < n; ++i, vp += kv.s2) {
      __m512 v[NV];
      for (int c = 0; c < NV; ++c) v[c] = load16(vp + 16 * c, static_cast<__mmask16>(0xFFFF));
      for (int j = 0; j < GC; ++j) {
        const __m512 w = _mm512_set1_ps(scores[j * score_stride + t + i]);
        for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_fmadd_ps(w, v[c], acc[j][c]);
      }
    }
    t += n;
  }
  for (int j = 0; j < GC; ++j)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + j * head_dim + 16 * c, acc[j][c]);
}

template <typename T, int NV>
LLMRT_AVX512 void score_keys(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                             int64_t first, int64_t count, const float* q, int64_t group,
                             float scale, float* scores) {
  const int64_t head_dim = 16 * NV;
  int64_t t = 0;
  while (t < count) {
    const int64_t key = first + t;
    const int64_t page = key / kv.block_size;
    const int64_t off = key - page * kv.block_size;
    const int64_t n = std::min(kv.block_size - off, count - t);
    const int64_t block = std::max<int64_t>(row_table[page], 0);
    const T* kp = kv.k + block * kv.s0 + g * kv.s1 + off * kv.s2;
    for (int64_t i = 0; i < n; ++i, kp += kv.s2) {
      __m512 k[NV];
      for (int c = 0; c < NV; ++c) k[c] = load16(kp + 16 * c, static_cast<__mmask16>(0xFFFF));
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = q + j * head_dim;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qj), k[0]);
        for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), k[c], a);
        scores[j * count + t + i] = _mm512_reduce_add_ps(a) * scale;
      }
    }
    t += n;
  }
}

template <typename T, int NV>
LLMRT_AVX512 void attend_task_avx512(const Paged<T>& kv, const int64_t* row_table, int64_t g,
                                     int64_t first, int64_t count, const float* q,
                                     int64_t group, float scale, float* out,
                                     std::vector<float>& scores) {
  constexpr int kMaxHeads = NV <= 4 ? 4 : 2;  // output registers: kMaxHeads * NV <= 16
  const int64_t head_dim = 16 * NV;
  scores.resize(static_cast<size_t>(group * count));
  float* s = scores.data();
  score_keys<T, NV>(kv, row_table, g, first, count, q, group, scale, s);
  for (int64_t j = 0; j < group; ++j) {
    float* sj = s + j * count;
    const float top = *std::max_element(sj, sj + count);
    const float inv = 1.0f / exp_shift_sum_avx512(sj, count, top);
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

template <typename T>
struct Paged {
  T* k;
  T* v;
  int64_t s0, s1, s2;  // strides of [block, head, offset] (the last dim is contiguous)
  int64_t block_size;
  const int64_t* table;  // [rows, width] as int64
  int64_t width;
};

// Write each row's K/V at its position, then attend over its pages (see the file comment).
// ``T`` is the cache's element type; scores and outputs are float32.
template <typename T>
void attend_paged(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
                  const int64_t* pos_p, const at::Tensor& cos, const at::Tensor& sin,
                  float* qkv_p, float* attn_p, int64_t rows, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, int64_t rot, double scale,
                  int64_t window) {
  const int64_t q_width = num_heads * head_dim;
  const int64_t kv_width = num_kv_heads * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  Paged<T> kv{k_cache.mutable_data_ptr<T>(), v_cache.mutable_data_ptr<T>(),
              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.size(2),
              table.const_data_ptr<int64_t>(), table.size(1)};
  const int64_t span = kv.width * kv.block_size;
  const float* cos_p = cos.const_data_ptr<float>();
  const float* sin_p = sin.const_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = qkv_p + r * qkv_width;
    if (rot > 0)
      for (int64_t hd = 0; hd < num_heads + num_kv_heads; ++hd)
        rope_head(row + hd * head_dim, cos_p + r * rot, sin_p + r * rot, rot);
    const int64_t p = pos_p[r];
    if (p < 0 || p / kv.block_size >= kv.width) continue;
    const int64_t block = kv.table[r * kv.width + p / kv.block_size];
    if (block < 0) continue;
    const int64_t offset = p % kv.block_size;
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      const int64_t at = block * kv.s0 + g * kv.s1 + offset * kv.s2;
      const float* k_new = row + q_width + g * head_dim;
      const float* v_new = row + q_width + kv_width + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        kv.k[at + d] = static_cast<T>(k_new[d]);
        kv.v[at + d] = static_cast<T>(v_new[d]);
      }
    }
  }

  const int64_t group = num_heads / num_kv_heads;
  const float fscale = static_cast<float>(scale);
  const bool simd = has_avx512();
  const int nv = simd && head_dim % 16 == 0 ? static_cast<int>(head_dim / 16) : 0;
  at::parallel_for(0, rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads;
      const int64_t g = task % num_kv_heads;
      const int64_t p = std::max<int64_t>(pos_p[r], 0);
      const int64_t last = std::min(p, span - 1);
      const int64_t first = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      const int64_t count = last - first + 1;
      float* out = attn_p + r * q_width + g * group * head_dim;
      std::fill_n(out, group * head_dim, 0.0f);
      if (count <= 0) continue;
      const float* q_row = qkv_p + r * qkv_width + g * group * head_dim;
      const int64_t* table_row = kv.table + r * kv.width;
      switch (nv) {
        case 1: attend_task_avx512<T, 1>(kv, table_row, g, first, count, q_row, group, fscale, out, scores); continue;
        case 2: attend_task_avx512<T, 2>(kv, table_row, g, first, count, q_row, group, fscale, out, scores); continue;
        case 4: attend_task_avx512<T, 4>(kv, table_row, g, first, count, q_row, group, fscale, out, scores); continue;
        case 8: attend_task_avx512<T, 8>(kv, table_row, g, first, count, q_row, group, fscale, out, scores); continue;
        default: break;
      }
      scores.assign(static_cast<size_t>(group * count), 0.0f);
      const float* q = qkv_p + r * qkv_width + g * group * head_dim;
      const int64_t* row_table = kv.table + r * kv.width;
      for (int64_t t = 0; t < count; ++t) {
        const int64_t key = first + t;
        const int64_t block = std::max<int64_t>(row_table[key / kv.block_size], 0);
        const T* k = kv.k + block * kv.s0 + g * kv.s1 + (key % kv.block_size) * kv.s2;
        for (int64_t j = 0; j < group; ++j)
          scores[j * count + t] = dot(q + j * head_dim, k, head_dim) * fscale;
      }
      for (int64_t j = 0; j < group; ++j) {
        float* s = scores.data() + j * count;
        const float top = *std::max_element(s, s + count);
        float total = 0.0f;
        if (simd) {
          total = exp_shift_sum_avx512(s, count, top);
        } else {
          for (int64_t t = 0; t < count; ++t) {
            s[t] = std::exp(s[t] - top);
            total += s[t];
          }
        }
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < count; ++t) s[t] *= inv;
      }
      for (int64_t t = 0; t < count; ++t) {
        const int64_t key = first + t;
        const int64_t block = std::max<int64_t>(row_table[key / kv.block_size], 0);
        const T* v = kv.v + block * kv.s0 + g * kv.s1 + (key % kv.block_size) * kv.s2;
        for (int64_t j = 0; j < group; ++j) {
          axpy(scores[j * count + t], v, out + j * head_dim, head_dim);
        }
      }
    }
  });

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
  check_float(hidden, "hidden");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "llmrt_kernels.decode_layer: hidden must be a contiguous [rows, hidden] tensor");
  const int64_t rows = hidden.size(0);
  const int64_t width = hidden.size(1);
  const int64_t q_width = num_heads * head_dim;
  const int64_t kv_width = num_kv_heads * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "llmrt_kernels.decode_layer: num_heads must be a multiple of num_kv_heads");
  for (const auto* t : {&attn_norm, &mlp_norm}) {
    check_float(*t, "a norm weight");
    TORCH_CHECK(t->is_contiguous() && t->numel() == width,
                "llmrt_kernels.decode_layer: norm weights must hold ", width, " values");
  }
  llmrt_kernels::check_weight(qkv, qkv_kind, width);
  llmrt_kernels::check_weight(o, o_kind, q_width);
  llmrt_kernels::check_weight(up, up_kind, width);
  TORCH_CHECK(qkv.size(0) == qkv_width, "llmrt_kernels.decode_layer: qkv has ", qkv.size(0),
              " rows, the heads need ", qkv_width);
  TORCH_CHECK(o.size(0) == width, "llmrt_kernels.decode_layer: o must have ", width, " rows");
  const int64_t up_rows = up.size(0);
  const int64_t inter = gated ? up_rows / 2 : up_rows;
  TORCH_CHECK(!gated || up_rows % 2 == 0, "llmrt_kernels.decode_layer: gated up has odd rows");
  llmrt_kernels::check_weight(down, down_kind, inter);
  TORCH_CHECK(down.size(0) == width, "llmrt_kernels.decode_layer: down must have ", width,
              " rows");
  check_vector(qkv_bias, qkv_width, "qkv_bias");
  check_vector(o_bias, width, "o_bias");
  check_vector(up_bias, up_rows, "up_bias");
  check_vector(down_bias, width, "down_bias");
  check_float(cos, "cos");
  check_float(sin, "sin");
  const int64_t rot = cos.dim() == 2 ? cos.size(1) : 0;
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous() && rot <= head_dim &&
                  rot % 2 == 0,
              "llmrt_kernels.decode_layer: cos/sin must be contiguous [rows, rotary_dim]");
  for (const auto* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && (t->scalar_type() == at::kFloat ||
                                         t->scalar_type() == at::kHalf ||
                                         t->scalar_type() == at::kBFloat16),
                "llmrt_kernels.decode_layer: the KV cache must be float32, float16 or bfloat16 "
                "on the CPU");
    TORCH_CHECK(t->dim() == 4 && t->size(1) == num_kv_heads && t->size(3) == head_dim &&
                    t->stride(3) == 1,
                "llmrt_kernels.decode_layer: KV caches must be [blocks, kv_heads, block_size, "
                "head_dim] with a contiguous last dim");
  }
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "llmrt_kernels.decode_layer: K and V caches must share a layout");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == rows,
              "llmrt_kernels.decode_layer: page_table must be [rows, width]");
  TORCH_CHECK(positions.numel() == rows, "llmrt_kernels.decode_layer: one position per row");
  if (rows == 0) return;

  const at::Tensor table = page_table.to(at::kLong).contiguous();
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t* pos_p = pos.const_data_ptr<int64_t>();
  const auto f32 = hidden.options();
  at::Tensor normed = at::empty({rows, width}, f32);
  at::Tensor qkv_out = at::empty({rows, qkv_width}, f32);
  at::Tensor attn = at::empty({rows, q_width}, f32);
  at::Tensor proj = at::empty({rows, width}, f32);
  at::Tensor up_out = at::empty({rows, up_rows}, f32);
  at::Tensor act = at::empty({rows, inter}, f32);
  float* h = hidden.mutable_data_ptr<float>();
  float* n_p = normed.mutable_data_ptr<float>();
  float* qkv_p = qkv_out.mutable_data_ptr<float>();
  float* attn_p = attn.mutable_data_ptr<float>();
  float* proj_p = proj.mutable_data_ptr<float>();
  float* up_p = up_out.mutable_data_ptr<float>();
  float* act_p = act.mutable_data_ptr<float>();
  const float mult = static_cast<float>(residual_multiplier);

  // Attention block.
  rms_norm_rows(h, rows, width, attn_norm.const_data_ptr<float>(), eps, n_p);
  llmrt_kernels::linear_into(n_p, rows, qkv, qkv_kind, width, qkv_p);
  add_bias(qkv_p, rows, qkv_width, qkv_bias);

  switch (k_cache.scalar_type()) {
    case at::kHalf:
      attend_paged<c10::Half>(k_cache, v_cache, table, pos_p, cos, sin, qkv_p, attn_p, rows,
                              num_heads, num_kv_heads, head_dim, rot, scale, window);
      break;
    case at::kBFloat16:
      attend_paged<c10::BFloat16>(k_cache, v_cache, table, pos_p, cos, sin, qkv_p, attn_p, rows,
                                  num_heads, num_kv_heads, head_dim, rot, scale, window);
      break;
    default:
      attend_paged<float>(k_cache, v_cache, table, pos_p, cos, sin, qkv_p, attn_p, rows,
                          num_heads, num_kv_heads, head_dim, rot, scale, window);
  }

  llmrt_kernels::linear_into(attn_p, rows, o, o_kind, q_width, proj_p);
  add_bias(proj_p, rows, width, o_bias);
  for (int64_t i = 0; i < rows * width; ++i) h[i] += mult * proj_p[i];

  // MLP block.
  rms_norm_rows(h, rows, width, mlp_norm.const_data_ptr<float>(), eps, n_p);
  llmrt_kernels::linear_into(n_p, rows, up, up_kind, width, up_p);
  add_bias(up_p, rows, up_rows, up_bias);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate_row = up_p + r * up_rows;
      const float* up_row = gated ? gate_row + inter : nullptr;
      float* a = act_p + r * inter;
      if (activation == kSilu && has_avx512()) {
        silu_avx512(gate_row, up_row, a, inter);
      } else if (gated) {
        for (int64_t j = 0; j < inter; ++j) a[j] = activate(gate_row[j], activation) * up_row[j];
      } else {
        for (int64_t j = 0; j < inter; ++j) a[j] = activate(gate_row[j], activation);
      }
    }
  });
  llmrt_kernels::linear_into(act_p, rows, down, down_kind, inter, proj_p);
  add_bias(proj_p, rows, width, down_bias);
  for (int64_t i = 0; i < rows * width; ++i) h[i] += mult * proj_p[i];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor attn_norm, Tensor mlp_norm, Tensor qkv, "
      "int qkv_kind, Tensor? qkv_bias, Tensor o, int o_kind, Tensor? o_bias, Tensor up, "
      "int up_kind, Tensor? up_bias, Tensor down, int down_kind, Tensor? down_bias, Tensor cos, "
      "Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor page_table, Tensor positions, "
      "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int window, "
      "int activation, bool gated, float residual_multiplier) -> ()");
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) { m.impl("decode_layer", &decode_layer); }
