// The interleaved layout's integer-dot kernels for arm64 (interleaved_neon.cpp): the same
// prepared activations (two int8 levels per 32-wide block, interleaved.cpp's kGroupPrep bytes
// per group) and the same sums as the x86 tiles, at three levels: NEON (widening multiplies,
// smull/smlal + sadalp), +dotprod (sdot) and +i8mm (smmla, two activation rows against two
// weight rows at once). interleaved.cpp calls them only where ``has_neon()`` holds; on other
// CPUs the unit compiles to nothing.
#pragma once

#include <cstdint>

namespace llmrt_kernels {

// Bytes of one group's prepared activations (the layout interleaved.cpp documents).
constexpr int64_t kInterleavedGroupPrep = 2 * 128 + 64 + 64;

// One row of x (k floats) as the group records ``interleaved_range_neon`` reads.
void interleaved_prepare_row_neon(const float* x, int64_t k, int64_t base, uint8_t* prep);

// y[r * ldy + j] for rows r < rows_m of the prepared activations (``prep_stride`` bytes per
// row) against interleaved weight rows j in [n0, n1), at the running arm64 level.
void interleaved_range_neon(const uint8_t* prep, int64_t prep_stride, int64_t rows_m,
                            const uint8_t* w, int64_t row_bytes, int64_t base, int64_t k,
                            float* y, int64_t ldy, int64_t n0, int64_t n1);

}  // namespace llmrt_kernels
