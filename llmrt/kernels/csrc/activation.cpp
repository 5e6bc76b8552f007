// The gated MLP activation between a prefill's two MLP GEMMs, in one pass.
//
// Why: with bfloat16 GEMMs, torch ran the gate/up output through four passes (bfloat16 to
// float32, the activation, the product, float32 to bfloat16 for the down GEMM), each over a
// [tokens, 2 x intermediate] or [tokens, intermediate] tensor: ~1.5 ms of a SmolLM2 layer's
// ~18 ms at 512 tokens. This op reads the GEMM's output once in its own dtype and writes the
// down GEMM's input in its dtype, computing in float32 in between, so the result is what
// the four passes gave (bfloat16 rounding happens at the same two places).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "cpu.h"
#include "vecmath.h"

namespace {

using llmrt_kernels::activate;
using llmrt_kernels::has_avx512;
using llmrt_kernels::has_avx512_bf16;
using llmrt_kernels::kRelu2;
using llmrt_kernels::kSilu;

#if defined(LLMRT_X86)
LLMRT_AVX512 inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
LLMRT_AVX512_BF16 inline void store16(
    c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif  // LLMRT_X86

#if defined(LLMRT_X86)
// One row: out[j] = silu(gate[j]) * up[j] (up == nullptr: silu(gate[j])); float32 output
// needs AVX-512 only, bfloat16 output its BF16 rounding too (two bodies, two targets).
template <typename In, typename Out>
LLMRT_AVX512 void silu_row_f32(const In* gate, const In* up, Out* out, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = llmrt_kernels::lanes(n - j);
    __m512 a = llmrt_kernels::silu512(llmrt_kernels::load16(gate + j, m));
    if (up != nullptr) a = _mm512_mul_ps(a, llmrt_kernels::load16(up + j, m));
    store16(out + j, a, m);
  }
}

template <typename In, typename Out>
LLMRT_AVX512_BF16 void silu_row_bf16(const In* gate, const In* up, Out* out, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = llmrt_kernels::lanes(n - j);
    __m512 a = llmrt_kernels::silu512(llmrt_kernels::load16(gate + j, m));
    if (up != nullptr) a = _mm512_mul_ps(a, llmrt_kernels::load16(up + j, m));
    store16(out + j, a, m);
  }
}

template <typename In, typename Out>
void silu_row(const In* gate, const In* up, Out* out, int64_t n) {
  if constexpr (std::is_same_v<Out, float>)
    silu_row_f32<In, Out>(gate, up, out, n);
  else
    silu_row_bf16<In, Out>(gate, up, out, n);
}
#endif  // LLMRT_X86

template <typename In, typename Out>
void scalar_row(const In* gate, const In* up, Out* out, int64_t n, int64_t kind) {
  for (int64_t j = 0; j < n; ++j) {
    float a = activate(static_cast<float>(gate[j]), kind);
    if (up != nullptr) a *= static_cast<float>(up[j]);
    out[j] = static_cast<Out>(a);
  }
}

template <typename In, typename Out>
void activate_rows(const at::Tensor& y, at::Tensor& out, int64_t kind, bool gated) {
  const int64_t width = y.size(-1), inter = out.size(-1), rows = out.numel() / std::max<int64_t>(inter, 1);
  const In* src = y.const_data_ptr<In>();
  Out* dst = out.mutable_data_ptr<Out>();
  // The vector path needs AVX-512 BF16 only where it rounds to bfloat16; AVX2 computes in
  // float32 and rounds to bfloat16 as c10 does (nearest even, as vcvtneps2bf16).
  const bool simd = kind == kSilu && (std::is_same_v<Out, float> ? has_avx512() : has_avx512_bf16());
  const bool avx2 = kind == kSilu && !simd && llmrt_kernels::has_avx2();
  const bool neon = kind == kSilu && llmrt_kernels::has_neon();  // arm64: vecmath.h
  llmrt_kernels::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf((avx2 || neon) && !std::is_same_v<Out, float> ? inter : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const In* gate = src + r * width;
      const In* up = gated ? gate + inter : nullptr;
#if defined(LLMRT_X86)
      if (simd) {
        silu_row<In, Out>(gate, up, dst + r * inter, inter);
        continue;
      }
      if (avx2) {
        if constexpr (std::is_same_v<Out, float>) {
          llmrt_kernels::silu_row_avx2<In>(gate, up, dst + r * inter, inter);
        } else {
          llmrt_kernels::silu_row_avx2<In>(gate, up, buf.data(), inter);
          for (int64_t j = 0; j < inter; ++j) dst[r * inter + j] = static_cast<Out>(buf[j]);
        }
        continue;
      }
#elif defined(LLMRT_ARM64)
      if (neon) {
        float* o = std::is_same_v<Out, float> ? reinterpret_cast<float*>(dst + r * inter) : buf.data();
        llmrt_kernels::silu_row_neon<In>(gate, up, o, inter);
        if constexpr (!std::is_same_v<Out, float>)
          for (int64_t j = 0; j < inter; ++j) dst[r * inter + j] = static_cast<Out>(buf[j]);
        continue;
      }
#endif
      {
        scalar_row<In, Out>(gate, up, dst + r * inter, inter, kind);
      }
    }
  });
}

at::Tensor mlp_activation(const at::Tensor& y, int64_t kind, bool gated, at::ScalarType dtype) {
  TORCH_CHECK(y.device().is_cpu(), "llmrt_kernels.mlp_activation: the input must be on the CPU");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16,
              "llmrt_kernels.mlp_activation: the input must be float32 or bfloat16, got ",
              y.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "llmrt_kernels.mlp_activation: the output dtype must be float32 or bfloat16, got ",
              dtype);
  TORCH_CHECK(kind >= kSilu && kind <= kRelu2, "llmrt_kernels.mlp_activation: unknown activation ",
              kind);
  TORCH_CHECK(y.dim() >= 1 && (!gated || y.size(-1) % 2 == 0),
              "llmrt_kernels.mlp_activation: a gated input needs an even last dim (gate, then up)");
  const at::Tensor x = y.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  if (gated) shape.back() /= 2;
  at::Tensor out = at::empty(shape, x.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const bool in_bf16 = x.scalar_type() == at::kBFloat16, out_bf16 = dtype == at::kBFloat16;
  if (in_bf16 && out_bf16)
    activate_rows<c10::BFloat16, c10::BFloat16>(x, out, kind, gated);
  else if (in_bf16)
    activate_rows<c10::BFloat16, float>(x, out, kind, gated);
  else if (out_bf16)
    activate_rows<float, c10::BFloat16>(x, out, kind, gated);
  else
    activate_rows<float, float>(x, out, kind, gated);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("mlp_activation(Tensor y, int activation, bool gated, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrt_kernels, CPU, m) { m.impl("mlp_activation", &mlp_activation); }
