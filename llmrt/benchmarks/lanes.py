"""Shared pieces of the step workloads: the lane, block tables, seeded context tokens."""

from __future__ import annotations

import math

import torch

from llmrt.benchmarks.prompts import random_prompts, token_pool
from llmrt.errors import ConfigError
from llmrt.runtime.model_executor import ModelExecutor
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM

WARMUP = 3
GREEDY = SamplingParams(temperature=0.0)


def first_lane(llm: LLM) -> ModelExecutor:
    """Lane 0 of ``llm``'s lane group (borrowed)."""
    return llm.engine.executor.lanes[0]


def block_table(*, rows: int, tokens: int, block_size: int, width: int) -> torch.Tensor:
    """Row ``r`` owns consecutive blocks ``[r * n, (r + 1) * n)``; ``-1`` past them."""
    per_row = math.ceil(tokens / block_size)
    if per_row > width:
        raise ConfigError(
            "kv_cache.num_blocks", width, f"page table too narrow for {tokens} tokens"
        )
    table = torch.full((rows, width), -1, dtype=torch.int32)
    for r in range(rows):
        table[r, :per_row] = torch.arange(r * per_row, (r + 1) * per_row, dtype=torch.int32)
    return table


def context_tokens(llm: LLM, *, rows: int, length: int, seed: int) -> torch.Tensor:
    """``[rows, length]`` seeded token ids the model and tokenizer both know (no bos/eos)."""
    vocab = int(first_lane(llm).decode.config.vocab_size)
    pool = token_pool(llm.tokenizer, model_vocab_size=vocab)
    return torch.tensor(random_prompts([length] * rows, pool=pool, seed=seed), dtype=torch.int64)
