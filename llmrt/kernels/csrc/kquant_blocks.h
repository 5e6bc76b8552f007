// The GGUF block types beyond Q4_0 / Q4_1 / Q8_0 that llmrt runs from their blocks
// (kquants.cpp): the 5-bit 32-weight blocks, the K-quant 256-weight super-blocks, and the
// 16-bit float rows. Layouts are ggml's (ggml-common.h); llmrt/kernels/formats.py is the
// Python side of the same table.
//
//   Q5_0 (type 6, 22 B / 32):  fp16 d, u32 qh, 16 B qs;      w = d * (q - 16)
//   Q5_1 (type 7, 24 B / 32):  fp16 d, fp16 m, u32 qh, 16 B qs; w = d * q + m
//       q = (qs[j] & 15 | bit j of qh << 4) for j < 16, (qs[j-16] >> 4 | bit j of qh << 4) after
//   Q4_K (type 12, 144 B / 256): fp16 d, fp16 dmin, 12 B of eight 6-bit (scale, min) pairs,
//       128 B qs; eight 32-weight groups, w = d * sc * q - dmin * m; group 2i takes the low
//       nibbles of qs[32i .. 32i+31], group 2i+1 the high ones
//   Q5_K (type 13, 176 B / 256): as Q4_K plus 32 B qh: bit g of qh[l] is the fifth bit of
//       weight l of group g
//   Q6_K (type 14, 210 B / 256): 128 B ql, 64 B qh, 16 int8 scales (one per 16 weights),
//       fp16 d; w = d * sc * (q - 32), q six bits: nibble of ql | two bits of qh << 4
//   F16 (type 1), BF16 (type 30): one 16-bit float per weight
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <ATen/core/Tensor.h>

#include "cpu.h"

namespace llmrt_kernels {

constexpr int64_t kF16 = 1;
constexpr int64_t kQ5_0 = 6;
constexpr int64_t kQ5_1 = 7;
constexpr int64_t kQ4_K = 12;
constexpr int64_t kQ5_K = 13;
constexpr int64_t kQ6_K = 14;
constexpr int64_t kBF16 = 30;
// Weights per K-quant super-block (ggml's QK_K).
constexpr int64_t kQK = 256;

struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "ggml 5-bit block sizes");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210,
              "ggml K-quant block sizes");

// Whether kquants.cpp runs ``kind`` (a ggml type id, layout bit cleared).
constexpr bool is_kquant_kind(int64_t kind) {
  return kind == kF16 || kind == kQ5_0 || kind == kQ5_1 || kind == kQ4_K || kind == kQ5_K ||
         kind == kQ6_K || kind == kBF16;
}

// Weights per block of ``kind`` (one of is_kquant_kind).
constexpr int64_t kquant_block_weights(int64_t kind) {
  return (kind == kF16 || kind == kBF16) ? 1 : ((kind == kQ5_0 || kind == kQ5_1) ? 32 : kQK);
}

// Bytes per block of ``kind`` (one of is_kquant_kind).
constexpr int64_t kquant_block_bytes(int64_t kind) {
  switch (kind) {
    case kQ5_0: return sizeof(BlockQ5_0);
    case kQ5_1: return sizeof(BlockQ5_1);
    case kQ4_K: return sizeof(BlockQ4_K);
    case kQ5_K: return sizeof(BlockQ5_K);
    case kQ6_K: return sizeof(BlockQ6_K);
    default: return 2;  // F16, BF16
  }
}

// Entry points (kquants.cpp), the counterparts of linear.h's for these kinds. A row of x is
// prepared once (``kquant_prepare``: two-level 8-bit activations per 32 values, see there;
// nothing for F16 / BF16), then any range of output columns is computed from it.
int64_t kquant_prep_bytes(int64_t kind, int64_t k);
void kquant_prepare(const float* x, int64_t r0, int64_t r1, int64_t kind, int64_t k,
                    uint8_t* prep);
// The per-32 prepared groups whatever the level (kquant_gemm.cpp's panels read them; the
// K-quant GEMVs at AVX2 below AVX-512 VNNI read per-256 blocks from kquant_prepare instead).
void kquant_prepare_groups(const float* x, int64_t r0, int64_t r1, int64_t k, uint8_t* prep);
void kquant_range(const float* x, int64_t rows_m, const uint8_t* w, int64_t row_bytes,
                  int64_t kind, int64_t k, const uint8_t* prep, float* y, int64_t n, int64_t n0,
                  int64_t n1);
// Rows [r0, r1) of a weight of ``kind`` as float32 (``out`` row r at out + r * k), one thread.
void kquant_dequantize(const uint8_t* w, int64_t row_bytes, int64_t kind, int64_t k, float* out,
                       int64_t r0, int64_t r1);

// A Q4_K / Q5_K / Q6_K block's scales (kquants.cpp): for group g (32 weights) and half h,
// a[2g + h] and b[2g + h] of w = a * q - b, q the unsigned quants.
void kquant_unpack_scales(const uint8_t* blk, int64_t kind, float* a, float* b);

// Many rows against a Q4_K / Q5_K / Q6_K weight, or (AVX2 without VNNI) an interleaved Q4_0 /
// Q4_1 one (kquant_gemm.cpp): the integer GEMM, taken by linear_into where
// ``takes_kquant_gemm`` says so (``kind`` the kernel type code, layout bit included).
constexpr int64_t kKquantGemmMinRows = 8;
// Interleaved Q4 at AVX2: from here the panels' loop replaces dequantize + sgemm (below it the
// interleaved layout's own AVX2 GEMM is faster).
constexpr int64_t kQ4GemmMinRowsAvx2 = 128;
// ... and from this many output columns (n). Below it interleaved_gemm.cpp's AVX2 loop
// (16-column panels, from a shared counter) took 0.87-0.89x the panels' CPU time on SmolLM2's
// 576x576 Q4_1, 0.65x on 192x576, 0.96-0.97x on 960x576 at 128-512 rows in every run (one
// thread, forced avx2, alternated in one process, minimum of 11-15 under load 10-13), and
// tied on 576x1536 (0.85-1.08x between runs) and Llama-3.2-1B's 512x2048 Q4_0 (1.00-1.03x);
// from 1536 columns the panels won or tied (0.9-1.09x on SmolLM2's 1536x576 and 3072x576
// between runs; 1.2-1.37x on 1B's 2048x2048, 3072x2048, 16384x2048 and 2048x8192). Narrow
// outputs also split into few of the panels' pack blocks (16 panels each: 576 columns make 5),
// which two threads share unevenly.
constexpr int64_t kQ4GemmMinColsAvx2 = 1024;
// At avx_vnni interleaved_gemm.cpp's loop runs vpdpwssd (one instruction per 16-bit pair
// product and sum) and won more: 0.57-0.90x the panels' CPU time on every SmolLM2 shape above
// (576 to 3072 columns) and 0.81-0.93x on 1B's 512x2048 and 2048x2048, tied on 3072x2048
// (1.01x); the panels kept 16384x2048 (I 1.06x) and the 8192-deep 2048x8192 (I 1.07x).
constexpr int64_t kQ4GemmMinColsAvxVnni = 4096;
constexpr int64_t kQ4GemmMinDepthAvxVnni = 4096;
// Rows up to which the GEMM beats dequantize + MKL's sgemm (``kquant_gemm_max_rows``; the
// Python policy dequantizes above it). Measured with Llama-3.2-1B's ffn_gate (Q4_K 8192x2048)
// and ffn_down (Q6_K 2048x8192), 2 threads, alternated in one process: forced AVX2 2.4-4x at
// 16-64 rows, 1.3x (Q4_K) and 1.0x (Q6_K) at 512, so every row count; AVX-512 VNNI (its
// 256-bit vpdpbusd tile against the AVX-512 sgemm) 2.5-3x at 16-64 rows, 1.1x and 0.86x at
// 512, so up to 256.
constexpr int64_t kKquantGemmMaxRowsVnni = 256;
int64_t kquant_gemm_max_rows(int64_t kind);
bool takes_kquant_gemm(int64_t kind, int64_t rows, int64_t n, int64_t k);  // n out, k in
void kquant_gemm(const float* x, int64_t rows, const uint8_t* w, int64_t rb, int64_t kind,
                 int64_t k, float* y, int64_t n);

// A stacked weight (stacked.cpp): a linear whose row ranges are stored in different kinds (a
// fused q/k/v of a llama.cpp mix), kept as one uint8 ``[rows, X]`` blob: a header of int64s
// (kStackedMagic, parts, then kind, rows, row_bytes, byte offset per part) and each part's
// rows. Its kind code is kStacked with the parts' kind codes (layout bit included) in 10-bit
// fields from bit 16, so the prepared-activation size follows from the code alone.
constexpr int64_t kStacked = int64_t{1} << 62;
constexpr int kStackedMaxParts = 4;
constexpr int64_t kStackedMagic = 0x4B53544B4C4C4D00;  // "\0MLLKTSK"
constexpr bool is_stacked_kind(int64_t kind) { return (kind & kStacked) != 0; }
constexpr int64_t stacked_part_kind(int64_t kind, int i) { return (kind >> (16 + 10 * i)) & 1023; }

int64_t stacked_prep_bytes(int64_t kind, int64_t k);
void stacked_prepare(const float* x, int64_t r0, int64_t r1, int64_t rows, int64_t kind,
                     int64_t k, uint8_t* prep);
void stacked_range(const float* x, int64_t rows_m, const uint8_t* blob, int64_t n, int64_t kind,
                   int64_t k, const uint8_t* prep, float* y, int64_t n0, int64_t n1);
void stacked_dequantize(const uint8_t* blob, int64_t kind, int64_t k, float* out);
void stacked_check(const at::Tensor& blob, int64_t kind, int64_t k);

}  // namespace llmrt_kernels
