// The instruction set the kernels' fast paths are compiled for, and the run-time check that
// picks them: AVX-512 (F, BW, VL) with F16C and FMA. Functions marked LLMRT_AVX512 are
// compiled for it whatever the build flags say; callers take them only when has_avx512().
#pragma once

#define LLMRT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))

namespace llmrt_kernels {

inline bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                         __builtin_cpu_supports("fma");
  return ok;
}

}  // namespace llmrt_kernels
