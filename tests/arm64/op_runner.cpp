// Runs llmrt's kernel ops without Python: the arm64 kernel tests' driver under qemu-user.
//
//   op_runner CALLS OUT
//
// CALLS is a torch.save'd list of calls, each ``(op_name, [args...])`` (op_name as
// "llmrt_kernels::gguf_linear"); an argument ``("$", i)`` stands for call i's result. Each op
// is called through the dispatcher with its registered schema, exactly as torch.ops would
// from Python; OUT receives the list of results (torch.load reads it). The checking is all in
// the Python test (tests/unit/test_kernels_arm64.py), against references made on the host.
//
// Why not Python: PyPI's aarch64 torch wheel is the CUDA build, and its Python module needs
// the CUDA libraries; libtorch_cpu alone needs only two of them by name (the build script
// links stubs for those), so the kernels are linked into this program and run here.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CALLS OUT\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "op_runner: cannot read %s\n", argv[1]);
    return 2;
  }
  // torch sizes its inter-op pool (which a build without OpenMP runs its loops on) from
  // cpuinfo, which under qemu-user reads the x86 host's /proc and sysfs as an arm64 CPU's and
  // crashes; the intra-op count comes from OMP_NUM_THREADS (the tests set it), so use that.
  at::set_num_interop_threads(at::get_num_threads());
  const std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::IValue calls = torch::jit::pickle_load(data);
  c10::impl::GenericList results(c10::AnyType::get());
  try {
    for (const c10::IValue& call : calls.toListRef()) {
      const auto& parts = call.toTupleRef().elements();
      const std::string name = parts.at(0).toStringRef();
      const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
      torch::jit::Stack stack;
      for (const c10::IValue& arg : parts.at(1).toListRef()) {
        if (arg.isTuple() && arg.toTupleRef().elements().size() == 2 &&
            arg.toTupleRef().elements()[0].isString() &&
            arg.toTupleRef().elements()[0].toStringRef() == "$") {
          stack.push_back(results.get(arg.toTupleRef().elements()[1].toInt()));
        } else {
          stack.push_back(arg);
        }
      }
      op.callBoxed(&stack);
      results.push_back(stack.size() == 1 ? stack[0] : c10::ivalue::Tuple::create(stack));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "op_runner: %s\n", e.what());
    return 1;
  }
  const std::vector<char> out = torch::jit::pickle_save(c10::IValue(results));
  std::ofstream(argv[2], std::ios::binary).write(out.data(), static_cast<std::streamsize>(out.size()));
  return 0;
}
