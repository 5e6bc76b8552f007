// The instruction-set level as ops (cpu.h detects and forces it): what the kernels run at
// and what the CPU offers, so Python can check that its policies read the same level.

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "cpu.h"

namespace {

// [the level the kernels run at, the CPU's level, "bf16" when AVX-512 BF16 paths run or "",
// "avx_vnni" when AVX-VNNI paths may run (has_avx_vnni) or ""].
std::vector<std::string> kernels_isa() {
  TORCH_CHECK(llmrt_kernels::isa_error().empty(), "llmrt_kernels: ", llmrt_kernels::isa_error());
  return {llmrt_kernels::isa_name(), llmrt_kernels::cpu_isa_name(),
          llmrt_kernels::has_avx512_bf16() ? "bf16" : "",
          llmrt_kernels::has_avx_vnni() ? "avx_vnni" : ""};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrt_kernels, m) { m.def("kernels_isa() -> str[]", &kernels_isa); }
