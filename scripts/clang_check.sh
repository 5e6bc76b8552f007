#!/usr/bin/env bash
# llmrt's CPU kernels built with clang on this (x86-64) machine, and the kernel suite run
# against that build at this CPU's level and at every level below it (LLMRT_KERNELS_ISA), then
# built without OpenMP (LLMRT_KERNELS_OPENMP=0, Apple clang's build) against its suite.
#
#   apt-get install clang libomp-dev     # once; without libomp-dev the library builds
#                                        # without OpenMP (loops on torch's inter-op pool)
#   scripts/clang_check.sh [CLANGXX]     # default clang++
#
# The build directory's name covers the compiler ($CXX), so the clang build sits beside the
# gcc one (llmrt/kernels/_build/) and each process loads the build of the $CXX it runs with.
# With libomp the library runs its parallel regions on LLVM's OpenMP runtime beside the
# libgomp torch loads: two thread pools, each sized by OMP_NUM_THREADS.
# The cheap per-commit check is tests/unit/test_kernels_clang.py (every source compiled by
# clang for x86-64 and aarch64); arm64 itself: scripts/arm_check.sh --run.
set -euo pipefail
cd "$(dirname "$0")/.."
export CXX=${1:-clang++}
PY=${PYTHON:-python3}
if [[ -x .venv/bin/python && -z "${PYTHON:-}" ]]; then PY=.venv/bin/python; fi
"$CXX" --version | head -1
"$PY" -m llmrt.kernels.native
"$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_kernels_gguf_blocks.py tests/unit/test_kernels_interleaved.py \
  tests/unit/test_kernels_q8_gemm_interleaved.py \
  tests/unit/test_kernels_kquants.py tests/unit/test_kernels_activation.py \
  tests/unit/test_kernels_rope.py tests/unit/test_kernels_causal_attention.py \
  tests/unit/test_kernels_isa.py tests/unit/test_kernels_threads.py \
  tests/unit/test_families_norm.py tests/parity/test_fused_decode.py
# every lower level (the slow ones too)
"$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/unit/test_kernels_isa_levels.py
# built without OpenMP, as Apple clang builds (loops on torch's inter-op pool, csrc/parallel.h)
export LLMRT_KERNELS_OPENMP=0
"$PY" -m llmrt.kernels.native
"$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_kernels_threads.py tests/unit/test_kernels_gguf_blocks.py \
  tests/unit/test_kernels_interleaved.py tests/unit/test_kernels_kquants.py \
  tests/unit/test_kernels_q8_gemm_interleaved.py \
  tests/unit/test_kernels_causal_attention.py tests/parity/test_fused_decode.py
