#!/usr/bin/env bash
# Host-side tests against the real ttnn wheel (tests/ttnn_host): API names and keywords
# TtnnDevice calls, dtype/layout conversions, tile padding, int32/uint32 staging, and the fake
# ttnn's agreement with the wheel. ttnn 0.81.1 publishes wheels for CPython 3.10 and 3.12
# (manylinux_2_34 x86_64) only, so this builds its own venv from such an interpreter.
#
# Exits 0 with "skipped: ..." when no CPython 3.10/3.12 interpreter (or no x86_64 Linux) is
# found. Environment:
#   TTNN_PYTHON      interpreter to use (default: first python3.12/python3.10 found on PATH,
#                    in /usr/bin, /usr/local/bin, or pyenv's versions)
#   TTNN_HOST_VENV   venv directory (default: /tmp/llmrt-ttnn-host-py3XX, reused when complete)
#   TTNN_TORCH_INDEX index for the torch wheel (default: the PyTorch CPU index, falling back
#                    to the default index, whose Linux torch is the larger CUDA build)
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
ttnn_spec="ttnn==0.81.1"
torch_spec="torch>=2.4,<=2.14.1"

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "skipped: ttnn wheels are published for x86_64 Linux only (this is $(uname -s) $(uname -m))"
  exit 0
fi

is_supported() {
  "$1" -c 'import sys, venv; sys.exit(sys.version_info[:2] not in ((3, 10), (3, 12)))' \
    >/dev/null 2>&1
}

find_python() {
  local candidate
  local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  for candidate in \
    "$(command -v python3.12 || true)" "$(command -v python3.10 || true)" \
    /usr/bin/python3.12 /usr/bin/python3.10 /usr/local/bin/python3.12 /usr/local/bin/python3.10 \
    "$pyenv_root"/versions/3.12*/bin/python3.12 "$pyenv_root"/versions/3.10*/bin/python3.10; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && is_supported "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if [ -n "${TTNN_PYTHON:-}" ]; then
  if ! is_supported "$TTNN_PYTHON"; then
    echo "TTNN_PYTHON=$TTNN_PYTHON is not a CPython 3.10/3.12 with the venv module" >&2
    exit 2
  fi
  python=$TTNN_PYTHON
elif ! python=$(find_python); then
  echo "skipped: no CPython 3.10/3.12 interpreter (ttnn 0.81.1 has wheels for 3.10 and 3.12" \
    "only); set TTNN_PYTHON=/path/to/python3.12 to choose one"
  exit 0
fi
tag=$("$python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
venv=${TTNN_HOST_VENV:-/tmp/llmrt-ttnn-host-py$tag}
stamp="$venv/.llmrt-ttnn-host"
echo "ttnn host tests: $python ($("$python" -V 2>&1)), venv $venv"

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$ttnn_spec $torch_spec" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "$ttnn_spec" pytest attrs
  # ttnn.from_torch/to_torch import torch but ttnn does not depend on it.
  if ! "$venv/bin/python" -m pip install -q --retries 1 --timeout 30 \
      --index-url "${TTNN_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" "$torch_spec"; then
    echo "torch: the CPU index is unreachable; installing torch from the default index" >&2
    "$venv/bin/python" -m pip install -q "$torch_spec"
  fi
  echo "$ttnn_spec $torch_spec" >"$stamp"
fi

# llmrt is imported from this checkout, and tests/ for the helpers the host tests share with
# the unit tests (fake_ttnn_errors); --confcutdir keeps tests/conftest.py (which needs
# llmrt's full dependency set) out of this run.
export PYTHONPATH="$repo:$repo/tests${PYTHONPATH:+:$PYTHONPATH}"
export LOGURU_LEVEL=${LOGURU_LEVEL:-WARNING}
export TT_LOGGER_LEVEL=${TT_LOGGER_LEVEL:-error}
exec "$venv/bin/pytest" -q -p no:cacheprovider --confcutdir=tests/ttnn_host tests/ttnn_host "$@"
