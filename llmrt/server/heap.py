"""Keeping the garbage collector's full passes off a warm server's heap.

Why: a built and warmed runtime leaves ~200k long-lived Python objects (torch, the model's
modules, the tokenizer, the recipe, the programs); a full collection walks them all, ~90 ms
with a Llama-3.2-1B-shaped GGUF loaded (measured on a 2-core EPYC VM), holding the GIL, so
every stream stalls for that long. A server's request objects that outlive a young
collection keep adding to the count that triggers a full one, so over hours they come
periodically. Moving what is alive once the runtime is warm into the permanent generation
(``gc.freeze``, as vLLM's engine does after start-up) leaves the full passes only the
objects made since: a full collection of the same process then takes well under 1 ms.

Only a process the server owns should do this (``llmrt serve``): freezing is process-wide,
and frozen objects are never collected, so the server unfreezes before it tears the runtime
down (cycles among its objects are then collectable again). Objects frozen then dropped
while serving are freed by their reference counts as usual; only a cycle among them waits
for the unfreeze (the runtime's own state is released explicitly, not by the collector).
"""

from __future__ import annotations

import gc
import logging

__all__ = ["freeze_heap", "unfreeze_heap"]


def freeze_heap() -> int:
    """Collect, then freeze every object still alive; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logging.getLogger("llmrt.server.heap").info(
        "%d objects frozen out of the garbage collector's full passes", frozen
    )
    return frozen


def unfreeze_heap() -> None:
    """Return the frozen objects to the oldest generation (idempotent)."""
    gc.unfreeze()
