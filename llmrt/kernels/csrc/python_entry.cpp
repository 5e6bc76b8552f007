// A plain Python entry to the decode step: the library is also a pybind11 extension module
// (``llmrt.kernels.native.python_entry`` imports it from the same file).
//
// Why: a step's Python call into a TorchScript class method goes through the script
// interpreter's argument matching, and right after a step has streamed ~100 MB of weights
// through the caches that path misses on most of what it touches: ~180 us per call (an empty
// step, after a 256 MB read) against ~60 us through pybind11, and SmolLM2's batch-1 step in a
// loop was 4-8% faster called this way with a thin Python caller (in-process A/B, medians).

#include <torch/extension.h>

namespace llmrt_kernels {
at::Tensor decode_step_at(int64_t address, const at::Tensor& tokens, const at::Tensor& positions,
                          const at::Tensor& page_table);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "llmrt kernels: direct Python entries";
  // The GIL is released for the step (as a torch op call does): a server's other threads
  // keep running while a lane steps.
  m.def("decode_step", &llmrt_kernels::decode_step_at,
        "DecodeStack.step_bound of the stack at `address` (see DecodeStack.address)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
