"""A recipe sized to a known set of requests (``llmrt generate``): decode slots, warmup and
weight placement.

A one-shot run knows every request before the runtime is built, so it never needs more
decode slots per lane than it has prompts. Each decode batch size is a program warmed (and
traced) at startup; sizing the lane capacity to the prompts keeps warmup to the batches
the run can form, without changing what any row computes (a step runs at the smallest
batch that holds its rows either way). A run that decodes few tokens also skips moving the
weights onto huge pages (``device.huge_pages``), which costs more at startup than it saves
per step. Overrides the user gave (``--set``) always win.
"""

from __future__ import annotations

from collections.abc import Collection

from llmrt.recipe.loader import Recipe
from llmrt.runtime.config import PREFILL_BATCH_SIZES

#: Decode tokens from which a one-shot run keeps its weights moved onto huge pages. Why: the
#: copy faults in fresh 2 MiB pages, 0.2-1.7 s at startup on this project's VM (fresh host
#: memory behind them), and saves ~0.85 ms per SmolLM2 batch-1 step: it pays after a few
#: hundred to a couple of thousand tokens.
HUGE_PAGES_MIN_TOKENS = 512


def request_overrides(
    recipe: Recipe, *, requests: int, given: Collection[str], new_tokens: int | None = None
) -> list[str]:
    """``--set`` overrides fitting ``recipe``'s decode slots to ``requests`` prompts, and (with
    ``new_tokens`` per prompt known) its weight placement to the tokens the run decodes.

    ``given`` holds the dotted keys the user overrode; none of them is replaced, and
    nothing changes when the user set the capacity or the recipe already fits.
    """
    if requests < 1:
        raise ValueError(f"requests must be positive, got {requests}")
    placement = []
    if (
        new_tokens is not None
        and recipe.device.huge_pages
        and "device.huge_pages" not in given
        and requests * new_tokens < HUGE_PAGES_MIN_TOKENS
    ):
        placement.append("device.huge_pages=false")
    return _slot_overrides(recipe, requests=requests, given=given) + placement


def _slot_overrides(recipe: Recipe, *, requests: int, given: Collection[str]) -> list[str]:
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
