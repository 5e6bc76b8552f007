"""Where a 16-row decode step's time goes as the page table widens, on one device.

Usage: python scripts/gpu_decode_widths.py [--device cuda|cpu] [--max-model-lens 512,4096]
       [--profile LEN]

Builds a random SmolLM2-135M-shaped Llama (``tiny-llama`` with its dimensions overridden: no
weights needed, so it travels to a bare GPU machine) with 16 decode slots and traced decode,
then for each ``max_model_len``: prefill of 16 short prompts, and the mean decode step over
64 steps of all 16 rows. ``--profile LEN`` adds torch.profiler tables (prefill, then 16 decode
steps) for that length. Why: on an H200 the traced step once cost 22.4 ms at 4096 positions
and 8.1 ms at 512 (the graph attended over the whole table); with the decode width ladder the
two should be close. Prints one ``RESULT`` line per length.
"""

from __future__ import annotations

import argparse
import time

import torch

from llmrt.benchmarks.serving import greedy
from llmrt.serving.llm import LLM

SHAPE = (
    "model.hidden_size=576",
    "model.intermediate_size=1536",
    "model.num_hidden_layers=30",
    "model.num_attention_heads=9",
    "model.num_key_value_heads=3",
    "model.vocab_size=49152",
    "model.max_position_embeddings=8192",
    "kv_cache.block_size=32",
    "decode.lane_capacity=16",
    "trace.mode=decode_only",
    "prefill.max_batch_size=16",
)
ROWS = 16
STEPS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--max-model-lens", default="512,4096")
    parser.add_argument("--profile", type=int, default=0, help="profile this max_model_len")
    args = parser.parse_args()
    overrides = [*SHAPE, f"device.kind={args.device}"]
    if args.device == "cuda":
        overrides.append("device.index=0")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    prompts = [f"prompt number {i}: " + "abc " * 10 for i in range(ROWS)]
    for length in (int(x) for x in args.max_model_lens.split(",")):
        blocks = max(64, length // 32 * 2)
        recipe = [
            *overrides,
            f"serving.max_model_len={length}",
            f"kv_cache.max_num_blocks={blocks}",
        ]
        start = time.perf_counter()
        with LLM.from_recipe("tiny-llama", overrides=recipe) as llm:
            build = time.perf_counter() - start
            llm.generate(prompts, greedy(4))
            sync()
            start = time.perf_counter()
            llm.generate(prompts, greedy(1))
            sync()
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate(prompts, greedy(STEPS + 1))
            sync()
            step = (time.perf_counter() - start - prefill) / STEPS
            print(
                f"RESULT {args.device} max_model_len={length} build {build:.1f} s "
                f"prefill({ROWS} rows) {prefill * 1e3:.1f} ms "
                f"decode step({ROWS} rows) {step * 1e3:.2f} ms",
                flush=True,
            )
            if length == args.profile:
                _profile(llm, prompts, cuda=args.device == "cuda", sync=sync)


def _profile(llm: LLM, prompts: list[str], *, cuda: bool, sync: object) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    key = "cuda_time_total" if cuda else "cpu_time_total"
    for name, tokens in (("prefill", 1), ("decode", 17)):
        with torch.profiler.profile(activities=activities) as prof:
            llm.generate(prompts, greedy(tokens))
            if callable(sync):
                sync()
        print(f"== {name} ({tokens} tokens) by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60))


if __name__ == "__main__":
    main()
