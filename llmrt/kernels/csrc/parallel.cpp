// How the library runs its parallel loops (parallel.h), as ops: whether it was built with
// OpenMP (the Python policy takes the fused decode step only then), and how many threads a
// parallel loop really ran on (the check that a build without OpenMP is not serial).

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "parallel.h"

namespace {

bool kernels_openmp() { return llmrt_kernels::kOpenMP; }

// The distinct threads that ran parallel_for over ``chunks`` items of grain 1. Each item
// waits (up to 10 s) until as many items have started as the loop can run at once, so a
// helper thread that exists gets its item; a loop that runs serially waits out the bound
// and reports one thread.
int64_t parallel_threads(int64_t chunks) {
  TORCH_CHECK(chunks > 0, "chunks must be positive, got ", chunks);
  const int64_t together = std::min<int64_t>(chunks, std::max(1, at::get_num_threads()));
  std::atomic<int64_t> started{0};
  std::mutex mu;
  std::set<std::thread::id> ids;
  llmrt_kernels::parallel_for(0, chunks, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      started.fetch_add(1);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (started.load() < together && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(std::this_thread::get_id());
    }
  });
  return static_cast<int64_t>(ids.size());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) {
  m.def("kernels_openmp() -> bool", &kernels_openmp);
  m.def("parallel_threads(int chunks) -> int", &parallel_threads);
}
