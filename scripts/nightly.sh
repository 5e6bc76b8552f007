#!/usr/bin/env bash
# Nightly target: the slow tests the default run leaves out, then the benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
pytest -q -p no:cacheprovider -m slow
llmrt bench smollm2-135m --workload mixed --baseline hf
llmrt bench smollm2-135m --workload shared-prefix
