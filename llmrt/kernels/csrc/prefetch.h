// Software prefetch a fixed distance ahead of a kernel's pass over one contiguous range of
// weight bytes (a thread's chunk of weight rows at one activation row).
//
// Why: at one activation row the GEMV kernels alternate between waiting for weight lines and
// computing on them; the hardware prefetchers alone kept too few lines in flight (they stop at
// every 4 KiB page), so the two added up instead of overlapping. On a 2-core Emerald Rapids
// VM the Q8_0 LM head (30 MB) read 10-11 GB/s without it and 16-22 GB/s with it, and
// SmolLM2's batch-1 step took 5.0 against 5.9 ms and 6.4 against 7.7 ms (medians, in-process
// A/B); 2, 4, 8 and 16 KiB ahead were within noise of each other for the 4-bit kernel, 4 KiB
// the best median of the step.
#pragma once

#include <algorithm>
#include <cstdint>

namespace llmrt_kernels {

// How far ahead of the reader lines are requested.
constexpr int64_t kAheadBytes = 4096;

// The lines of [next, end) not yet requested; ``upto(p)`` requests every line before
// ``p + kAheadBytes`` (the reader passes how far it has read). Lines past ``end`` belong to
// another thread's chunk and are left alone.
struct AheadPrefetch {
  const char* next;
  const char* end;

  AheadPrefetch(const void* begin, const void* stop)
      : next(static_cast<const char*>(begin)), end(static_cast<const char*>(stop)) {}

  inline void upto(const void* p) {
    const char* target = std::min(end, static_cast<const char*>(p) + kAheadBytes);
    for (; next < target; next += 64) __builtin_prefetch(next, 0, 3);
  }
};

}  // namespace llmrt_kernels
