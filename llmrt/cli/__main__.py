"""``python -m llmrt.cli``: the ``llmrt`` command."""

from llmrt.cli.main import console_main

console_main()
