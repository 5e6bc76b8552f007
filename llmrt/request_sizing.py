"""A recipe sized to a known set of requests (``llmrt generate``): decode slots and warmup.

A one-shot run knows every request before the runtime is built, so it never needs more
decode slots per lane than it has prompts. Each decode batch size is a program warmed (and
traced) at startup; sizing the lane capacity to the prompts keeps warmup to the batches
the run can form, without changing what any row computes (a step runs at the smallest
batch that holds its rows either way). Overrides the user gave (``--set``) always win.
"""

from __future__ import annotations

from collections.abc import Collection

from llmrt.config import PREFILL_BATCH_SIZES
from llmrt.recipe import Recipe


def request_overrides(recipe: Recipe, *, requests: int, given: Collection[str]) -> list[str]:
    """``--set`` overrides fitting ``recipe``'s decode slots to ``requests`` prompts.

    ``given`` holds the dotted keys the user overrode; none of them is replaced, and
    nothing changes when the user set the capacity or the recipe already fits.
    """
    if requests < 1:
        raise ValueError(f"requests must be positive, got {requests}")
    lanes = recipe.lanes
    per_lane = -(-requests // lanes)
    capacity = 1 << (per_lane - 1).bit_length()  # a power of two: the batches warmed
    # Batches the user pinned must still fit the lane.
    pinned = [1]
    if "prefill.max_batch_size" in given:
        pinned.append(recipe.prefill.max_batch_size)
    if "warmup.prefill_batch_sizes" in given:
        pinned.extend(recipe.warmup.prefill_batch_sizes)
    if "decode.batch_sizes" in given and recipe.decode.batch_sizes:
        pinned.extend(recipe.decode.batch_sizes)
    capacity = max(capacity, *pinned)
    if "decode.lane_capacity" in given or capacity >= recipe.decode.lane_capacity:
        return []
    out = [f"decode.lane_capacity={capacity}"]
    sizes = recipe.decode.batch_sizes
    if sizes is not None and "decode.batch_sizes" not in given:
        kept = [b for b in sizes if b <= capacity]
        out.append(f"decode.batch_sizes={kept if kept else 'null'}")
    prefill_max = max(b for b in PREFILL_BATCH_SIZES if b <= capacity)
    if recipe.prefill.max_batch_size > prefill_max and "prefill.max_batch_size" not in given:
        out.append(f"prefill.max_batch_size={prefill_max}")
        if "warmup.prefill_batch_sizes" not in given:
            kept = [b for b in recipe.warmup.prefill_batch_sizes if b <= prefill_max] or [1]
            out.append(f"warmup.prefill_batch_sizes={kept}")
    seqs = recipe.serving.max_num_seqs
    if seqs is not None and seqs > lanes * capacity and "serving.max_num_seqs" not in given:
        out.append(f"serving.max_num_seqs={lanes * capacity}")
    return out
