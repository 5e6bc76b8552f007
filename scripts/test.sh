#!/usr/bin/env bash
# README command (2): set up and run the whole default test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec pytest -q -p no:cacheprovider "$@"
