// A probe of the clock the CPU threads run at, for benchmarks.
//
// Why: on a shared VM the same decode step took 4.4 ms one hour and 5.5 ms the next while
// the streaming read rate stayed at 30-38 GB/s. The clock separates the two causes left: a
// host that lowers the cores' clock, or other tenants contending for the same cores' pipes
// and caches (on this 2-vCPU EPYC the clock read 3.4-3.6 GHz while the step took 5.5 ms).
// The decode benchmark measures it in the same run and reports the step in cycles per byte.
//
// A chain of dependent register-register integer adds retires one add per core cycle on every
// x86-64 and arm64 core, so adds per second on each thread is that thread's clock, time slices
// lost to other tenants included. The addend is a register the compiler cannot see the value
// of: Intel cores since Golden Cove fold small immediate adds at rename, and a chain of
// ``add $1`` read 4.8-7.6 "GHz" on a 2.8 GHz Emerald Rapids. Eight adds per loop iteration keep
// the loop's own branch and counter (independent of the chain) off the critical path.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"

namespace {

// ``n`` dependent adds (rounded up to 8); returns the value so nothing is optimised away.
int64_t add_chain(int64_t n, int64_t one) {
  int64_t x = 0;
  for (int64_t i = 0; i < n; i += 8) {
#if defined(__x86_64__)
    __asm__ volatile(
        "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
        "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0"
        : "+r"(x)
        : "r"(one));
#elif defined(__aarch64__)
    __asm__ volatile(
        "add %0, %0, %1\n\tadd %0, %0, %1\n\tadd %0, %0, %1\n\tadd %0, %0, %1\n\t"
        "add %0, %0, %1\n\tadd %0, %0, %1\n\tadd %0, %0, %1\n\tadd %0, %0, %1"
        : "+r"(x)
        : "r"(one));
#else
    for (int k = 0; k < 8; ++k) __asm__ volatile("" : "+r"(x) : : "memory"), x += one;
#endif
  }
  return x;
}

// Runs ``adds`` dependent adds on every thread of torch's pool at once; returns the slowest
// thread's adds per second (the clock a step split over the pool waits for).
double dependent_adds_per_second(int64_t adds) {
  TORCH_CHECK(adds > 0, "adds must be positive, got ", adds);
  const int nt = at::get_num_threads();
  std::vector<double> seconds(static_cast<size_t>(nt), 0.0);
  std::vector<int64_t> sums(static_cast<size_t>(nt), 0);
  volatile int64_t one_source = 1;  // a value the compiler cannot fold into the chain
  const int64_t one = one_source;
  llmrt_kernels::parallel_for(0, nt, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const auto start = std::chrono::steady_clock::now();
      sums[t] = add_chain(adds, one);
      seconds[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  });
  double slowest = 0.0;
  for (int t = 0; t < nt; ++t) {
    TORCH_CHECK(sums[t] >= adds, "the add chain was cut short");
    slowest = std::max(slowest, seconds[t]);
  }
  return slowest > 0.0 ? static_cast<double>((adds + 7) / 8 * 8) / slowest
                       : std::numeric_limits<double>::infinity();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("dependent_adds_per_second(int adds) -> float", &dependent_adds_per_second);
}
