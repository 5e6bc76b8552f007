"""``device.retain_freed_memory``: opening a CPU device keeps freed host memory for reuse.

Each case runs in a fresh interpreter (the glibc thresholds are process-wide and permanent)
that opens the device through the container factory and counts the page faults of an
allocation pattern that glibc's defaults map afresh every time: rounds of three blocks of
8 MiB and more, each round's a little larger than the last.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's mallopt"
)

PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from llmrt.containers import factories
    from llmrt.device.host_memory import freed_memory_retained
    from llmrt.recipe.loader import load_recipe

    recipe = load_recipe(
        "smollm2-135m", overrides=[f"device.retain_freed_memory={sys.argv[1]}"]
    )
    device = factories.open_device(recipe=recipe)

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    # Each round's blocks are larger than the last round's: glibc's dynamic threshold only
    # rises to the size of a freed mapping, so by default every round maps afresh.
    rounds = 16
    start = faults()
    for i in range(rounds):
        n = ((8 << 20) + i * (256 << 10)) // 4
        a = torch.ones(n); b = torch.ones(n); c = torch.ones(n); del a, b, c
    print(json.dumps({"faults": (faults() - start) / rounds, "retained": freed_memory_retained()}))
    """
)


def probe(retain: bool) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "true" if retain else "false"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_an_opened_cpu_device_reuses_freed_blocks_without_page_faults() -> None:
    released = probe(retain=False)
    retained = probe(retain=True)
    # By default every block faults in whole (4 KiB pages: ~7,600 per round here); retained,
    # a round faults in only what the heap grows by (3 x 256 KiB, ~200-750 pages).
    assert not released["retained"] and released["faults"] >= 3 * 2048, released
    assert retained["retained"] and retained["faults"] <= released["faults"] / 5, retained
