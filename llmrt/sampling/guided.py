"""Constrained decoding with llguidance: one compiler per tokenizer, one matcher per request.

Why llguidance: measured in one session on SmolLM2's 49,152-token vocabulary (a 3-field
JSON schema, compact JSON, 2-core EPYC shared with other jobs), mask plus advance costs
~11-14 us per token (set-up 0.75 s per tokenizer, ~1 ms per schema) against ~2.5-7 us for
xgrammar 0.2.9 (set-up 0.5 s, 20 ms per schema, cached after); both are under 0.3% of a
~5 ms decode step. outlines-core 0.2.14 needs a hand-built vocabulary and refused the
schema's tokens. llguidance has no Python dependencies (xgrammar requires triton and
apache-tvm-ffi on Linux x86_64), covers JSON schema, regex and Lark grammars, and is the
engine of vLLM's ``guidance`` backend. Its set-up is paid once per tokenizer; a server pays
it while warming (``GuidedDecoding.warm``).
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

import llguidance.numpy as llg_numpy
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from llmrt.errors import RequestError
from llmrt.sampling.structured import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: JSON without free whitespace between tokens: small models otherwise pad it with
#: newlines until max_tokens (vLLM's guidance backend disables it the same way).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GuidedMatcher:
    """One request's llguidance matcher (a :class:`~llmrt.sampling.structured.TokenConstraint`)."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        llg_numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(int(token_id)))

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        """llguidance's reason, first line only (the rest dumps its parser state and grammar)."""
        if self._matcher.is_error():
            return str(self._matcher.get_error()).strip().split("\n", 1)[0]
        return None


class GuidedDecoding:
    """Compiles structured outputs for one tokenizer (owns the llguidance tokenizer).

    ``tokenizer_json`` is the Hugging Face ``tokenizer.json`` text of the model's
    tokenizer, ``eos_token_id`` what ends a completed output, ``vocab_size`` the logits'
    width. Built lazily: the first structured request (or ``warm``) pays the set-up.
    """

    def __init__(self, *, tokenizer_json: str, eos_token_id: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos = eos_token_id
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None

    def _lltokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    @staticmethod
    def grammar(structured: StructuredOutput) -> str:
        """The llguidance grammar of ``structured`` (raises RequestError when invalid)."""
        matcher = LLMatcher
        if structured.kind == "json_schema":
            grammar = matcher.grammar_from_json_schema(structured.spec, defaults=JSON_OPTIONS)
            field = "structured_output.schema"
        elif structured.kind == "json_object":
            grammar = matcher.grammar_from_json_schema(
                json.dumps({"type": "object"}), defaults=JSON_OPTIONS
            )
            field = "structured_output"
        else:
            grammar = matcher.grammar_from_regex(structured.spec)
            field = "structured_output.regex"
        problem = matcher.validate_grammar(grammar)
        if problem:
            raise RequestError(field, f"cannot be enforced: {problem}")
        return str(grammar)

    def constraint(self, structured: StructuredOutput) -> GuidedMatcher:
        """A fresh matcher at the start of the output."""
        grammar = self.grammar(structured)
        matcher = LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError("structured_output", f"cannot be enforced: {matcher.get_error()}")
        return GuidedMatcher(matcher)

    def warm(self) -> None:
        """Pay the one-time set-up now (tokenizer trie, the first mask's tables)."""
        constraint = self.constraint(StructuredOutput.json_object())
        constraint.fill_bitmask(np.zeros((1, (self.vocab_size + 31) // 32), np.int32), 0)
