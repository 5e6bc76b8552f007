// The instruction-set level the kernels run at: detected once per process, forceable
// downwards, and the predicates every kernel asks before taking a fast path.
//
// Levels (each includes the ones before it):
//   x86-64: scalar < avx2 (AVX2 + FMA + F16C) < avx512 (F, BW, VL, DQ) < avx512_vnni
//   arm64:  scalar < neon < dotprod < i8mm
// plus two capability bits beside the x86 order, each kept only at the CPU's own level (a
// forced level stands for a CPU with that level's features and nothing more):
//   - AVX-512 BF16 (vcvtneps2bf16);
//   - AVX-VNNI (the VEX-encoded 256-bit vpdpbusd; CPUID 7.1 EAX bit 4, AVX state): Intel
//     Alder Lake and later client CPUs and AMD Zen 5, mostly without AVX-512, and Intel
//     Sapphire Rapids and later beside AVX-512 VNNI. It has its own name, ``avx_vnni``:
//     avx2 plus the bit. A CPU of the avx2 level with the bit is reported as ``avx_vnni``;
//     ``LLMRT_KERNELS_ISA=avx_vnni`` is allowed wherever the CPU has AVX2 and AVX-VNNI (an
//     AVX-512 CPU too: it then runs as an AVX2 CPU with AVX-VNNI), and forcing ``avx2``,
//     ``avx512`` or ``avx512_vnni`` below the CPU's own level drops the bit. Kernels take
//     the AVX-512 VNNI paths first, then AVX-VNNI's, then AVX2's.
//
// Detection: x86 reads CPUID and the OS's saved-register state (XGETBV: YMM for AVX2, the
// opmask/ZMM state for AVX-512), so a VM or kernel that does not save the wide registers
// runs the narrower code; arm64 reads getauxval(AT_HWCAP) on Linux and sysctlbyname on macOS.
// No __builtin_cpu_supports (clang rejects some of its names, and it cannot be forced).
//
// LLMRT_KERNELS_ISA=<level> (read once per process) forces any level at or below the CPU's,
// so the code another CPU runs is tested on this one; the Python side
// (llmrt/device/cpu_features.py) reads the same variable for its policies and raises a
// ConfigError for an unknown or too-high value before the library loads. Should the library
// see one anyway, it runs the scalar loops and ``isa_error()`` says why (the
// ``kernels_isa`` op raises it).
//
// Functions marked LLMRT_AVX2 / LLMRT_AVX_VNNI / LLMRT_AVX512 / LLMRT_VNNI are compiled for that level
// whatever the build flags say; callers take them only when the matching predicate holds.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#define LLMRT_X86 1
#include <cpuid.h>
#elif defined(__aarch64__)
#define LLMRT_ARM64 1
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#include <sys/types.h>
#endif
#endif

#if !defined(_OPENMP)
// Built without OpenMP (Apple clang's default): the kernels' parallel regions run on one
// thread; llmrt.kernels.native warns when it builds so.
inline int omp_get_num_threads() { return 1; }
inline int omp_get_thread_num() { return 0; }
#endif

#if defined(LLMRT_X86)
#define LLMRT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LLMRT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")))
#define LLMRT_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,f16c,fma")))
// AVX2 + AVX-VNNI (gcc 11+, clang 12+): the 256-bit _mm256_dpbusd_avx_epi32.
#define LLMRT_AVX_VNNI __attribute__((target("avxvnni,avx2,fma,f16c")))
#endif

// arm64: functions marked LLMRT_DOTPROD / LLMRT_I8MM are compiled for Armv8.2-A with the dot
// product (and the int8 matrix multiply) whatever the build flags say (NEON itself is in
// every AArch64 build). GCC spells the extensions as an arch, clang as features; clang before
// 16 declares the sdot/smmla intrinsics only under the global -march, so
// interleaved_neon.cpp calls its builtins there.
#if defined(LLMRT_ARM64)
#if defined(__clang__)
#define LLMRT_DOTPROD __attribute__((target("dotprod")))
#define LLMRT_I8MM __attribute__((target("dotprod,i8mm")))
#else
#define LLMRT_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define LLMRT_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#endif
#endif

namespace llmrt_kernels {

// The ordered levels; names index by value (x86 and arm64 share the numbers 0-3).
enum IsaLevel : int { kIsaScalar = 0, kIsa1 = 1, kIsa2 = 2, kIsa3 = 3 };
#if defined(LLMRT_X86)
constexpr int kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Vnni = 3;
constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512", "avx512_vnni"};
constexpr int kIsaCount = 4;
#elif defined(LLMRT_ARM64)
constexpr int kIsaNeon = 1, kIsaDotprod = 2, kIsaI8mm = 3;
constexpr const char* kIsaNames[] = {"scalar", "neon", "dotprod", "i8mm"};
constexpr int kIsaCount = 4;
#else
constexpr const char* kIsaNames[] = {"scalar"};
constexpr int kIsaCount = 1;
#endif

// A spinning waiter's pause (x86 ``pause``, arm64 ``yield``).
inline void cpu_relax() {
#if defined(LLMRT_X86)
  __builtin_ia32_pause();
#elif defined(LLMRT_ARM64)
  __asm__ __volatile__("yield");
#endif
}

// What the CPU (and OS) offer: its level and capability bits.
struct CpuIsa {
  int level = kIsaScalar;
  bool bf16 = false;      // x86: AVX-512 BF16 (needs the avx512 register state)
  bool avx_vnni = false;  // x86: AVX-VNNI (needs the avx2 level)
  // x86: 512-bit ops issue as two 256-bit halves (AMD family 19h: Zen 4), so a kernel's
  // zmm form only pays where it also saves work; read from CPUID leaves 0 and 1.
  bool zmm_halves = false;
};

#if defined(LLMRT_X86)
// The name of the level beside the x86 order (avx2 + AVX-VNNI).
constexpr const char* kIsaAvxVnniName = "avx_vnni";
#endif

// A level's name: its place in the order, or ``avx_vnni`` for an avx2 CPU with AVX-VNNI.
inline const char* isa_name_of(const CpuIsa& isa) {
#if defined(LLMRT_X86)
  if (isa.level == kIsaAvx2 && isa.avx_vnni) return kIsaAvxVnniName;
#endif
  return kIsaNames[isa.level];
}

#if defined(LLMRT_X86)
inline uint64_t xgetbv0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

inline CpuIsa detect_cpu_isa() {
  CpuIsa isa;
#if defined(LLMRT_X86)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return isa;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28),
             f16c = c & (1u << 29);
  if (!osxsave || !avx) return isa;
  const uint64_t xcr0 = xgetbv0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;      // SSE + AVX state saved by the OS
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;    // + opmask, ZMM_Hi256, Hi16_ZMM
  unsigned b7 = 0, c7 = 0, d7 = 0, a7 = 0;
  if (!__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) return isa;
  const bool avx2 = b7 & (1u << 5);
  if (!(ymm_state && avx2 && fma && f16c)) return isa;
  isa.level = kIsaAvx2;
  unsigned a71 = 0, b71 = 0, c71 = 0, d71 = 0;
  const bool leaf71 = a7 >= 1 && __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
  isa.avx_vnni = leaf71 && (a71 & (1u << 4));
  const bool f = b7 & (1u << 16), dq = b7 & (1u << 17), bw = b7 & (1u << 30),
             vl = b7 & (1u << 31);
  if (!(zmm_state && f && dq && bw && vl)) return isa;
  isa.level = kIsaAvx512;
  if (c7 & (1u << 11)) isa.level = kIsaAvx512Vnni;
  unsigned a0 = 0, b0 = 0, c0 = 0, d0 = 0;
  const bool amd = __get_cpuid(0, &a0, &b0, &c0, &d0) && b0 == 0x68747541u &&
                   d0 == 0x69746e65u && c0 == 0x444d4163u;  // "Auth" "enti" "cAMD"
  const unsigned base_family = (a >> 8) & 0xF;
  const unsigned family = base_family + (base_family == 0xF ? (a >> 20) & 0xFF : 0);
  isa.zmm_halves = amd && family == 0x19;
  isa.bf16 = leaf71 && (a71 & (1u << 5));
#elif defined(LLMRT_ARM64)
  isa.level = kIsaNeon;  // Advanced SIMD is part of every AArch64 profile Linux and macOS run
#if defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  const bool dotprod = hw & (1ul << 20);  // HWCAP_ASIMDDP
  const bool i8mm = hw2 & (1ul << 13);    // HWCAP2_I8MM
#elif defined(__APPLE__)
  auto flag = [](const char* name) {
    int v = 0;
    size_t n = sizeof(v);
    return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v != 0;
  };
  const bool dotprod = flag("hw.optional.arm.FEAT_DotProd");
  const bool i8mm = flag("hw.optional.arm.FEAT_I8MM");
#else
  const bool dotprod = false, i8mm = false;
#endif
  if (dotprod) isa.level = kIsaDotprod;
  if (dotprod && i8mm) isa.level = kIsaI8mm;
#endif
  return isa;
}

// The level the kernels run at, the CPU's, and the forcing's error (empty when fine).
struct IsaState {
  CpuIsa cpu;
  CpuIsa run;
  std::string error;
};

// The names LLMRT_KERNELS_ISA may take on a CPU ``cpu``, in order (x86: avx_vnni after avx2).
inline std::string allowed_levels(const CpuIsa& cpu) {
  std::string s;
  for (int i = 0; i <= cpu.level; ++i) {
    s += std::string(i ? ", " : "") + kIsaNames[i];
#if defined(LLMRT_X86)
    if (i == kIsaAvx2 && cpu.avx_vnni) s += std::string(", ") + kIsaAvxVnniName;
#endif
  }
  return s;
}

// The CPU's own name runs every bit it has; a chain level below it runs without the bits;
// ``avx_vnni`` runs avx2 + AVX-VNNI wherever the CPU has both.
inline IsaState make_isa_state(const char* forced, const CpuIsa& cpu) {
  IsaState st;
  st.cpu = cpu;
  st.run = st.cpu;
  if (forced == nullptr || forced[0] == '\0') return st;
  if (std::strcmp(forced, isa_name_of(st.cpu)) == 0) return st;
#if defined(LLMRT_X86)
  if (std::strcmp(forced, kIsaAvxVnniName) == 0 && st.cpu.level >= kIsaAvx2 && st.cpu.avx_vnni) {
    st.run = CpuIsa{kIsaAvx2, false, true};
    return st;
  }
#endif
  for (int i = 0; i < kIsaCount; ++i) {
    if (std::strcmp(forced, kIsaNames[i]) != 0) continue;
    if (i > st.cpu.level) break;
    st.run = CpuIsa{i, false, false};
    return st;
  }
  st.error = std::string("LLMRT_KERNELS_ISA=") + forced + " is not one of this CPU's levels (" +
             allowed_levels(st.cpu) + ")";
  st.run = CpuIsa{};
  std::fprintf(stderr, "llmrt_kernels: %s; running the scalar loops\n", st.error.c_str());
  return st;
}

inline const IsaState& isa_state() {
  static const IsaState st = make_isa_state(std::getenv("LLMRT_KERNELS_ISA"), detect_cpu_isa());
  return st;
}

inline int isa_level() { return isa_state().run.level; }
inline const char* isa_name() { return isa_name_of(isa_state().run); }
inline const char* cpu_isa_name() { return isa_name_of(isa_state().cpu); }
inline const std::string& isa_error() { return isa_state().error; }

#if defined(LLMRT_X86)
inline bool has_avx2() { return isa_level() >= kIsaAvx2; }
inline bool has_avx512() { return isa_level() >= kIsaAvx512; }
inline bool has_avx512_vnni() { return isa_level() >= kIsaAvx512Vnni; }
inline bool has_avx512_bf16() { return has_avx512() && isa_state().run.bf16; }
inline bool has_avx_vnni() { return has_avx2() && isa_state().run.avx_vnni; }
inline bool zmm_halves() { return isa_state().cpu.zmm_halves; }
inline bool has_neon() { return false; }
inline bool has_dotprod() { return false; }
inline bool has_i8mm() { return false; }
#else
inline bool has_avx2() { return false; }
inline bool has_avx512() { return false; }
inline bool has_avx512_vnni() { return false; }
inline bool has_avx512_bf16() { return false; }
inline bool zmm_halves() { return false; }
inline bool has_avx_vnni() { return false; }
#if defined(LLMRT_ARM64)
inline bool has_neon() { return isa_level() >= kIsaNeon; }
inline bool has_dotprod() { return isa_level() >= kIsaDotprod; }
inline bool has_i8mm() { return isa_level() >= kIsaI8mm; }
#else
inline bool has_neon() { return false; }
inline bool has_dotprod() { return false; }
inline bool has_i8mm() { return false; }
#endif
#endif

}  // namespace llmrt_kernels
