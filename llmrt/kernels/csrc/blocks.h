// ggml's block formats as every kernel source sees them: type ids, 32 weights per block,
// bytes per block, and the fp16 scales' decoding (llmrt/kernels/formats.py is the Python
// side of the same definitions).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace llmrt_kernels {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;

// Bytes of one 32-weight block of a ggml type id (Q4_0, Q4_1 or Q8_0).
constexpr int64_t block_bytes_of(int64_t kind) {
  return kind == kQ4_0 ? 18 : (kind == kQ4_1 ? 20 : 34);
}

// The fp16 value stored at ``p`` (unaligned).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

}  // namespace llmrt_kernels
