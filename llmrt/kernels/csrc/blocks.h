// ggml's block formats as every kernel source sees them: type ids, 32 weights per block,
// bytes per block, and the fp16 scales' decoding (llmrt/kernels/formats.py is the Python
// side of the same definitions).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <immintrin.h>
#endif

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

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
// half_at in one vcvtph2ps, for x86 kernels compiled for AVX2 and up (all include F16C).
// half_at's portable conversion (c10::Half, ~10 integer and float ops) measured ~1.4 ns per
// Q4_K block and weight row in the batch-1 K-quant GEMV, ~10% of it (one thread, AVX2).
__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}
#endif

}  // namespace llmrt_kernels
