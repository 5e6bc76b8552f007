#!/usr/bin/env bash
# llmrt's CPU kernels on arm64, from an x86-64 machine.
#
#   scripts/arm_check.sh [--compile]   every source compiled for aarch64 (objects only): each
#                                      x86-only path must be guarded so the library builds
#   scripts/arm_check.sh --run         the kernels linked into an aarch64 program and their
#                                      tests run under qemu-user at every arm64 level
#                                      (tests/unit/test_kernels_arm64.py, see below)
#
# Needs (Debian/Ubuntu): apt-get install g++-aarch64-linux-gnu qemu-user
#
# Compilers: CXX=aarch64-linux-gnu-g++ (the default) builds with OpenMP (libgomp, as on Linux);
# CXX="clang++ --target=aarch64-linux-gnu" (the cross sysroot above) builds WITHOUT OpenMP, as
# Apple clang does on macOS (no aarch64 libomp here either): the kernels then run their
# parallel loops on torch's thread pool (csrc/parallel.h). Each compiler has its own object
# directory and driver (op_runner for g++, op_runner-clang for clang); the tests run every
# driver that is present and current. LLMRT_OPENMP=0/1 overrides the compiler's default.
#
# How --run works, and why not Python: PyPI's aarch64 torch wheel is the CUDA build, whose
# Python module needs the CUDA libraries (gigabytes, and not all of them published for
# aarch64); its libtorch_cpu.so needs only libcudart.so.13 and libcupti.so.13 by name. So
# this fetches the wheel matching the host's torch (pip download, once, into the work dir:
# $LLMRT_ARM64_DIR, default llmrt's cache dir + /arm64; ~900 MB),
# keeps its CPU libraries, builds stubs for those two (every function returns an error; they
# are reached only by CUDA probing and the profiler), and links every kernel source but
# python_entry.cpp with tests/arm64/op_runner.cpp, a driver that calls the registered ops
# through the dispatcher. The pytest module then writes the calls, runs the driver under
# qemu-aarch64 for each level and CPU model, and checks the results on the host against
# gguf-py's dequantization and numpy. qemu's timings say nothing about speed.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:---compile}
CXX=${CXX:-aarch64-linux-gnu-g++}
PY=${PYTHON:-python3}
if [[ -x .venv/bin/python && -z "${PYTHON:-}" ]]; then PY=.venv/bin/python; fi
TORCH_INCLUDE=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__) + '/include')")
PY_INCLUDE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if $CXX --version 2>/dev/null | grep -qi clang; then TAG=clang; else TAG=gcc; fi
OPENMP=${LLMRT_OPENMP:-$([[ $TAG == gcc ]] && echo 1 || echo 0)}
OMP_FLAGS=()
[[ $OPENMP == 1 ]] && OMP_FLAGS=(-fopenmp)
FLAGS=(-std=c++20 -O3 -fno-math-errno "${OMP_FLAGS[@]}" -fPIC -Wall -Werror=unused-variable
       -DTORCH_EXTENSION_NAME=llmrt_kernels -DTORCH_API_INCLUDE_EXTENSION_H
       -isystem "$TORCH_INCLUDE" -isystem "$TORCH_INCLUDE/torch/csrc/api/include"
       -isystem "$PY_INCLUDE")

case "$MODE" in
  --compile)
    OUT=$(mktemp -d)
    trap 'rm -rf "$OUT"' EXIT
    ;;
  --run)
    ARM=${LLMRT_ARM64_DIR:-$("$PY" -c "from llmrt.paths import default_cache_dir as d; print(d() / 'arm64')")}
    OUT=$ARM/obj-$TAG-omp$OPENMP
    mkdir -p "$OUT"
    ;;
  *)
    echo "usage: $0 [--compile|--run]" >&2
    exit 2
    ;;
esac

# Whether $1 is newer than every project file it was built from (its -MMD list).
up_to_date() {
  local dep
  for dep in $(sed 's/\\$//; s/^[^:]*://' "$1.d"); do
    [[ $dep == llmrt/* && "$dep" -nt "$1" ]] && return 1
  done
  [[ -f "$1" ]]
}

# Compile every source (in parallel, one per core), each into $OUT.
status=0
pids=()
srcs=(llmrt/kernels/csrc/*.cpp)
for src in "${srcs[@]}"; do
  obj="$OUT/$(basename "$src" .cpp).o"
  if [[ "$MODE" == --run && -f "$obj.d" ]] && up_to_date "$obj"; then
    pids+=(0)
    continue
  fi
  $CXX "${FLAGS[@]}" -MMD -MF "$obj.d" -c "$src" -o "$obj" 2>"$obj.log" &
  pids+=($!)
  while (( $(jobs -rp | wc -l) >= $(nproc) )); do wait -n || true; done
done
for i in "${!srcs[@]}"; do
  obj="$OUT/$(basename "${srcs[$i]}" .cpp).o"
  if [[ ${pids[$i]} == 0 ]] || wait "${pids[$i]}"; then
    echo "ok    ${srcs[$i]}"
  else
    echo "FAIL  ${srcs[$i]}"
    cat "$obj.log"
    rm -f "$obj"
    status=1
  fi
done
[[ "$MODE" == --compile || $status != 0 ]] && exit $status

# --run: the aarch64 torch libraries, the CUDA stubs, the driver, then the tests.
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
LIB=$ARM/torch-$TORCH_VERSION/lib
if [[ ! -f "$LIB/libtorch_cpu.so" ]]; then
  mkdir -p "$ARM/wheel" "$LIB"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
    -d "$ARM/wheel" "torch==$TORCH_VERSION"
  wheel=$(ls "$ARM"/wheel/torch-"$TORCH_VERSION"-*aarch64*.whl | head -1)
  "$PY" -m zipfile -e "$wheel" "$ARM/unpacked"
  find "$ARM/unpacked/torch/lib" -name '*.so*' ! -name 'libtorch_cuda*' ! -name '*nvshmem*' \
    -exec mv {} "$LIB/" \;
  rm -rf "$ARM/unpacked" "$ARM/wheel"
fi
STUBS=$ARM/stubs
mkdir -p "$STUBS"
for lib in libcudart.so.13 libcupti.so.13; do
  if [[ ! -f "$STUBS/$lib" ]]; then
    {
      echo '// generated by scripts/arm_check.sh: no CUDA here, every call fails'
      echo 'const char* cudaGetErrorString(int) { return "no CUDA (llmrt arm64 check stub)"; }'
      aarch64-linux-gnu-nm -D --undefined-only "$LIB/libtorch_cpu.so" |
        sed -n "s/^ *U \([A-Za-z_0-9]*\)@$lib$/\1/p" | grep -v '^cudaGetErrorString$' |
        sed 's/.*/long &(void) { return 999; }/'
    } | sed 's/^long /extern "C" long /; s/^const char\* /extern "C" const char* /' > "$STUBS/${lib%%.so.*}.cpp"
    echo "$lib { global: *; };" > "$STUBS/${lib%%.so.*}.map"
    $CXX -shared -fPIC -o "$STUBS/$lib" "$STUBS/${lib%%.so.*}.cpp" \
      -Wl,-soname,"$lib" -Wl,--version-script,"$STUBS/${lib%%.so.*}.map"
  fi
done
$CXX "${FLAGS[@]}" -c tests/arm64/op_runner.cpp -o "$OUT/op_runner.o"
objs=()
for src in "${srcs[@]}"; do
  [[ $(basename "$src") == python_entry.cpp ]] || objs+=("$OUT/$(basename "$src" .cpp).o")
done
case "$TAG-$OPENMP" in
  gcc-1) RUNNER=$ARM/op_runner ;;
  clang-0) RUNNER=$ARM/op_runner-clang ;;
  *) RUNNER=$ARM/op_runner-$TAG-omp$OPENMP ;;
esac
$CXX "${OMP_FLAGS[@]}" -o "$RUNNER" "$OUT/op_runner.o" "${objs[@]}" -L"$LIB" -L"$STUBS" \
  -Wl,--no-as-needed -ltorch_cpu -lc10 -Wl,--as-needed -Wl,-rpath-link,"$LIB:$STUBS"
echo "$LIB:$STUBS" > "$ARM/op_runner.libs"
echo "built $RUNNER ($(file -b "$RUNNER" | cut -d, -f1-2), OpenMP $OPENMP)"
LLMRT_ARM64_DIR=$ARM "$PY" -m pytest -q -p no:cacheprovider --tb=short tests/unit/test_kernels_arm64.py
