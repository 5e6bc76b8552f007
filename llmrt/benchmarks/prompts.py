"""Deterministic benchmark prompts: seeded token ids over the tokenizer's ordinary vocabulary."""

from __future__ import annotations

import random
from collections.abc import Sequence

from llmrt.weights.tokenizer import Tokenizer


def token_pool(tokenizer: Tokenizer, *, model_vocab_size: int) -> list[int]:
    """Ids both the tokenizer and the model know, without bos/eos."""
    special = {*tokenizer.eos_token_ids}
    if tokenizer.bos_token_id is not None:
        special.add(tokenizer.bos_token_id)
    size = min(tokenizer.vocab_size, model_vocab_size)
    return [i for i in range(size) if i not in special]


def spread_lengths(n: int, *, low: int, high: int, seed: int) -> list[int]:
    """``n`` lengths evenly spread over ``[low, high]``, in a seeded shuffled order."""
    if n == 1:
        return [(low + high) // 2]
    lengths = [round(low + (high - low) * i / (n - 1)) for i in range(n)]
    random.Random(seed).shuffle(lengths)
    return lengths


def random_prompts(lengths: Sequence[int], *, pool: Sequence[int], seed: int) -> list[list[int]]:
    """One seeded prompt per length."""
    rng = random.Random(seed)
    return [[pool[rng.randrange(len(pool))] for _ in range(n)] for n in lengths]


def shared_prefix_prompts(
    n: int, *, prefix_len: int, suffix_len: int, pool: Sequence[int], seed: int
) -> list[list[int]]:
    """``n`` prompts: one seeded prefix, then each prompt's own seeded suffix."""
    prefix, *suffixes = random_prompts([prefix_len] + [suffix_len] * n, pool=pool, seed=seed)
    return [prefix + suffix for suffix in suffixes]
