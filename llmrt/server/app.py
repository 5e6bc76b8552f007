"""The ASGI app: OpenAI routes over one :class:`~llmrt.server.engine_loop.EngineLoop`.

``create_app(build=...)`` returns a FastAPI app whose lifespan builds and warms the
runtime on a background thread (``GET /health`` answers 503 until that finished, like
llama-server), starts the engine thread, and on shutdown stops the thread (aborting what
is left) and closes the runtime through its scopes.

Nothing a request sends runs on the event loop for long: bodies over the limit are refused
(413, :mod:`~llmrt.server.body_limit`), and parsing, chat-template rendering and
tokenizing run on the text workers (:mod:`~llmrt.server.text_work`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import attrs
import pydantic
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmrt.errors import LLMRTError, RequestError, UnsupportedError
from llmrt.sampling.guided import GuidedDecoding
from llmrt.sampling.params import SamplingParams
from llmrt.server import heap
from llmrt.server.access_log import AccessLog, RequestUsage, usage_of
from llmrt.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from llmrt.server.engine_loop import (
    EngineLoop,
    EngineUnavailable,
    Failure,
    Item,
    Overloaded,
    Ticket,
)
from llmrt.server.metrics import ServerMetrics
from llmrt.server.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmrt.server.text_work import TextWorkers, check_unicode
from llmrt.server.tools import ToolCall, ToolUse, render_history
from llmrt.serving.llm import LLM

Body = TypeVar("Body", bound=pydantic.BaseModel)

#: How long shutdown waits for the engine thread to abort and exit.
ENGINE_STOP_TIMEOUT_S = 30.0


class APIError(Exception):
    """An OpenAI-style error response: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


@attrs.define(kw_only=True, eq=False)
class ServerState:
    """What the routes share: the runtime once built, its engine loop and metrics."""

    model_name: str
    api_key: str | None
    max_waiting: int
    metrics: ServerMetrics
    llm: LLM | None = None
    loop: EngineLoop | None = None
    text: TextWorkers | None = None
    build_error: BaseException | None = None
    stopping: bool = False
    #: Objects frozen out of the collector's full passes once warm (``freeze_heap``).
    frozen_objects: int = 0

    def cut_streams(self, reason: str) -> None:
        """End every open request now with ``finish_reason="abort"`` (its stream still gets
        a final chunk and ``[DONE]``), one log line each (thread-safe)."""
        if self.loop is not None:
            self.loop.cut_all(reason)


def create_app(
    *,
    build: Callable[[], LLM],
    model_name: str,
    max_waiting: int,
    api_key: str | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_origins: Sequence[str] = (),
    freeze_heap: bool = False,
) -> FastAPI:
    """The server app; ``build`` makes the warmed runtime (owned by the app from then on).

    ``on_fatal`` is called (from any thread) when building fails or the engine dies, so
    the process around the app can shut down. ``allowed_origins`` turns CORS on for those
    browser origins (``*``: any); empty leaves it off. ``freeze_heap`` (only for a process
    the server owns: ``llmrt serve``) freezes what is alive once the runtime is warm out of
    the garbage collector's full passes, and unfreezes it before the teardown
    (``llmrt.server.heap``).
    """
    state = ServerState(
        model_name=model_name,
        api_key=api_key,
        max_waiting=max_waiting,
        metrics=ServerMetrics(model_name=model_name),
    )

    def fatal(exc: BaseException) -> None:
        if on_fatal is not None:
            on_fatal(exc)

    def build_runtime() -> None:
        try:
            llm = build()
        except BaseException as exc:
            state.build_error = exc
            fatal(exc)
            return
        if state.stopping:
            llm.close()
            return
        try:
            text = TextWorkers(
                tokenizer=llm.tokenizer, max_model_len=llm.engine.scheduler.config.max_model_len
            )
            # The structured-output set-up (~0.75 s for a 49k vocabulary) is paid here, not
            # by the first JSON request on the engine thread while every stream waits.
            if llm.tokenizer.eos_token_ids:
                llm.engine.guided.warm()
            if freeze_heap:
                state.frozen_objects = heap.freeze_heap()
        except BaseException as exc:
            state.build_error = exc
            llm.close(primary=exc)
            fatal(exc)
            return
        loop = EngineLoop(
            engine=llm.engine, max_waiting=max_waiting, metrics=state.metrics, on_failure=fatal
        )
        loop.start()
        state.llm, state.text, state.loop = llm, text, loop

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        builder = threading.Thread(target=build_runtime, name="llmrt-build", daemon=True)
        builder.start()
        try:
            yield
        finally:
            state.stopping = True
            await asyncio.to_thread(builder.join)
            if state.frozen_objects:
                heap.unfreeze_heap()
            close(state)

    app = FastAPI(title="llmrt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.llmrt = state
    _install_error_handlers(app, state)
    # Last added runs first: the access log sees every response, 413s and preflights too.
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in allowed_origins,
        )
    app.add_middleware(AccessLog)

    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), state.api_key.encode()
        ):
            raise APIError(
                401,
                "invalid or missing API key (send Authorization: Bearer KEY)",
                code="invalid_api_key",
            )

    @app.get("/health")
    async def health() -> Response:
        if state.build_error is not None:
            return JSONResponse({"status": "failed", "error": str(state.build_error)}, 503)
        if state.loop is None or state.loop.failed is not None:
            status = "starting" if state.loop is None else "failed"
            return JSONResponse({"status": status}, 503)
        if state.stopping:
            return JSONResponse({"status": "stopping"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def card() -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "llmrt",
        }
        if state.llm is not None:
            out["max_model_len"] = state.llm.engine.scheduler.config.max_model_len
        return out

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model_name:
            raise APIError(
                404,
                f"model {model_id!r} is not served here (served: {state.model_name!r})",
                param="model",
                code="model_not_found",
            )
        return card()

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(request: Request) -> dict[str, Any]:
        llm, _, text = _ready(state)
        body = await _parse(text, TokenizeRequest, request)
        _check_model(state, body.model)
        ids = await text.run(_tokenize, llm, text, body)
        return {
            "count": len(ids),
            "max_model_len": llm.engine.scheduler.config.max_model_len,
            "tokens": ids,
        }

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(request: Request) -> dict[str, Any]:
        llm, _, text = _ready(state)
        body = await _parse(text, DetokenizeRequest, request)
        _check_model(state, body.model)
        _check_ids(llm, body.tokens, "tokens")
        return {"prompt": await text.run(llm.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request) -> Response:
        llm, loop, text = _ready(state)
        body = await _parse(text, CompletionRequest, request)
        _check_model(state, body.model)
        body.check_unsupported()
        await text.run(_check_response_format, body)
        prompts = await text.run(_encode_prompts, llm, text, body.prompts())
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        params = [_params(llm, body, ids, max_tokens, body.logprobs, "prompt") for ids in prompts]
        run = _Run(
            kind="completion",
            model=state.model_name,
            llm=llm,
            loop=loop,
            prompts=_choices(prompts, body.n),
            params=_seeded_choices(params, body.n),
            n=body.n,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            usage=usage_of(request.scope),
            structured_field=_structured_field(body),
        )
        return await run.respond(request, stream=body.stream)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: Request) -> Response:
        llm, loop, text = _ready(state)
        body = await _parse(text, ChatCompletionRequest, request)
        _check_model(state, body.model)
        body.check_unsupported()
        tools = body.tool_use()
        await text.run(_check_response_format, body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise RequestError(
                "max_completion_tokens", "give either max_tokens or max_completion_tokens"
            )
        ids = await text.run(_chat_ids, llm, text, body, tools)
        max_len = llm.engine.scheduler.config.max_model_len
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        if max_tokens is None:
            max_tokens = max(1, max_len - len(ids))
        logprobs = body.engine_logprobs()
        params = [_params(llm, body, ids, max_tokens, logprobs, "messages")]
        forced = None if tools is None else tools.structured_output()
        if forced is not None:
            if params[0].structured_output is not None:
                raise RequestError(
                    "response_format", "cannot be combined with a required or named tool_choice"
                )
            params = [attrs.evolve(params[0], structured_output=forced)]
        run = _Run(
            kind="chat",
            tools=tools,
            model=state.model_name,
            llm=llm,
            loop=loop,
            prompts=_choices([ids], body.n),
            params=_seeded_choices(params, body.n),
            n=body.n,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            usage=usage_of(request.scope),
            structured_field="tool_choice" if forced is not None else _structured_field(body),
        )
        return await run.respond(request, stream=body.stream)

    return app


def _version() -> str:
    try:
        return importlib.metadata.version("llmrt")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def close(state: ServerState) -> None:
    """Stop the engine thread (aborting what is left), then close the runtime; keeps
    both failures if both fail."""
    errors: list[BaseException] = []
    if state.loop is not None:
        try:
            state.loop.stop(timeout=ENGINE_STOP_TIMEOUT_S)
        except BaseException as exc:
            errors.append(exc)
    if state.text is not None:
        state.text.close()
    if state.llm is not None:
        try:
            state.llm.close(primary=errors[0] if errors else None)
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


# -- request handling ----------------------------------------------------------------------


def _ready(state: ServerState) -> tuple[LLM, EngineLoop, TextWorkers]:
    if state.stopping:
        raise APIError(503, "the server is shutting down", type="service_unavailable")
    if state.llm is None or state.loop is None or state.text is None:
        raise APIError(503, "the model is still loading", type="service_unavailable")
    if state.loop.failed is not None:
        raise APIError(503, f"the engine failed: {state.loop.failed}", type="internal_error")
    return state.llm, state.loop, state.text


async def _parse(text: TextWorkers, model: type[Body], request: Request) -> Body:
    """The request body as ``model``, parsed and validated on a text worker."""
    raw = await request.body()
    return await text.run(_validate, text, model, raw)


def _validate(text: TextWorkers, model: type[Body], raw: bytes) -> Body:
    text.check_body(raw)
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            _name_invalid_text(raw)
        raise RequestValidationError(errors) from None


def _name_invalid_text(raw: bytes) -> None:
    """pydantic refuses lone surrogates (``"\\ud800"``) as malformed JSON at a byte
    offset; the standard parser reads them, so the error can name the field."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return
    check_unicode(data, "")


def _check_response_format(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Compile the requested format once here (on a text worker), so a schema or pattern
    llguidance cannot enforce is a 400 naming its field before anything is queued."""
    structured = body.structured_output()
    if structured is None:
        return
    try:
        GuidedDecoding.grammar(structured)
    except RequestError as exc:
        raise RequestError(_structured_field(body) or "response_format", exc.reason) from None


def _structured_field(body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request field its structured output comes from (what an error names)."""
    structured = body.structured_output()
    if structured is None:
        return None
    if body.response_format is not None:
        if structured.kind == "json_schema":
            return "response_format.json_schema.schema"
        return "response_format"
    return next(
        name
        for name in ("guided_json", "guided_regex", "guided_choice")
        if getattr(body, name) is not None
    )


def _encode_prompts(
    llm: LLM, text: TextWorkers, prompts: Sequence[str | Sequence[int]]
) -> list[tuple[int, ...]]:
    """Each prompt's token ids (on a text worker)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "is empty")
            out.append(tuple(text.encode(prompt, "prompt")))
        else:
            out.append(_check_ids(llm, prompt, "prompt"))
    return out


def _check_ids(llm: LLM, ids: Sequence[int], field: str) -> tuple[int, ...]:
    if not ids and field == "prompt":
        raise RequestError(field, "is empty")
    vocab = llm.engine.executor.lanes[0].decode.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(field, f"token id out of range [0, {vocab})", value=bad[0])
    return tuple(ids)


def _rendered(llm: LLM, text: TextWorkers, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
    """The chat template's text for ``messages`` (length-checked before rendering)."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            text.check_length(content, f"messages.{i}.content")
    try:
        return llm.tokenizer.apply_chat_template(messages, **kw)
    except UnsupportedError as exc:
        raise RequestError("messages", str(exc)) from None


def _chat_ids(
    llm: LLM, text: TextWorkers, body: ChatCompletionRequest, tools: ToolUse | None
) -> tuple[int, ...]:
    """The chat request's prompt ids, tools and tool history rendered (on a text worker)."""
    template = llm.tokenizer.chat_template
    messages, extra = render_history(
        [m.to_template() for m in body.messages],
        tools,
        template_source="" if template is None else template.source,
    )
    rendered = _rendered(llm, text, messages, add_generation_prompt=True, extra=extra)
    return tuple(text.encode(rendered, "messages", add_special_tokens=False))


def _tokenize(llm: LLM, text: TextWorkers, body: TokenizeRequest) -> list[int]:
    if body.messages is not None:
        rendered = _rendered(
            llm,
            text,
            [m.to_template() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
        )
        return text.encode(rendered, "messages", add_special_tokens=body.add_special_tokens)
    if body.prompt is None:
        raise RequestError("prompt", "give prompt or messages")
    return text.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)


def _choices(prompts: Sequence[tuple[int, ...]], n: int) -> list[tuple[int, ...]]:
    """Each prompt ``n`` times, choice index ``prompt * n + k`` (OpenAI's order). The
    copies share the prompt's KV blocks through the prefix cache."""
    return [ids for ids in prompts for _ in range(n)]


def _seeded_choices(params: Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    """``n`` choices per prompt; a seeded request's k-th choice is seeded ``seed + k`` so
    the choices differ yet the request stays reproducible."""
    out = []
    for p in params:
        for k in range(n):
            out.append(p if p.seed is None or k == 0 else attrs.evolve(p, seed=int(p.seed) + k))
    return out


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            400,
            f"model {model!r} is not served here (served: {state.model_name!r})",
            param="model",
            code="model_not_found",
        )


def _params(
    llm: LLM,
    body: CompletionRequest | ChatCompletionRequest,
    ids: Sequence[int],
    max_tokens: int,
    logprobs: int | None,
    prompt_field: str,
) -> SamplingParams:
    max_len = llm.engine.scheduler.config.max_model_len
    if len(ids) > max_len:
        raise RequestError(
            prompt_field,
            f"has {len(ids)} tokens, more than this model's maximum context length "
            f"max_model_len={max_len}",
        )
    try:
        params = body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
    except RequestError as exc:
        if isinstance(body, ChatCompletionRequest) and exc.field == "logprobs":
            raise RequestError("top_logprobs", exc.reason, value=exc.value) from None
        if isinstance(body, ChatCompletionRequest) and exc.field == "max_tokens":
            # the one that was used: max_completion_tokens wins when both are given
            field = (
                "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            )
            raise RequestError(field, exc.reason, value=exc.value) from None
        raise
    if len(ids) + max_tokens > max_len:
        field = "max_tokens"
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            field = "max_completion_tokens"
        raise RequestError(
            field,
            f"prompt ({len(ids)} tokens) + {field} ({max_tokens}) exceeds this model's "
            f"maximum context length max_model_len={max_len}",
        )
    return params


@attrs.define(kw_only=True, eq=False)
class _Choice:
    text: str = ""
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    top_logprobs: list[dict[int, float]] = attrs.Factory(list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@attrs.define(kw_only=True, eq=False)
class _Run:
    """One HTTP request's engine requests (one per prompt) and its response."""

    kind: str
    model: str
    llm: LLM
    loop: EngineLoop
    prompts: list[tuple[int, ...]]
    params: list[SamplingParams]
    include_usage: bool
    usage: RequestUsage = attrs.Factory(RequestUsage)
    n: int = 1
    tools: ToolUse | None = None
    structured_field: str | None = None
    """The request field its structured output came from (named when it cannot be held)."""
    id: str = attrs.Factory(
        lambda self: f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
        takes_self=True,
    )
    created: int = attrs.Factory(lambda: int(time.time()))
    tickets: list[Ticket] = attrs.Factory(list)
    sink: asyncio.Queue[Item] = attrs.Factory(asyncio.Queue)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    async def respond(self, request: Request, *, stream: bool) -> Response:
        await self._submit()
        if stream:
            return _EventStream(self._stream(), on_close=self._abort)
        watcher = asyncio.create_task(_until_disconnected(request))
        collector = asyncio.create_task(self._collect())
        try:
            done, _ = await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
            if collector not in done:
                collector.cancel()
                self._abort()
                return Response(status_code=499)
            return JSONResponse(collector.result())
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
            self._abort()

    async def _submit(self) -> None:
        try:
            for i, (ids, params) in enumerate(zip(self.prompts, self.params, strict=True)):
                self.tickets.append(
                    await self.loop.submit(
                        prompt_token_ids=ids,
                        params=params,
                        choice=i,
                        sink=self.sink,
                        label=f"{self.id} choice {i}",
                    )
                )
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        for ticket in self.tickets:
            self.loop.abort(ticket)

    @property
    def prompt_tokens(self) -> int:
        """The request's prompt tokens, each prompt counted once whatever ``n``."""
        return sum(len(ids) for ids in self.prompts[:: self.n])

    def _record(self, completion_tokens: int) -> dict[str, int]:
        self.usage.prompt_tokens = self.prompt_tokens
        self.usage.completion_tokens = completion_tokens
        return _usage(self.prompt_tokens, completion_tokens)

    async def _items(self) -> AsyncIterator[Item]:
        """Every item of every choice until all finished."""
        left = len(self.tickets)
        while left:
            item = await self.sink.get()
            if isinstance(item, Failure) or item.finish_reason is not None:
                left -= 1
            yield item

    async def _collect(self) -> dict[str, Any]:
        choices = [_Choice() for _ in self.tickets]
        async for item in self._items():
            if isinstance(item, Failure):
                raise _failure_error(item, self.structured_field)
            choice = choices[item.choice]
            choice.text += item.text
            if item.token_id >= 0:
                choice.token_ids.append(item.token_id)
                if item.logprob is not None:
                    choice.logprobs.append(item.logprob)
                    choice.top_logprobs.append(item.top_logprobs or {})
            choice.prompt_tokens = item.prompt_tokens
            choice.completion_tokens = item.completion_tokens
            if item.finish_reason is not None:
                choice.finish_reason = item.finish_reason
        out_choices = []
        for i, (choice, params) in enumerate(zip(choices, self.params, strict=True)):
            logprobs = None
            if params.logprobs is not None:
                logprobs = self._logprobs(
                    choice.token_ids, choice.logprobs, choice.top_logprobs, params.logprobs
                )
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": choice.text}
                reason = choice.finish_reason
                if self.tools is not None:
                    content, calls = self.tools.parse(choice.text)
                    if calls:
                        message = {
                            "role": "assistant",
                            "content": content,
                            "tool_calls": [c.to_openai() for c in calls],
                        }
                        reason = "tool_calls" if reason == "stop" else reason
                out_choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                    }
                )
            else:
                out_choices.append(
                    {
                        "index": i,
                        "text": choice.text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                    }
                )
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": out_choices,
            "usage": self._record(sum(c.completion_tokens for c in choices)),
        }

    async def _stream(self) -> AsyncIterator[str]:
        completion = [0] * len(self.tickets)
        offsets = [0] * len(self.tickets)  # each completion choice's logprobs text so far
        # Tools: a choice's text is held back while it may still be a call.
        held = ["" for _ in self.tickets]
        plain = [self.tools is None for _ in self.tickets]
        # A named tool choice: the whole reply is the call's arguments, streamed as they come.
        named = self.tools is not None and self.tools.choice == "named"
        calls: dict[int, ToolCall] = {}
        try:
            if self.kind == "chat":
                for i in range(len(self.tickets)):
                    yield self._chunk(i, {"role": "assistant", "content": ""}, None, None)
            async for item in self._items():
                if isinstance(item, Failure):
                    yield _sse(_failure_error(item, self.structured_field).body())
                    return
                completion[item.choice] = item.completion_tokens
                logprobs = None
                params = self.params[item.choice]
                if params.logprobs is not None and item.token_id >= 0:
                    logprobs = self._logprobs(
                        [item.token_id],
                        [item.logprob if item.logprob is not None else 0.0],
                        [item.top_logprobs or {}],
                        params.logprobs,
                        start=offsets[item.choice],
                    )
                    if "text_offset" in logprobs:
                        offsets[item.choice] += len(logprobs["tokens"][0])
                if self.kind == "chat" and named:
                    yield self._named_chunk(item.choice, item.text, item.finish_reason, calls)
                elif self.kind == "chat" and not plain[item.choice]:
                    assert self.tools is not None
                    held[item.choice] += item.text
                    if item.finish_reason is None and self.tools.may_be_call(held[item.choice]):
                        continue
                    text, held[item.choice] = held[item.choice], ""
                    plain[item.choice] = True
                    if item.finish_reason is not None:
                        yield self._tool_chunk(item.choice, text, item.finish_reason)
                        continue
                    yield self._chunk(item.choice, {"content": text}, logprobs, None)
                elif self.kind == "chat":
                    delta = {"content": item.text} if item.text else {}
                    yield self._chunk(item.choice, delta, logprobs, item.finish_reason)
                else:
                    yield self._chunk(item.choice, item.text, logprobs, item.finish_reason)
            usage = self._record(sum(completion))
            if self.include_usage:
                yield _sse(
                    {
                        "id": self.id,
                        "object": self._chunk_object,
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            self.usage.completion_tokens = sum(completion)
            self.usage.prompt_tokens = self.prompt_tokens
            self._abort()

    def _named_chunk(
        self, index: int, text: str, finish_reason: str | None, calls: dict[int, ToolCall]
    ) -> str:
        """A named call's next arguments text; its first chunk carries the id and name."""
        function: dict[str, Any] = {"arguments": text}
        delta: dict[str, Any] = {"index": 0, "function": function}
        if index not in calls:
            assert self.tools is not None and self.tools.named is not None
            calls[index] = ToolCall(name=self.tools.named, arguments="")
            delta.update(id=calls[index].id, type="function")
            function["name"] = self.tools.named
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return self._chunk(index, {"tool_calls": [delta]}, None, reason)

    def _tool_chunk(self, index: int, text: str, finish_reason: str) -> str:
        """The last chunk of a choice whose text was held back: its calls, or its text."""
        assert self.tools is not None
        content, calls = self.tools.parse(text)
        if not calls:
            return self._chunk(index, {"content": text} if text else {}, None, finish_reason)
        delta: dict[str, Any] = {"tool_calls": [c.to_openai(k) for k, c in enumerate(calls)]}
        if content:
            delta["content"] = content
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return self._chunk(index, delta, None, reason)

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _chunk(
        self,
        index: int,
        delta: str | dict[str, Any],
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
    ) -> str:
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": self._chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
        return _sse(chunk)

    def _token(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id], skip_special_tokens=False)

    def _top_by_text(self, top: dict[int, float], n: int) -> dict[str, float]:
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:n]
        return _first_wins([(self._token(i), v) for i, v in ranked])

    def _logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        top: Sequence[dict[int, float]],
        n: int,
        *,
        start: int = 0,
    ) -> dict[str, Any]:
        """OpenAI logprobs of these tokens; a completion's ``text_offset`` counts from
        ``start`` (a stream passes the choice's text so far)."""
        tokens = [self._token(t) for t in token_ids]
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": tok,
                        "logprob": lp,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {"token": s, "logprob": v, "bytes": list(s.encode())}
                            for s, v in (
                                (self._token(i), v)
                                for i, v in sorted(t.items(), key=lambda kv: -kv[1])[:n]
                            )
                        ],
                    }
                    for tok, lp, t in zip(tokens, logprobs, top, strict=True)
                ]
            }
        offsets, at = [], start
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": list(logprobs),
            "top_logprobs": [self._top_by_text(t, n) if n else None for t in top],
            "text_offset": offsets,
        }


class _EventStream(StreamingResponse):
    """A server-sent event stream that aborts its requests however it ends (finished,
    client gone before or during the stream, or cancelled at shutdown)."""

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _first_wins(pairs: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Text -> log-probability, most likely first; tokens sharing a text keep the best."""
    out: dict[str, float] = {}
    for text, value in pairs:
        out.setdefault(text, value)
    return out


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- errors --------------------------------------------------------------------------------


def _failure_error(failure: Failure, structured_field: str | None) -> APIError:
    """A failed generation as an API error: the request's own fault (a structured output
    that could not be enforced) is a 400 naming the field it came from, the engine's a 500."""
    error = failure.error
    if failure.own and isinstance(error, RequestError):
        param = error.field
        if param == "structured_output" and structured_field is not None:
            param = structured_field
        return APIError(400, f"generation failed: {error}", param=param)
    return APIError(500, f"generation failed: {error}", type="internal_error")


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    def reply(error: APIError) -> JSONResponse:
        state.metrics.rejected(error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(exc)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return reply(APIError(400, str(exc), param=exc.field))

    @app.exception_handler(UnsupportedError)
    async def unsupported(request: Request, exc: UnsupportedError) -> JSONResponse:
        return reply(APIError(400, str(exc)))

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        return reply(APIError(429, f"server overloaded: {exc}", type="rate_limit_exceeded"))

    @app.exception_handler(EngineUnavailable)
    async def unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
        return reply(APIError(503, str(exc), type="service_unavailable"))

    @app.exception_handler(LLMRTError)
    async def llmrt_error(request: Request, exc: LLMRTError) -> JSONResponse:
        return reply(APIError(400, str(exc)))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return reply(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return reply(APIError(exc.status_code, str(exc.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return reply(APIError(500, f"{type(exc).__name__}: {exc}", type="internal_error"))


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as an OpenAI error naming the field (``messages.0.role``)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(400, f"malformed JSON body: {ctx.get('error', first.get('msg'))}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Unions report the branch tried (``prompt.str``); the field is what the user wrote.
    loc = [p for p in loc if p not in _UNION_BRANCHES and not p.startswith(("list[", "function-"))]
    if not loc:
        return APIError(400, f"request body: {first.get('msg')}")
    param = ".".join(loc)
    shown = "" if first.get("type") == "missing" else f", got {first.get('input')!r}"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError(400, f"{param}: {first.get('msg')}{shown}{more}", param=param)


_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
