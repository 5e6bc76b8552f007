"""How vLLM's TT plugin finds llmrt: ``TT<Architecture>`` names bound to :class:`VLLMAdapter`.

The plugin resolves a model by prefixing its Hugging Face architecture with ``TT``
(``LlamaForCausalLM`` -> ``TTLlamaForCausalLM``) and looking that name up in vLLM's
``ModelRegistry``. Two ways put llmrt there:

- the ``vllm.general_plugins`` entry point :func:`register` (every plugin version): vLLM
  runs it in each of its processes; it registers only when ``LLMRT_VLLM_RECIPE`` is set or
  ``LLMRT_VLLM=1``, and then replaces the plugin's own class for those names;
- an ``EXTRA_MODELS_DIR`` bundle (the plugin's ``main`` branch): :func:`write_bundle`
  writes one folder per architecture holding the ``vllm_metadata.json`` the plugin reads
  (``python -m llmrt.vllm.registration DIR``).

``LLMRT_VLLM_ARCHITECTURES`` (comma separated) replaces the default architecture list.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmrt.vllm.recipe import RECIPE_ENV, architecture_recipes

#: The class the plugin instantiates (vLLM's lazy ``"module:Class"`` form).
MAIN_CLASS = "llmrt.vllm.adapter:VLLMAdapter"
ENABLE_ENV = "LLMRT_VLLM"
ARCHITECTURES_ENV = "LLMRT_VLLM_ARCHITECTURES"


def architectures(env: Mapping[str, str] = os.environ) -> list[str]:
    """Hugging Face architectures llmrt answers for (without the plugin's ``TT`` prefix)."""
    given = env.get(ARCHITECTURES_ENV, "")
    if given.strip():
        return [a.strip().removeprefix("TT") for a in given.split(",") if a.strip()]
    return sorted(architecture_recipes())


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Registration is opt-in: installing llmrt must not take over other vLLM servers."""
    return bool(env.get(RECIPE_ENV, "").strip()) or env.get(ENABLE_ENV, "") in ("1", "true")


def register(registry: Any | None = None, env: Mapping[str, str] = os.environ) -> list[str]:
    """Bind ``TT<arch>`` to :data:`MAIN_CLASS` in vLLM's registry; the names registered."""
    if not enabled(env):
        return []
    if registry is None:
        from vllm import ModelRegistry

        registry = ModelRegistry
    names = [f"TT{arch}" for arch in architectures(env)]
    for name in names:
        registry.register_model(name, MAIN_CLASS)
    return names


def write_bundle(directory: Path, *, archs: Sequence[str] | None = None) -> list[Path]:
    """One ``EXTRA_MODELS_DIR`` bundle folder per architecture; the metadata files written."""
    written = []
    for arch in archs if archs is not None else architectures():
        folder = Path(directory) / f"llmrt-{arch}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "vllm_metadata.json"
        path.write_text(json.dumps({"arch": arch, "main_class": MAIN_CLASS}, indent=2) + "\n")
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmrt.vllm.registration",
        description="Write EXTRA_MODELS_DIR bundles that point vLLM's TT plugin at llmrt.",
    )
    parser.add_argument("directory", type=Path, help="the EXTRA_MODELS_DIR to write into")
    parser.add_argument("--arch", action="append", help="a Hugging Face architecture (repeatable)")
    args = parser.parse_args(argv)
    for path in write_bundle(args.directory, archs=args.arch):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
