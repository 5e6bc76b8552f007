"""One-shot generation through the Python API, as a program embedding llmrt runs it.

``python -m llmrt.benchmarks.api_oneshot RECIPE PROMPT MAX_NEW_TOKENS [KEY=VALUE ...]``:
``LLM.from_recipe`` with the overrides, one greedy generation, the text printed. Why beside
``llmrt generate``: the CLI sizes a one-shot run to its prompts (decode slots, no huge-page
placement, ``llmrt.recipe.sizing``), the API builds the recipe as written, which is what
``LLM(...)`` users and ``llmrt serve`` pay; its peak RSS once ran 2x a 3B GGUF's file while
the CLI's stayed at 1.16x.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    recipe, prompt, new_tokens, overrides = argv[0], argv[1], int(argv[2]), argv[3:]
    from llmrt.benchmarks.serving import greedy
    from llmrt.serving.llm import LLM

    with LLM.from_recipe(recipe, overrides=overrides) as llm:
        (out,) = llm.generate([prompt], greedy(new_tokens))
    print(out.text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
