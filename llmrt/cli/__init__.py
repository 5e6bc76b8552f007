"""The ``llmrt`` command line: argument parsing and dispatch (``main``), and the front ends
of ``llmrt bench`` (``bench``) and ``llmrt check`` (``check``).

The top layer: may import every other package.
"""
