// The linear kernels' entry point shared by the C++ ops (gguf_blocks.cpp defines it).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace llmrt_kernels {

// Weight kind of a dense float32 [out, in] matrix; ggml block kinds use their type ids (2, 3, 8).
constexpr int64_t kDenseF32 = 0;
// Added to a ggml type id: the blocks are in the interleaved layout (interleaved.cpp).
constexpr int64_t kInterleaved = 256;

// Throws unless ``w`` is a weight of ``kind`` with ``in_features`` columns.
void check_weight(const at::Tensor& w, int64_t kind, int64_t in_features);

// y[m, n] = sum_k x[m, k] * W[n, k] for rows_m contiguous rows of x (float32), parallel over n.
void linear_into(const float* x, int64_t rows_m, const at::Tensor& w, int64_t kind, int64_t k,
                 float* y);

// A linear split across a team of threads: each row of x prepared once (``linear_prepare``
// over disjoint row ranges into ``prep``, ``linear_prep_bytes`` per row; nothing for kinds
// that read float32 x directly), then each thread computes its own output columns.
// ``rows`` is the linear's whole row count (it picks the kernel, and so the prepared form);
// ``linear_chunk_unit`` is the column granule a team should split the linear's output in.
int64_t linear_prep_bytes(int64_t kind, int64_t k);
void linear_prepare(const float* x, int64_t r0, int64_t r1, int64_t rows, int64_t kind, int64_t k,
                    uint8_t* prep);
int64_t linear_chunk_unit(int64_t kind, int64_t rows);
void linear_range(const float* x, int64_t rows_m, const at::Tensor& w, int64_t kind, int64_t k,
                  const uint8_t* prep, float* y, int64_t n0, int64_t n1);

// linear_range on a raw weight: ``n`` rows of ``rb`` bytes (float32 rows for kDenseF32) at
// ``data`` (stacked.cpp runs each row range of a stacked weight through it).
void linear_range_rows(const float* x, int64_t rows_m, const void* data, int64_t n, int64_t rb,
                       int64_t kind, int64_t k, const uint8_t* prep, float* y, int64_t n0,
                       int64_t n1);

// Rows of a block weight of ``kind`` (either layout) as float32 ``[rows, k]``.
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t kind, int64_t k, float* out,
                     int64_t rows);

// The interleaved layout's kernels (interleaved.cpp); ``base`` is the ggml type id.
int64_t interleaved_prep_bytes(int64_t base, int64_t k);
void interleaved_prepare(const float* x, int64_t r0, int64_t r1, int64_t base, int64_t k,
                         uint8_t* prep);
void interleaved_range(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes,
                       int64_t base, int64_t k, const uint8_t* prep, float* y, int64_t n,
                       int64_t n0, int64_t n1);
// Many activation rows against an interleaved block weight (interleaved_gemm.cpp): y[m, n]
// for rows_m rows, parallel over panels of output columns; only where
// ``takes_integer_gemm`` says so.
void interleaved_gemm(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes,
                      int64_t base, int64_t k, float* y, int64_t n);
// The same GEMM split across a team (a decode step of many rows): rows prepared once
// (``interleaved_gemm_prepare`` over disjoint row ranges, ``interleaved_gemm_prep_bytes`` per
// row), then each thread's output columns [n0, n1).
int64_t interleaved_gemm_prep_bytes(int64_t k);
void interleaved_gemm_prepare(const float* x, int64_t r0, int64_t r1, int64_t k, uint8_t* prep);
void interleaved_gemm_range(const uint8_t* prep, int64_t rows, const uint8_t* w,
                            int64_t row_bytes, int64_t base, int64_t k, float* y, int64_t n,
                            int64_t n0, int64_t n1);
// Activation rows from which interleaved blocks take the integer GEMM over the tile loop
// (SmolLM2's linears, 2 threads: 1.3-1.6x at 16 rows, 1.4-1.8x at 32, 1.7-2.8x from 64).
constexpr int64_t kInterleavedGemmMinRows = 16;
// The same at AVX2 (its 16-bit product loop against the AVX2 tile loop and dequantize + MKL
// sgemm, one thread, forced avx2, CPU time: 0.43-0.63x the sgemm's at 16 rows, 0.76-0.88x at
// 64, 1.06x at 512; the tile loop is slower than either from 16 rows). Above ~128 rows the
// Python policy dequantizes (``integer_gemm_supported`` is false at AVX2).
constexpr int64_t kInterleavedGemmMinRowsAvx2 = 16;
// Whether ``rows`` activation rows of a linear of ``kind`` run the integer GEMM.
bool takes_integer_gemm(int64_t kind, int64_t rows);
// bfloat16 bits of the dequantized weight; false (nothing written) where this CPU or kind
// has no direct path.
bool interleaved_dequantize_bf16(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k,
                                 uint16_t* out, int64_t rows);
void interleaved_dequantize(const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k,
                            float* out, int64_t rows);

}  // namespace llmrt_kernels
