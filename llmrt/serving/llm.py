"""The offline Python API: ``LLM.from_recipe(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import numbers
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import attrs

from llmrt.errors import RequestError
from llmrt.recipe.loader import (
    Overrides,
    Recipe,
    load_recipe,
    load_recipe_with,
    recipe_from_dict,
    recipe_to_dict,
)
from llmrt.sampling.params import SamplingParams
from llmrt.serving.engine import Engine, EngineStats, TokenEvent
from llmrt.serving.request import Request
from llmrt.weights.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Message = Mapping[str, Any]


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One finished prompt (vLLM-style fields)."""

    index: int
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[dict[int, float], ...] | None = None
    ttft_s: float | None = None
    token_times: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """What the request produced, JSON-ready (top logprobs keyed by token id as text, as
        JSON objects need); not the timings (``ttft_s``, ``token_times``), so two runs of
        the same greedy request print the same object."""
        out: dict[str, Any] = {
            "index": self.index,
            "prompt": self.prompt,
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            out["logprobs"] = list(self.logprobs)
        if self.top_logprobs is not None:
            out["top_logprobs"] = [{str(t): v for t, v in d.items()} for d in self.top_logprobs]
        return out


class LLM:
    """A warmed runtime built from a recipe; a context manager whose ``close`` tears it down.

    ``LLM("model.gguf")`` / ``LLM(model="org/name")`` (vLLM's spelling) derive the recipe
    from the model, or replace the checkpoint of ``recipe`` (a name or path) when one is
    given; ``overrides`` apply after. ``download=True`` allows fetching a Hub id missing
    from the local cache; ``gguf_file`` picks one file of a GGUF repo.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        recipe: Recipe | str | None = None,
        container: Any = None,
        overrides: Overrides | None = None,
        gguf_file: str | None = None,
        download: bool = False,
    ) -> None:
        self._closed = False
        # Calls may run together (threads, a generate while a stream is open): each steps
        # the engine under the lock when it has nothing to yield, and the events a step
        # makes for another call's requests wait for it here.
        self._lock = threading.RLock()
        self._live: set[str] = set()
        self._stashed: dict[str, list[TokenEvent]] = {}
        self._stepping = False
        self._deferred: list[Request] = []
        if container is None:
            from llmrt.containers import RuntimeContainer

            recipe = _recipe_for(
                model, recipe=recipe, overrides=overrides, gguf_file=gguf_file, download=download
            )
            container = RuntimeContainer(recipe=recipe)
        elif model is not None or not isinstance(recipe, Recipe) or overrides is not None:
            raise RequestError(
                "container", "is given with its recipe (a Recipe) only, not with model/overrides"
            )
        self.recipe: Recipe = recipe
        self.container = container
        try:
            from llmrt.containers import start_runtime

            group = start_runtime(container)
            self.tokenizer: Tokenizer = container.model.tokenizer()
            num_blocks = [lane.kv_cache.config.num_blocks or 0 for lane in group.lanes]
            block_size = recipe.kv_cache.block_size
            self.engine = Engine(
                executor=group,
                tokenizer=self.tokenizer,
                num_blocks=num_blocks,
                block_size=block_size,
                prefix_caching=recipe.serving.prefix_caching,
                max_num_batched_tokens=recipe.max_num_batched_tokens,
                # A sequence must fit one lane's whole pool, or it could never be scheduled.
                max_model_len=min(
                    recipe.max_model_len,
                    group.lanes[0].layout.max_sequence_length,
                    min(num_blocks) * block_size,
                ),
                max_num_seqs=recipe.max_num_seqs,
            )
        except BaseException as exc:
            self._teardown(primary=exc)
            raise

    @classmethod
    def from_recipe(cls, name_or_path: str | Recipe, *, overrides: Overrides | None = None) -> LLM:
        """Build, allocate and warm the runtime a recipe describes."""
        return cls(recipe=name_or_path, overrides=overrides)

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(primary=exc)

    def close(self, *, primary: BaseException | None = None) -> None:
        """Tear everything down in reverse creation order; idempotent.

        After a teardown that raised ``CleanupError``, calling ``close`` again retries exactly
        the steps that failed (their orphans); once everything is released it does nothing.
        """
        with self._lock:  # never between another call's steps: they end "closed" instead
            if self._closed and not self.container.root_scope().orphans():
                return
            if self._closed:
                self._teardown(primary=primary)  # the retry of what failed before
                return
            self._closed = True
            try:
                self.engine.abort_all()  # every live call's requests; each sees it's closed
            finally:
                self._live.clear()
                self._stashed.clear()
                self._teardown(primary=primary)

    def _teardown(self, *, primary: BaseException | None) -> None:
        self._closed = True
        self.container.root_scope().close(primary=primary)

    # -- generation ----------------------------------------------------------------------

    def encode(self, prompt: Prompt, *, row: int | None = None) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "is empty", row=row)
            return tuple(self.tokenizer.encode(prompt))
        return tuple(int(t) for t in prompt)

    def _submit(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        requests: list[Request],
    ) -> None:
        """Add the prompts' requests to the engine, each appended to ``requests`` as it is
        added (so whoever ends the call frees them, however it ends)."""
        if self._closed:
            raise RequestError("llm", "is closed")
        if params is None:
            per = [SamplingParams()] * len(prompts)
        elif isinstance(params, SamplingParams):
            per = [params] * len(prompts)
        else:
            per = list(params)
            if len(per) != len(prompts):
                raise RequestError(
                    "sampling_params", f"has {len(per)} entries for {len(prompts)} prompts"
                )
            for i, p in enumerate(per):
                if not isinstance(p, SamplingParams):
                    raise RequestError(
                        "sampling_params", "each entry must be a SamplingParams", row=i,
                        value=type(p).__name__,
                    )  # fmt: skip
        encoded = [self.encode(p, row=i) for i, p in enumerate(prompts)]
        with self._lock:
            if self._closed:
                raise RequestError("llm", "is closed")
            for i, (ids, p) in enumerate(zip(encoded, per, strict=True)):
                requests.append(self.engine.add_request(prompt_token_ids=ids, params=p, index=i))
                self._live.add(requests[-1].request_id)

    def _run(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        requests: list[Request],
    ) -> Iterator[TokenEvent]:
        """Submit the prompts (into ``requests``), then their events until all finished;
        however it ends, from the first request added on, they leave the engine (aborted
        when unfinished: another call's requests keep running)."""
        finished = False
        try:
            self._submit(prompts, params, requests)
            yield from self._events(requests)
            finished = True
        finally:
            self._end(requests, abort=not finished)

    def _step(self) -> list[TokenEvent]:
        """One engine step (the lock held). A step that raises took tokens for other calls'
        requests whose events are lost with it: every live request is aborted, as the engine
        cannot say which (their calls end, ``finish_reason="abort"``). Aborts asked for while
        it runs (a dropped stream finalized by the collector on this thread) wait for it."""
        self._stepping = True
        try:
            return self.engine.step()
        except BaseException:
            self.engine.abort_all()
            raise
        finally:
            self._stepping = False
            deferred, self._deferred = self._deferred, []
            for request in deferred:
                self.engine.abort(request)

    def _end(self, requests: Sequence[Request], *, abort: bool) -> None:
        with self._lock:
            for request in requests:
                if abort and self._stepping:
                    self._deferred.append(request)
                elif abort and not self._closed:  # close() aborted everything already
                    self.engine.abort(request)
                self._live.discard(request.request_id)
                self._stashed.pop(request.request_id, None)

    def _events(self, requests: Sequence[Request]) -> Iterator[TokenEvent]:
        """Step the engine (under the lock) whenever these requests have nothing to yield;
        a step's events for another live call's requests wait for it in ``_stashed``. A
        request's own failure raises its error."""
        mine = {r.request_id for r in requests}
        while True:
            with self._lock:
                if self._closed:
                    raise RequestError("llm", "was closed while this call ran (its requests ended)")
                ready = [e for r in requests for e in self._stashed.pop(r.request_id, ())]
                done = all(r.finished for r in requests)
                if not ready and not done:
                    if not self.engine.has_work:  # nothing would ever finish them
                        raise RuntimeError("requests left unfinished by an engine with no work")
                    for event in self._step():
                        if event.request_id in mine:
                            ready.append(event)
                        elif event.request_id in self._live:
                            self._stashed.setdefault(event.request_id, []).append(event)
            for event in ready:
                if event.error is not None:
                    raise event.error
                yield event
            if done and not ready:
                return

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Generator[TokenEvent, None, None]:
        """Yield each generated token as soon as its step finishes.

        Other calls may run while it is open (a ``generate``, another stream, other
        threads'): their steps advance its requests too, and its tokens wait for it. Closing
        the generator early (or dropping it) aborts the requests it submitted, no others; so
        does a request's own failure (a structured output that cannot be enforced), raised
        as its :class:`~llmrt.errors.RequestError`.
        """
        yield from self._run(_prompt_list(prompts), sampling_params, [])

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order.

        A request that fails on its own (a structured output that cannot be enforced)
        raises its :class:`~llmrt.errors.RequestError` and aborts the others; the engine
        stays usable."""
        raw = _prompt_list(prompts)
        requests: list[Request] = []
        for _ in self._run(raw, sampling_params, requests):
            pass
        return [_output(r, _text(raw[r.index])) for r in requests]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or several, then generate."""
        conversations: list[Sequence[Message]]
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise RequestError(
                "messages",
                'must be a list of {"role": ..., "content": ...} messages (or a list of such '
                "conversations)",
                value=type(messages).__name__,
            )
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        for i, conversation in enumerate(conversations):
            if isinstance(conversation, (str, bytes, Mapping)) or not all(
                isinstance(m, Mapping) for m in conversation
            ):
                raise RequestError(
                    "messages",
                    "each conversation must be a list of message dicts (not mixed with "
                    "bare messages)",
                    row=i,
                )
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(c, add_generation_prompt=True),
                add_special_tokens=False,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _recipe_for(
    model: str | None,
    *,
    recipe: Recipe | str | None,
    overrides: Overrides | None,
    gguf_file: str | None,
    download: bool,
) -> Recipe:
    """The recipe ``LLM(...)`` builds: ``recipe`` as given, or derived from / pointed at
    ``model``."""
    if model is None:
        if recipe is None:
            raise RequestError("model", "give a model (a GGUF file, directory or Hub id) or recipe")
        if gguf_file is not None:
            raise RequestError("gguf_file", "needs model", value=gguf_file)
        if isinstance(recipe, Recipe):
            if overrides is None:
                return recipe
            return recipe_from_dict(recipe_to_dict(recipe), overrides=overrides)
        return load_recipe(recipe, overrides=overrides)
    if isinstance(recipe, Recipe):
        raise RequestError(
            "recipe", "must be a name or path when model is given (-m replaces its checkpoint)"
        )
    from llmrt.recipe.derived import model_recipe_args

    name, model_overrides = model_recipe_args(
        model, recipe=recipe, gguf_file=gguf_file, download=download
    )
    return load_recipe_with(name, model_overrides, overrides)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or a token-id list) or many, as a list of prompts; anything
    else is a RequestError naming what was given."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray, Mapping)) or not isinstance(prompts, Sequence):
        raise RequestError(
            "prompts",
            "must be a string, a list of token ids, or a list of those",
            value=type(prompts).__name__,
        )
    items = list(prompts)
    if items and all(_is_token(t) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]
    for i, item in enumerate(items):
        ok = isinstance(item, str) or (
            isinstance(item, Sequence)
            and not isinstance(item, (bytes, bytearray))
            and all(_is_token(t) for t in item)
        )
        if not ok:
            raise RequestError(
                "prompts",
                "each prompt must be a string or a list of token ids (ints)",
                row=i,
                value=item,
            )
    return items  # type: ignore[return-value]


def _is_token(value: object) -> bool:
    """An integer token id (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _text(prompt: Prompt) -> str | None:
    return prompt if isinstance(prompt, str) else None


def _output(request: Request, prompt: str | None) -> RequestOutput:
    wants = request.params.logprobs is not None
    ttft = None
    if request.first_token_time is not None:
        ttft = request.first_token_time - request.arrival_time
    return RequestOutput(
        index=request.index,
        prompt=prompt,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=tuple(request.output_token_ids),
        text=request.text,
        finish_reason=request.finish_reason or "abort",
        logprobs=tuple(request.logprobs) if wants else None,
        top_logprobs=tuple(request.top_logprobs) if wants and request.params.logprobs else None,
        ttft_s=ttft,
        token_times=tuple(request.token_times),
    )
