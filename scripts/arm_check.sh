#!/usr/bin/env bash
# Cross-compiles llmrt's CPU kernel sources for aarch64 (Linux, g++-aarch64-linux-gnu) against
# this machine's torch headers, to object files: every x86-only path must be guarded so the
# library builds for arm64. Linking and running need an aarch64 libtorch, which is not
# installable here, so this checks compilation only (see the report in issue #34).
#
#   apt-get install g++-aarch64-linux-gnu    # once
#   scripts/arm_check.sh [CXX]               # default aarch64-linux-gnu-g++
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${1:-aarch64-linux-gnu-g++}
PY=${PYTHON:-python3}
TORCH_INCLUDE=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__) + '/include')")
PY_INCLUDE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
status=0
for src in llmrt/kernels/csrc/*.cpp; do
  if "$CXX" -std=c++20 -O2 -fopenmp -fPIC -Wall -Werror=unused-variable -c "$src" \
      -o "$OUT/$(basename "$src" .cpp).o" -DTORCH_EXTENSION_NAME=llmrt_kernels \
      -DTORCH_API_INCLUDE_EXTENSION_H -isystem "$TORCH_INCLUDE" \
      -isystem "$TORCH_INCLUDE/torch/csrc/api/include" -isystem "$PY_INCLUDE"; then
    echo "ok    $src"
  else
    echo "FAIL  $src"
    status=1
  fi
done
file "$OUT"/*.o | sed 's|.*/||' | head -3
exit $status
