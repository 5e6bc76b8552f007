"""Recipes: the per-model file format (``schema``: frozen, validated sections), loading with
overrides and environment expansion (``loader``), and sizes derived from a recipe
(``sizing``).

May import the runtime core's configs, ``families`` (the registry and their specs),
``weights``, ``kernels``, ``device``, ``errors``. Never the containers or anything above.
"""
