// The linear kernels' entry point shared by the C++ ops (gguf_blocks.cpp defines it).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace llmrt_kernels {

// Weight kind of a dense float32 [out, in] matrix; ggml block kinds use their type ids (2, 3, 8).
constexpr int64_t kDenseF32 = 0;

// Throws unless ``w`` is a weight of ``kind`` with ``in_features`` columns.
void check_weight(const at::Tensor& w, int64_t kind, int64_t in_features);

// y[m, n] = sum_k x[m, k] * W[n, k] for rows_m contiguous rows of x (float32), parallel over n.
void linear_into(const float* x, int64_t rows_m, const at::Tensor& w, int64_t kind, int64_t k,
                 float* y);

}  // namespace llmrt_kernels
