// The instruction set the kernels' fast paths are compiled for, and the run-time check that
// picks them: AVX-512 (F, BW, VL) with F16C and FMA. Functions marked LLMRT_AVX512 are
// compiled for it whatever the build flags say; callers take them only when has_avx512().
// LLMRT_KERNELS_ISA=portable (read once per process) makes every check false, so the
// portable loops a CPU without AVX-512 runs can be tested on one that has it.
#pragma once

#include <cstdlib>
#include <cstring>

#define LLMRT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))

namespace llmrt_kernels {

inline bool portable_forced() {
  static const bool forced = [] {
    const char* isa = std::getenv("LLMRT_KERNELS_ISA");
    return isa != nullptr && std::strcmp(isa, "portable") == 0;
  }();
  return forced;
}

inline bool has_avx512() {
  static const bool ok = !portable_forced() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                         __builtin_cpu_supports("fma");
  return ok;
}

// AVX-512 BF16 conversions (vcvtneps2bf16), on top of has_avx512().
inline bool has_avx512_bf16() {
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
}

}  // namespace llmrt_kernels
