// The interleaved layout's integer-dot kernels at the avx_vnni level (interleaved_avxvnni.cpp):
// AVX2 with the VEX-encoded 256-bit vpdpbusd (u8 x s8, four products summed into each s32
// lane, added to the accumulator in one instruction) in place of AVX2's vpmaddubsw +
// vpmaddwd (+ vpaddd). Same layout and prepared activations as the AVX2 tiles
// (interleaved.cpp), the same integer per lane and the same float operations in the same
// order, so the same bits. interleaved.cpp calls it only where ``has_avx_vnni()`` holds and
// AVX-512 VNNI does not; off x86 the unit compiles to nothing.
#pragma once

#include <cstdint>

namespace llmrt_kernels {

// y[r * ldy + j] for rows r < rows_m of the prepared activations (``prep_stride`` bytes per
// row, interleaved_prepare's AVX2 bytes) against interleaved weight rows j in [n0, n1).
void interleaved_range_avx_vnni(const uint8_t* prep, int64_t prep_stride, int64_t rows_m,
                                const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k,
                                float* y, int64_t ldy, int64_t n0, int64_t n1);

}  // namespace llmrt_kernels
