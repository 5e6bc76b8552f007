"""Lifecycle: structured lifecycle events (``events``), lifetime scopes that own and close
objects in reverse creation order (``scope``), and the audit that checks a lifecycle log
against the contract (``audit``, behind ``llmrt audit``).

May import only ``errors``: every other layer logs through it, so it reads logs as data
and keeps its own copy of the contract it checks.
"""
