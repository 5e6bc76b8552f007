// The kernels' parallel loops: ``llmrt_kernels::parallel_for`` (at::parallel_for's contract:
// f(b0, b1) over disjoint sub-ranges covering [begin, end), at least ``grain`` each where the
// range allows).
//
// Built with OpenMP (g++; clang with libomp): at::parallel_for itself, an OpenMP region on the
// team torch's own ops use. Built without OpenMP (Apple clang rejects a bare -fopenmp; the
// clang cross build for arm64 has no aarch64 libomp): at::parallel_for's header then compiles
// to a serial loop, so here the range is cut into at most at::get_num_threads() chunks that
// the calling thread and helpers queued on torch's inter-op thread pool (at::launch) claim
// one by one. No thread of llmrt's own, and no deadlock when that pool is busy or small: the
// caller claims chunks too, so it can finish the loop alone, and a helper that starts after
// every chunk is claimed returns without touching the loop. The fused decode step's team (an
// OpenMP region whose members meet at barriers) cannot be built this way: without OpenMP it
// runs on one thread and the Python policy does not pick it (``kernels_openmp``).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if !defined(_OPENMP)
#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

#include "cpu.h"  // cpu_relax
#endif

namespace llmrt_kernels {

#if defined(_OPENMP)
constexpr bool kOpenMP = true;

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}
#else
constexpr bool kOpenMP = false;

namespace detail {
// Set on a thread while it runs a chunk: a parallel_for inside one runs inline (as
// at::parallel_for does inside a parallel region).
inline thread_local bool in_pool_chunk = false;

struct PoolLoop {
  std::atomic<int64_t> next{0};  // the next chunk to claim
  std::atomic<int64_t> done{0};  // chunks finished
  std::atomic<bool> failed{false};
  std::exception_ptr error;      // the first chunk's exception (written by who set failed)
  std::mutex mu;
  std::condition_variable finished;
};
}  // namespace detail

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin, g = std::max<int64_t>(grain, 1);
  int64_t chunks = std::min<int64_t>(std::max(1, at::get_num_threads()), (n + g - 1) / g);
  if (chunks <= 1 || detail::in_pool_chunk || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t size = (n + chunks - 1) / chunks;
  chunks = (n + size - 1) / size;
  const auto loop = std::make_shared<detail::PoolLoop>();
  // Claims and runs chunks until none is left. Touches f only for a claimed chunk, which
  // the caller (still waiting for it) keeps alive.
  const auto run = [&f, begin, end, size, chunks](detail::PoolLoop& st) {
    detail::in_pool_chunk = true;
    for (int64_t c; (c = st.next.fetch_add(1)) < chunks;) {
      try {
        f(begin + c * size, std::min(end, begin + (c + 1) * size));
      } catch (...) {
        if (!st.failed.exchange(true)) st.error = std::current_exception();
      }
      if (st.done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(st.mu);
        st.finished.notify_all();
      }
    }
    detail::in_pool_chunk = false;
  };
  for (int64_t i = 1; i < chunks; ++i) at::launch([loop, run] { run(*loop); });
  run(*loop);
  for (int spin = 0; spin < 4096 && loop->done.load() < chunks; ++spin) cpu_relax();
  if (loop->done.load() < chunks) {
    std::unique_lock<std::mutex> lock(loop->mu);
    loop->finished.wait(lock, [&] { return loop->done.load() == chunks; });
  }
  if (loop->failed.load()) std::rethrow_exception(loop->error);
}
#endif

}  // namespace llmrt_kernels
