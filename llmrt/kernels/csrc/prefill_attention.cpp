// Causal grouped-query attention over a prefill's tokens, float32: padded rows with no cached
// prefix (``causal_attention``), or ragged sequences packed back to back whose keys may start
// with a cached prefix (``varlen_causal_attention``).
//
// Why: torch's CPU flash attention ran SmolLM2's 512-token layer (9 query heads over 3 KV
// heads, head_dim 64) at ~70 GFLOPS, a quarter of its share of a 512-token prefill. Here a
// task is one KV head's whole query group over a block of positions, so each K/V block is
// loaded once for all the heads that read it; scores and the value product are register
// tiles of four query rows (sixteen accumulators), and the softmax is the online one (a
// running max and sum per row, as flash attention), so no [S, S] score matrix is formed.
//
// Semantics: torch's ``scaled_dot_product_attention(q, k, v, is_causal=True, scale=s,
// enable_gqa=True)`` with q ``[B, H, S, D]`` and k, v ``[B, Hkv, S, D]``: position i attends
// to keys 0..i; query head h reads KV head h / (H / Hkv). The output is ``[B, H, S, D]``
// viewed over a ``[B, S, H, D]`` buffer, so the caller's ``transpose(1, 2).flatten(2)`` is
// free. The packed form is flash attention's varlen one: per sequence, the queries are its
// last keys (bottom-right causal alignment).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "cpu.h"
#include "vecmath.h"

namespace {

#if defined(LLMRT_X86)
using llmrt_kernels::exp512;
#endif
using llmrt_kernels::has_avx512;

// Query positions per task and keys per block.
constexpr int64_t kQueryBlock = 32;
[[maybe_unused]] constexpr int64_t kKeyBlock = 64;
// Query rows (head, position) per register tile.
[[maybe_unused]] constexpr int kTileRows = 4;

struct Strides {
  int64_t b, h, s;  // the last dim is contiguous
};

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// One sequence's tensors for one task: ``q``/``o`` at its query 0, head 0; ``k``/``v`` at its
// key 0, KV head 0 (``h``: head stride, ``s``: position stride). Its queries sit at positions
// ``offset``, ``offset + 1``, ... among its keys (``offset``: keys cached before them), so query
// i sees keys 0..offset + i.
struct Segment {
  const float* q;
  int64_t qh, qs;
  const float* k;
  int64_t kh, ks;
  const float* v;
  int64_t vh, vs;
  float* o;
  int64_t oh, os;
  int64_t offset;
};

// One task: KV head ``g`` of sequence ``seg``, its queries [q0, q1), all ``group`` query heads
// of the KV head. ``NV``: 16-float vectors per head (head_dim / 16).
#if defined(LLMRT_X86)
template <int NV>
LLMRT_AVX512 void attend_block(const Segment& seg, int64_t g, int64_t group, int64_t q0,
                               int64_t q1, float scale, std::vector<float>& work) {
  constexpr int64_t D = 16 * NV;
  const int64_t positions = q1 - q0, rows = group * positions;
  // Per row r = j * positions + i (head g * group + j, position q0 + i): running max and sum,
  // the output accumulator [rows, D], the row's scores of one key block, and K^T of the block.
  work.resize(static_cast<size_t>(3 * rows + rows * D + rows * kKeyBlock + D * kKeyBlock));
  float* top = work.data();
  float* total = top + rows;
  float* poisoned = total + rows;  // 1 where a visible score was NaN or +inf
  float* acc = poisoned + rows;
  float* scores = acc + rows * D;
  float* kt = scores + rows * kKeyBlock;
  std::fill_n(top, rows, -std::numeric_limits<float>::infinity());
  std::fill_n(total, rows, 0.0f);
  std::fill_n(poisoned, rows, 0.0f);
  std::fill_n(acc, rows * D, 0.0f);
  const float* kb = seg.k + g * seg.kh;
  const float* vb = seg.v + g * seg.vh;
  const auto qrow = [&](int64_t r) {
    return seg.q + (g * group + r / positions) * seg.qh + (q0 + r % positions) * seg.qs;
  };
  const int64_t keys = seg.offset + q1;  // the last query's keys
  for (int64_t k0 = 0; k0 < keys; k0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, keys - k0);
    // K^T of the block, zero-padded to kKeyBlock columns.
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = 0; t < kKeyBlock; ++t)
        kt[d * kKeyBlock + t] = t < nk ? kb[(k0 + t) * seg.ks + d] : 0.0f;
    // Scores: kKeyBlock keys (four vectors) for kTileRows rows at a time.
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int tr = static_cast<int>(std::min<int64_t>(kTileRows, rows - r0));
      __m512 s[kTileRows][4];
      const float* qp[kTileRows];
      for (int i = 0; i < kTileRows; ++i) {
        qp[i] = qrow(r0 + std::min(i, tr - 1));
        for (int c = 0; c < 4; ++c) s[i][c] = _mm512_setzero_ps();
      }
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * kKeyBlock;
        const __m512 k0v = _mm512_loadu_ps(kd), k1v = _mm512_loadu_ps(kd + 16);
        const __m512 k2v = _mm512_loadu_ps(kd + 32), k3v = _mm512_loadu_ps(kd + 48);
        for (int i = 0; i < kTileRows; ++i) {
          const __m512 qv = _mm512_set1_ps(qp[i][d]);
          s[i][0] = _mm512_fmadd_ps(qv, k0v, s[i][0]);
          s[i][1] = _mm512_fmadd_ps(qv, k1v, s[i][1]);
          s[i][2] = _mm512_fmadd_ps(qv, k2v, s[i][2]);
          s[i][3] = _mm512_fmadd_ps(qv, k3v, s[i][3]);
        }
      }
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int i = 0; i < tr; ++i) {
        const int64_t r = r0 + i, pos = seg.offset + q0 + r % positions;
        // Keys past the row's position (and past the block) are masked.
        const int64_t visible = std::min(nk, pos - k0 + 1);
        float* sr = scores + r * kKeyBlock;
        float block_top = -std::numeric_limits<float>::infinity();
        __mmask16 seen[4];
        for (int c = 0; c < 4; ++c) {
          seen[c] = llmrt_kernels::lanes(std::max<int64_t>(visible - 16 * c, 0));
          const __m512 x = _mm512_mul_ps(s[i][c], vscale);
          _mm512_storeu_ps(sr + 16 * c, x);
          if (seen[c] == 0) continue;
          // A NaN or +inf score makes the row's softmax NaN, as in torch: remember it (the
          // exponential below would clamp it away).
          if (_mm512_mask_cmp_ps_mask(seen[c], x, _mm512_set1_ps(std::numeric_limits<float>::max()),
                                      _CMP_NLE_UQ) != 0)
            poisoned[r] = 1.0f;
          block_top = std::max(block_top, _mm512_mask_reduce_max_ps(seen[c], x));
        }
        // Online softmax: rescale what came before to the new maximum (carry is 0 for the
        // first block, which holds key 0, visible to every row; a later block may hold none
        // of a row's keys: its maximum stays, carry is 1 and every weight 0).
        const float new_top = std::max(top[r], block_top);
        const float carry = top[r] == -std::numeric_limits<float>::infinity()
                                ? 0.0f
                                : std::exp(top[r] - new_top);
        const __m512 shift = _mm512_set1_ps(new_top);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; ++c) {
          // Keys past the row's position (and past the block) weigh exactly 0.
          const __m512 p = _mm512_maskz_mov_ps(
              seen[c], exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c), shift)));
          _mm512_storeu_ps(sr + 16 * c, p);
          sum = _mm512_add_ps(sum, p);
        }
        total[r] = total[r] * carry + _mm512_reduce_add_ps(sum);
        top[r] = new_top;
        if (carry != 1.0f) {
          const __m512 vc = _mm512_set1_ps(carry);
          float* ar = acc + r * D;
          for (int c = 0; c < NV; ++c)
            _mm512_storeu_ps(ar + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(ar + 16 * c), vc));
        }
      }
    }
    // acc += P V over the block's keys, kTileRows rows at a time (NV <= 4: 16 accumulators).
    constexpr int kPvRows = NV <= 4 ? kTileRows : 2;
    for (int64_t r0 = 0; r0 < rows; r0 += kPvRows) {
      const int tr = static_cast<int>(std::min<int64_t>(kPvRows, rows - r0));
      __m512 o[kPvRows][NV];
      for (int i = 0; i < kPvRows; ++i)
        for (int c = 0; c < NV; ++c)
          o[i][c] = i < tr ? _mm512_loadu_ps(acc + (r0 + i) * D + 16 * c) : _mm512_setzero_ps();
      for (int64_t t = 0; t < nk; ++t) {
        const float* vt = vb + (k0 + t) * seg.vs;
        __m512 vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(vt + 16 * c);
        for (int i = 0; i < kPvRows; ++i) {
          const __m512 p = _mm512_set1_ps(scores[(r0 + std::min(i, tr - 1)) * kKeyBlock + t]);
          for (int c = 0; c < NV; ++c) o[i][c] = _mm512_fmadd_ps(p, vv[c], o[i][c]);
        }
      }
      for (int i = 0; i < tr; ++i)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (r0 + i) * D + 16 * c, o[i][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(
        poisoned[r] != 0.0f ? std::numeric_limits<float>::quiet_NaN() : 1.0f / total[r]);
    float* dst = seg.o + (g * group + r / positions) * seg.oh + (q0 + r % positions) * seg.os;
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), inv));
  }
}

// ``attend_block`` on 8-lane vectors (AVX2 + FMA), for CPUs without AVX-512: the same tasks,
// online softmax and masking (lane masks from a compare against the lane index), with
// register tiles sized for 16 ymm registers: scores of 4 query rows x 16 keys (eight
// accumulators) over the key block in four passes, and P V of 2 rows x 32 values of D.
// ``NV``: 8-float vectors per head (head_dim / 8).
LLMRT_AVX2 inline __m256 visible_lanes(int64_t n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t c = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), iota));
}

LLMRT_AVX2 inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

template <int NV>
LLMRT_AVX2 void attend_block_avx2(const Segment& seg, int64_t g, int64_t group, int64_t q0,
                                  int64_t q1, float scale, std::vector<float>& work) {
  constexpr int64_t D = 8 * NV;
  constexpr int kKeyVecs = kKeyBlock / 8;
  const int64_t positions = q1 - q0, rows = group * positions;
  work.resize(static_cast<size_t>(3 * rows + rows * D + rows * kKeyBlock + D * kKeyBlock));
  float* top = work.data();
  float* total = top + rows;
  float* poisoned = total + rows;
  float* acc = poisoned + rows;
  float* scores = acc + rows * D;
  float* kt = scores + rows * kKeyBlock;
  std::fill_n(top, rows, -std::numeric_limits<float>::infinity());
  std::fill_n(total, rows, 0.0f);
  std::fill_n(poisoned, rows, 0.0f);
  std::fill_n(acc, rows * D, 0.0f);
  const float* kb = seg.k + g * seg.kh;
  const float* vb = seg.v + g * seg.vh;
  const auto qrow = [&](int64_t r) {
    return seg.q + (g * group + r / positions) * seg.qh + (q0 + r % positions) * seg.qs;
  };
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t keys = seg.offset + q1;
  for (int64_t k0 = 0; k0 < keys; k0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, keys - k0);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = 0; t < kKeyBlock; ++t)
        kt[d * kKeyBlock + t] = t < nk ? kb[(k0 + t) * seg.ks + d] : 0.0f;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int tr = static_cast<int>(std::min<int64_t>(kTileRows, rows - r0));
      const float* qp[kTileRows];
      for (int i = 0; i < kTileRows; ++i) qp[i] = qrow(r0 + std::min(i, tr - 1));
      for (int c0 = 0; c0 < kKeyVecs; c0 += 2) {
        __m256 s[kTileRows][2];
        for (int i = 0; i < kTileRows; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const float* kd = kt + d * kKeyBlock + 8 * c0;
          const __m256 ka = _mm256_loadu_ps(kd), kc = _mm256_loadu_ps(kd + 8);
          for (int i = 0; i < kTileRows; ++i) {
            const __m256 qv = _mm256_broadcast_ss(qp[i] + d);
            s[i][0] = _mm256_fmadd_ps(qv, ka, s[i][0]);
            s[i][1] = _mm256_fmadd_ps(qv, kc, s[i][1]);
          }
        }
        for (int i = 0; i < tr; ++i) {
          float* sr = scores + (r0 + i) * kKeyBlock + 8 * c0;
          _mm256_storeu_ps(sr, _mm256_mul_ps(s[i][0], vscale));
          _mm256_storeu_ps(sr + 8, _mm256_mul_ps(s[i][1], vscale));
        }
      }
      for (int i = 0; i < tr; ++i) {
        const int64_t r = r0 + i, pos = seg.offset + q0 + r % positions;
        const int64_t visible = std::min(nk, pos - k0 + 1);
        float* sr = scores + r * kKeyBlock;
        __m256 seen[kKeyVecs];
        __m256 vmax = neg_inf;
        bool bad = false;
        for (int c = 0; c < kKeyVecs; ++c) {
          seen[c] = visible_lanes(visible - 8 * c);
          const __m256 x = _mm256_loadu_ps(sr + 8 * c);
          // A NaN or +inf score poisons the row (torch's softmax gives NaN there).
          const __m256 over =
              _mm256_cmp_ps(x, _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
          bad = bad || _mm256_movemask_ps(_mm256_and_ps(over, seen[c])) != 0;
          vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(neg_inf, x, seen[c]));
        }
        if (bad) poisoned[r] = 1.0f;
        const float block_top = hmax8(vmax);
        const float new_top = std::max(top[r], block_top);
        const float carry = top[r] == -std::numeric_limits<float>::infinity()
                                ? 0.0f
                                : std::exp(top[r] - new_top);
        const __m256 shift = _mm256_set1_ps(new_top);
        __m256 sum = _mm256_setzero_ps();
        for (int c = 0; c < kKeyVecs; ++c) {
          const __m256 p = _mm256_and_ps(
              seen[c], llmrt_kernels::exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + 8 * c), shift)));
          _mm256_storeu_ps(sr + 8 * c, p);
          sum = _mm256_add_ps(sum, p);
        }
        total[r] = total[r] * carry + llmrt_kernels::hadd8(sum);
        top[r] = new_top;
        if (carry != 1.0f) {
          const __m256 vc = _mm256_set1_ps(carry);
          float* ar = acc + r * D;
          for (int c = 0; c < NV; ++c)
            _mm256_storeu_ps(ar + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * c), vc));
        }
      }
    }
    // acc += P V: 2 rows x CV vectors of D at a time.
    constexpr int CV = NV < 4 ? NV : 4;
    constexpr int kPvRows = 2;
    for (int64_t r0 = 0; r0 < rows; r0 += kPvRows) {
      const int tr = static_cast<int>(std::min<int64_t>(kPvRows, rows - r0));
      const float* pr[kPvRows];
      for (int i = 0; i < kPvRows; ++i) pr[i] = scores + (r0 + std::min(i, tr - 1)) * kKeyBlock;
      for (int c0 = 0; c0 < NV; c0 += CV) {
        __m256 o[kPvRows][CV];
        for (int i = 0; i < kPvRows; ++i)
          for (int c = 0; c < CV; ++c)
            o[i][c] = i < tr ? _mm256_loadu_ps(acc + (r0 + i) * D + 8 * (c0 + c))
                             : _mm256_setzero_ps();
        for (int64_t t = 0; t < nk; ++t) {
          const float* vt = vb + (k0 + t) * seg.vs + 8 * c0;
          __m256 vv[CV];
          for (int c = 0; c < CV; ++c) vv[c] = _mm256_loadu_ps(vt + 8 * c);
          for (int i = 0; i < kPvRows; ++i) {
            const __m256 p = _mm256_broadcast_ss(pr[i] + t);
            for (int c = 0; c < CV; ++c) o[i][c] = _mm256_fmadd_ps(p, vv[c], o[i][c]);
          }
        }
        for (int i = 0; i < tr; ++i)
          for (int c = 0; c < CV; ++c)
            _mm256_storeu_ps(acc + (r0 + i) * D + 8 * (c0 + c), o[i][c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(
        poisoned[r] != 0.0f ? std::numeric_limits<float>::quiet_NaN() : 1.0f / total[r]);
    float* dst = seg.o + (g * group + r / positions) * seg.oh + (q0 + r % positions) * seg.os;
    for (int c = 0; c < NV; ++c)
      _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + 8 * c), inv));
  }
}
#endif  // LLMRT_X86

bool supported_head_dim(int64_t d) { return d == 16 || d == 32 || d == 64 || d == 128; }

bool causal_attention_supported(int64_t head_dim) {
  return llmrt_kernels::has_avx2() && supported_head_dim(head_dim);
}

// One task: query block [q0, q1) of KV head ``g`` of segment ``seg``.
struct Task {
  int64_t seg, g, q0, q1;
};

// Runs ``tasks`` (heaviest first: they read the most keys, so the team ends together) over
// the thread team, each thread with its own work buffer.
void run_tasks(const std::vector<Segment>& segments, std::vector<Task>& tasks, int64_t dim,
               int64_t group, float scale) {
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return segments[a.seg].offset + a.q1 > segments[b.seg].offset + b.q1;
  });
  const auto run = [&](const Task& t, std::vector<float>& work) {
    const Segment& seg = segments[t.seg];
#if defined(LLMRT_X86)
    if (!has_avx512()) {
      switch (dim) {
        case 16: attend_block_avx2<2>(seg, t.g, group, t.q0, t.q1, scale, work); break;
        case 32: attend_block_avx2<4>(seg, t.g, group, t.q0, t.q1, scale, work); break;
        case 64: attend_block_avx2<8>(seg, t.g, group, t.q0, t.q1, scale, work); break;
        default: attend_block_avx2<16>(seg, t.g, group, t.q0, t.q1, scale, work); break;
      }
      return;
    }
    switch (dim) {
      case 16: attend_block<1>(seg, t.g, group, t.q0, t.q1, scale, work); break;
      case 32: attend_block<2>(seg, t.g, group, t.q0, t.q1, scale, work); break;
      case 64: attend_block<4>(seg, t.g, group, t.q0, t.q1, scale, work); break;
      default: attend_block<8>(seg, t.g, group, t.q0, t.q1, scale, work); break;
    }
#else
    (void)seg;
    TORCH_CHECK(false, "llmrt_kernels.causal_attention: no kernel for this CPU");
#endif
  };
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int nt = std::max(1, at::get_num_threads());
  if (nt == 1 || n <= 1 || at::in_parallel_region()) {
    std::vector<float> work;
    for (const Task& t : tasks) run(t, work);
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run(tasks[i], work);
  }
#else
  // Without OpenMP: torch's pool (parallel.h), the tasks cut into one chunk per thread.
  llmrt_kernels::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> work;
    for (int64_t i = i0; i < i1; ++i) run(tasks[i], work);
  });
#endif
}

// Every query block of every KV head of ``segments`` (``lens``: queries per segment).
std::vector<Task> tasks_of(const std::vector<int64_t>& lens, int64_t kv_heads) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(lens.size()); ++s)
    for (int64_t q0 = 0; q0 < lens[s]; q0 += kQueryBlock)
      for (int64_t g = 0; g < kv_heads; ++g)
        tasks.push_back({s, g, q0, std::min(lens[s], q0 + kQueryBlock)});
  return tasks;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t rank,
                  const char* op, const char* shapes) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "llmrt_kernels.", op,
                ": q, k and v must be float32 on the CPU");
    TORCH_CHECK(t->dim() == rank, "llmrt_kernels.", op, ": q, k and v must be ", shapes);
  }
  const int64_t dim = q.size(-1), heads = q.size(-2 - (rank == 4)), kv_heads = k.size(-2 - (rank == 4));
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(-1) == dim, "llmrt_kernels.", op,
              ": k and v must have one shape, with q's head_dim");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "llmrt_kernels.", op, ": query heads (",
              heads, ") must be a multiple of KV heads (", kv_heads, ")");
  TORCH_CHECK(causal_attention_supported(dim), "llmrt_kernels.", op,
              ": needs AVX2 and head_dim 16, 32, 64 or 128 (got ", dim, ")");
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  check_inputs(q, k, v, 4, "causal_attention", "[B, H, S, D]");
  const int64_t batch = q.size(0), heads = q.size(1), len = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1);
  TORCH_CHECK(k.size(0) == batch && k.size(2) == len,
              "llmrt_kernels.causal_attention: k and v must be [B, Hkv, S, D] like q's B, S, D");
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  // [B, S, H, D] storage, returned as its [B, H, S, D] view.
  at::Tensor out = at::empty({batch, len, heads, dim}, q.options()).transpose(1, 2);
  if (out.numel() == 0) return out;
  const float* qp = qc.const_data_ptr<float>();
  const float* kp = kc.const_data_ptr<float>();
  const float* vp = vc.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const Strides qs = strides_of(qc), ks = strides_of(kc), vs = strides_of(vc), os = strides_of(out);
  std::vector<Segment> segments;
  for (int64_t b = 0; b < batch; ++b)
    segments.push_back({qp + b * qs.b, qs.h, qs.s, kp + b * ks.b, ks.h, ks.s, vp + b * vs.b, vs.h,
                        vs.s, op + b * os.b, os.h, os.s, 0});
  std::vector<Task> tasks = tasks_of(std::vector<int64_t>(batch, len), kv_heads);
  run_tasks(segments, tasks, dim, heads / kv_heads, static_cast<float>(scale));
  return out;
}

// Ragged sequences packed back to back (no padding): q ``[T, H, D]``, k and v ``[Tk, Hkv, D]``;
// sequence b's queries are rows q_starts[b]..q_starts[b + 1] of q and its keys rows
// k_starts[b]..k_starts[b + 1] of k and v, the queries being its last keys (query i of a
// sequence with n queries and m keys sees keys 0..m - n + i). Returns ``[T, H, D]``.
at::Tensor varlen_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& q_starts, const at::Tensor& k_starts,
                                   double scale) {
  check_inputs(q, k, v, 3, "varlen_causal_attention", "[tokens, heads, head_dim]");
  for (const auto* t : {&q_starts, &k_starts})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 &&
                    t->numel() == q_starts.numel() && t->numel() >= 1,
                "llmrt_kernels.varlen_causal_attention: q_starts and k_starts must be int64 "
                "CPU vectors of one length (sequences + 1)");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  const at::Tensor qc = q.is_contiguous() ? q : q.contiguous();
  const at::Tensor kc = k.is_contiguous() ? k : k.contiguous();
  const at::Tensor vc = v.is_contiguous() ? v : v.contiguous();
  const at::Tensor qst = q_starts.contiguous(), kst = k_starts.contiguous();
  const int64_t* qb = qst.const_data_ptr<int64_t>();
  const int64_t* kb = kst.const_data_ptr<int64_t>();
  const int64_t n = q_starts.numel() - 1;
  TORCH_CHECK(qb[0] == 0 && kb[0] == 0 && qb[n] == q.size(0) && kb[n] == k.size(0),
              "llmrt_kernels.varlen_causal_attention: starts must run from 0 to the row counts (",
              q.size(0), " queries, ", k.size(0), " keys)");
  at::Tensor out = at::empty(qc.sizes(), q.options());
  const float* qp = qc.const_data_ptr<float>();
  const float* kp = kc.const_data_ptr<float>();
  const float* vp = vc.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  std::vector<Segment> segments;
  std::vector<int64_t> lens;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t nq = qb[b + 1] - qb[b], nk = kb[b + 1] - kb[b];
    TORCH_CHECK(nq >= 0 && nk >= nq,
                "llmrt_kernels.varlen_causal_attention: sequence ", b, " has ", nq,
                " queries and ", nk, " keys (needs 0 <= queries <= keys)");
    segments.push_back({qp + qb[b] * heads * dim, dim, heads * dim, kp + kb[b] * kv_heads * dim,
                        dim, kv_heads * dim, vp + kb[b] * kv_heads * dim, dim, kv_heads * dim,
                        op + qb[b] * heads * dim, dim, heads * dim, nk - nq});
    lens.push_back(nq);
  }
  std::vector<Task> tasks = tasks_of(lens, kv_heads);
  run_tasks(segments, tasks, dim, heads / kv_heads, static_cast<float>(scale));
  return out;
}

bool causal_attention_supported_op(int64_t head_dim) {
  return causal_attention_supported(head_dim);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def(
      "varlen_causal_attention(Tensor q, Tensor k, Tensor v, Tensor q_starts, Tensor k_starts, "
      "float scale) -> Tensor");
  m.def("causal_attention_supported(int head_dim) -> bool", &causal_attention_supported_op);
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) {
  m.impl("causal_attention", &causal_attention);
  m.impl("varlen_causal_attention", &varlen_causal_attention);
}
