"""The ASGI app: OpenAI routes over one :class:`~llmrt.server.engine_loop.EngineLoop`.

``create_app(build=...)`` returns a FastAPI app whose lifespan builds and warms the
runtime on a background thread (``GET /health`` answers 503 until that finished, like
llama-server), starts the engine thread, and on shutdown stops the thread (aborting what
is left) and closes the runtime through its scopes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmrt.errors import LLMRTError, RequestError, UnsupportedError
from llmrt.sampling.params import SamplingParams
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
)
from llmrt.serving.llm import LLM

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
    build_error: BaseException | None = None
    stopping: bool = False


def create_app(
    *,
    build: Callable[[], LLM],
    model_name: str,
    max_waiting: int,
    api_key: str | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The server app; ``build`` makes the warmed runtime (owned by the app from then on).

    ``on_fatal`` is called (from any thread) when building fails or the engine dies, so
    the process around the app can shut down.
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
        loop = EngineLoop(
            engine=llm.engine, max_waiting=max_waiting, metrics=state.metrics, on_failure=fatal
        )
        loop.start()
        state.llm, state.loop = llm, loop

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        builder = threading.Thread(target=build_runtime, name="llmrt-build", daemon=True)
        builder.start()
        try:
            yield
        finally:
            state.stopping = True
            await asyncio.to_thread(builder.join)
            close(state)

    app = FastAPI(title="llmrt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.llmrt = state
    _install_error_handlers(app, state)

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

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "llmrt",
        }
        if state.llm is not None:
            card["max_model_len"] = state.llm.engine.scheduler.config.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        llm, loop = _ready(state)
        _check_model(state, body.model)
        body.check_unsupported()
        prompts = [_encode(llm, p) for p in body.prompts()]
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        params = [_params(llm, body, ids, max_tokens, body.logprobs, "prompt") for ids in prompts]
        run = _Run(
            kind="completion",
            model=state.model_name,
            llm=llm,
            loop=loop,
            prompts=prompts,
            params=params,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )
        return await run.respond(request, stream=body.stream)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        llm, loop = _ready(state)
        _check_model(state, body.model)
        body.check_unsupported()
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise RequestError(
                "max_completion_tokens", "give either max_tokens or max_completion_tokens"
            )
        try:
            text = llm.tokenizer.apply_chat_template(
                [m.to_template() for m in body.messages], add_generation_prompt=True
            )
        except UnsupportedError as exc:
            raise RequestError("messages", str(exc)) from None
        ids = tuple(llm.tokenizer.encode(text, add_special_tokens=False))
        max_len = llm.engine.scheduler.config.max_model_len
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, max_len - len(ids))
        logprobs = body.engine_logprobs()
        params = [_params(llm, body, ids, max_tokens, logprobs, "messages")]
        run = _Run(
            kind="chat",
            model=state.model_name,
            llm=llm,
            loop=loop,
            prompts=[ids],
            params=params,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )
        return await run.respond(request, stream=body.stream)

    return app


def close(state: ServerState) -> None:
    """Stop the engine thread (aborting what is left), then close the runtime; keeps
    both failures if both fail."""
    errors: list[BaseException] = []
    if state.loop is not None:
        try:
            state.loop.stop(timeout=ENGINE_STOP_TIMEOUT_S)
        except BaseException as exc:
            errors.append(exc)
    if state.llm is not None:
        try:
            state.llm.close(primary=errors[0] if errors else None)
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


# -- request handling ----------------------------------------------------------------------


def _ready(state: ServerState) -> tuple[LLM, EngineLoop]:
    if state.stopping:
        raise APIError(503, "the server is shutting down", type="service_unavailable")
    if state.llm is None or state.loop is None:
        raise APIError(503, "the model is still loading", type="service_unavailable")
    if state.loop.failed is not None:
        raise APIError(503, f"the engine failed: {state.loop.failed}", type="internal_error")
    return state.llm, state.loop


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            400,
            f"model {model!r} is not served here (served: {state.model_name!r})",
            param="model",
            code="model_not_found",
        )


def _encode(llm: LLM, prompt: str | Sequence[int]) -> tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "is empty")
        return tuple(llm.tokenizer.encode(prompt))
    if not prompt:
        raise RequestError("prompt", "is empty")
    vocab = llm.engine.executor.lanes[0].decode.config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise RequestError("prompt", f"token id out of range [0, {vocab})", value=bad[0])
    return tuple(prompt)


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
            field = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
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
            value=max_tokens,
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
    id: str = attrs.Factory(lambda: f"cmpl-{uuid.uuid4().hex}")
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
                        prompt_token_ids=ids, params=params, choice=i, sink=self.sink
                    )
                )
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        for ticket in self.tickets:
            self.loop.abort(ticket)

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
                raise APIError(500, f"generation failed: {item.error}", type="internal_error")
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
                out_choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": choice.text},
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
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
            "usage": _usage(
                sum(c.prompt_tokens for c in choices), sum(c.completion_tokens for c in choices)
            ),
        }

    async def _stream(self) -> AsyncIterator[str]:
        prompt = [len(ids) for ids in self.prompts]
        completion = [0] * len(self.tickets)
        try:
            if self.kind == "chat":
                for i in range(len(self.tickets)):
                    yield self._chunk(i, {"role": "assistant", "content": ""}, None, None)
            async for item in self._items():
                if isinstance(item, Failure):
                    error = APIError(500, f"generation failed: {item.error}", type="internal_error")
                    yield _sse(error.body())
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
                    )
                if self.kind == "chat":
                    delta = {"content": item.text} if item.text else {}
                    yield self._chunk(item.choice, delta, logprobs, item.finish_reason)
                else:
                    yield self._chunk(item.choice, item.text, logprobs, item.finish_reason)
            if self.include_usage:
                yield _sse(
                    {
                        "id": self.id,
                        "object": self._chunk_object,
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": _usage(sum(prompt), sum(completion)),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            self._abort()

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
        return _sse(
            {
                "id": self.id,
                "object": self._chunk_object,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

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
    ) -> dict[str, Any]:
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
        offsets, at = [], 0
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
