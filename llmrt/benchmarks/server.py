"""``llmrt bench --server``: the ``mixed`` workload through ``llmrt serve`` against offline
``LLM.generate`` on the same prompts, measured in the same run.

The offline run submits every prompt at once; the server run sends each prompt from its
own streaming client, all at once (``--concurrency`` caps the clients), so both face the
same continuous batch. A second server run with 8 concurrent clients reports the time to
first token a user sees at that load. Tokens are counted per streamed chunk (one per
generated token) and checked against each response's ``usage``. Without a URL the bench
starts ``llmrt serve`` itself (a subprocess on a free loopback port, the same recipe and
``--set`` overrides) after the offline run, and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from llmrt.benchmarks.prompts import random_prompts
from llmrt.benchmarks.report import Report, Target
from llmrt.benchmarks.serving import (
    MIXED_MAX_LEN,
    MIXED_NEW_TOKENS,
    MIXED_PROMPTS,
    _warm,
    greedy,
    latency_stats,
    mixed_prompts,
    prompt_summary,
    warm_prompts,
)
from llmrt.benchmarks.settings import BenchSettings
from llmrt.benchmarks.sizing import sized_recipe
from llmrt.benchmarks.timing import ratio
from llmrt.serving.llm import LLM

TTFT_CONCURRENCY = 8
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 900.0
#: ``--schema``: every token stays inside a JSON array of strings that cannot close before
#: max_tokens, so structured and plain runs generate the same number of tokens.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 1000},
    },
    "required": ["items"],
}
STALL_STREAMS = 8
STALL_BODY_BYTES = 10_000_000


@attrs.frozen(kw_only=True)
class ClientRun:
    """One server run: wall time and each request's token timestamps (``perf_counter``)."""

    start: float
    wall_s: float
    token_times: list[list[float]]
    submit_times: list[float]
    texts: list[str]


def server(settings: BenchSettings) -> Report:
    n = settings.count(MIXED_PROMPTS)
    new = settings.new_tokens(MIXED_NEW_TOKENS)
    sized = sized_recipe(
        settings.recipe, user_overrides=settings.overrides, tokens_per_request=MIXED_MAX_LEN + new
    )
    recipe = sized.recipe
    report = Report(workload="server", recipe=recipe.name)
    with LLM.from_recipe(recipe) as llm:
        pool, lengths, prompts = mixed_prompts(
            llm, num_prompts=n, new_tokens=new, seed=settings.seed
        )
        _warm(llm, pool, longest=max(lengths), seed=settings.seed)
        start = time.perf_counter()
        outputs = llm.generate(prompts, greedy(new))
        wall = time.perf_counter() - start
        offline = latency_stats(
            start=start,
            wall_s=wall,
            token_times=[o.token_times for o in outputs],
            prompt_tokens=sum(lengths),
        )
        warm = warm_prompts(pool, longest=max(lengths), seed=settings.seed)
        expected = [o.text for o in outputs]
        # The 8-client run gets its own prompts (same lengths): reusing the first run's
        # would hit the server's prefix cache and flatter its TTFT.
        fresh = random_prompts(lengths, pool=pool, seed=settings.seed + 1)
        max_len = llm.engine.scheduler.config.max_model_len
    clients = min(settings.concurrency or n, n)
    report.section(
        "config",
        {
            **prompt_summary(lengths, new_tokens=new),
            "clients": clients,
            "ttft_clients": min(TTFT_CONCURRENCY, n),
            "server": settings.server or "self-started",
            "bench_overrides": list(sized.bench_overrides),
        },
    )
    report.section("offline", offline)
    overrides = [*sized.bench_overrides, *settings.overrides]
    with _server(settings, overrides=overrides) as url:
        model = _model_id(url)
        asyncio.run(_drive(url, model, warm, new_tokens=2, concurrency=len(warm)))
        full = asyncio.run(_drive(url, model, prompts, new_tokens=new, concurrency=clients))
        eight = asyncio.run(
            _drive(url, model, fresh, new_tokens=new, concurrency=min(TTFT_CONCURRENCY, n))
        )
        if settings.schema:
            _structured_runs(report, url, model, lengths, pool, settings, new, clients)
        if settings.stall_check:
            # Long enough streams to see a stall, within the context of the prompts they get.
            room = max_len - max(sorted(lengths)[:STALL_STREAMS])
            _stall_runs(report, url, model, lengths, pool, settings, min(max(new, 128), room))
    served = _stats(full, prompt_tokens=sum(lengths))
    served["greedy_texts_identical"] = sum(
        a == b for a, b in zip(full.texts, expected, strict=True)
    )
    at_eight = _stats(eight, prompt_tokens=sum(lengths))
    if served["greedy_texts_identical"] < len(expected):
        report.note(
            f"{len(expected) - served['greedy_texts_identical']} of {len(expected)} greedy "
            "texts differ from the offline run's: the server forms other prefill waves, and a "
            "wave's rows decide whether its prompt GEMMs take device.gemm_dtype (from "
            "device.gemm_dtype_min_rows rows); --set device.gemm_dtype=float32 tells that from "
            "a serving fault (SmolLM2 on a Zen 4: 29 of 32 equal by default, 32 of 32 in float32)"
        )
    report.section("server", served)
    report.section(f"server_{TTFT_CONCURRENCY}_clients", at_eight)
    report.series["server ttft"] = [
        t[0] - s for t, s in zip(full.token_times, full.submit_times, strict=True) if t
    ]
    report.note(
        f"server TTFT p50 at {TTFT_CONCURRENCY} clients: {at_eight['ttft_p50_s']:.3f} s "
        f"(all {clients} clients at once: {served['ttft_p50_s']:.3f} s, "
        f"offline: {offline['ttft_p50_s']:.3f} s)"
    )
    report.ratio(
        "server_over_offline_tokens_per_s",
        ratio(served["output_tokens_per_s"], offline["output_tokens_per_s"]),
        label="server/offline tokens/s ratio",
        target=Target(op=">=", bound=0.9),
        headline=True,
    )
    return report


def _stats(run: ClientRun, *, prompt_tokens: int) -> dict[str, Any]:
    """Like the offline stats, but TTFT counts from each request's own submission."""
    stats = latency_stats(
        start=run.start, wall_s=run.wall_s, token_times=run.token_times, prompt_tokens=prompt_tokens
    )
    shifted = [
        [t - (s - run.start) for t in times]
        for times, s in zip(run.token_times, run.submit_times, strict=True)
    ]
    own = latency_stats(
        start=run.start, wall_s=run.wall_s, token_times=shifted, prompt_tokens=prompt_tokens
    )
    for key in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s"):
        stats[key] = own[key]
    return stats


def _structured_runs(
    report: Report,
    url: str,
    model: str,
    lengths: Sequence[int],
    pool: Any,
    settings: BenchSettings,
    new: int,
    clients: int,
) -> None:
    """Plain and JSON-schema runs alternated twice on fresh prompts of the same lengths
    (no prefix-cache help for either); the ratio of their best tokens/s."""
    fmt = {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}
    best: dict[str, float] = {"plain": 0.0, "structured": 0.0}
    seed = settings.seed + 100
    for _ in range(2):
        for kind in ("plain", "structured"):
            seed += 1
            prompts = random_prompts(lengths, pool=pool, seed=seed)
            run = asyncio.run(
                _drive(
                    url,
                    model,
                    prompts,
                    new_tokens=new,
                    concurrency=clients,
                    response_format=fmt if kind == "structured" else None,
                )
            )
            if kind == "structured":
                _check_structured(run)
            stats = _stats(run, prompt_tokens=sum(lengths))
            best[kind] = max(best[kind], float(stats["output_tokens_per_s"]))
    report.section(
        "structured",
        {
            "plain_tokens_per_s": best["plain"],
            "json_schema_tokens_per_s": best["structured"],
        },
    )
    report.ratio(
        "structured_over_plain_tokens_per_s",
        ratio(best["structured"], best["plain"]),
        label="JSON-schema/plain tokens/s ratio (best of 2 each, alternated)",
        target=Target(op=">=", bound=0.9),
    )


def _check_structured(run: ClientRun) -> None:
    """Every structured text is a prefix of a JSON value the schema allows: it opens the
    array of strings, or is cut by max_tokens before it could."""
    opening = '{"items":["'
    for text in run.texts:
        if not (text.startswith(opening) or opening.startswith(text)):
            raise RuntimeError(f"a JSON-schema stream broke its schema: {text[:80]!r}")


def _stall_runs(
    report: Report,
    url: str,
    model: str,
    lengths: Sequence[int],
    pool: Any,
    settings: BenchSettings,
    new: int,
) -> None:
    """8 streams with and without a 10 MB request sent once every stream has tokens."""
    short = sorted(lengths)[:STALL_STREAMS]
    results = {}
    for kind, seed in (("control", 201), ("large_request", 202)):
        prompts = random_prompts(short, pool=pool, seed=settings.seed + seed)
        results[kind] = asyncio.run(
            _stall(url, model, prompts, new_tokens=new, large=kind == "large_request")
        )
    report.section("stall", {f"{k}_{key}": v for k, r in results.items() for key, v in r.items()})
    report.ratio(
        "stall_max_gap_over_median",
        results["large_request"]["max_gap_over_median"],
        label=f"largest inter-chunk gap over its stream's median, {STALL_STREAMS} streams and "
        f"a {STALL_BODY_BYTES // 1_000_000} MB request (control run without it: "
        f"{results['control']['max_gap_over_median']:.2f})",
        target=Target(op="<=", bound=2.0),
    )


async def _stall(
    url: str, model: str, prompts: Sequence[list[int]], *, new_tokens: int, large: bool
) -> dict[str, Any]:
    times: list[list[float]] = [[] for _ in prompts]
    flowing = asyncio.Event()
    window: list[float] = []
    # Encoded before the streams start: serializing 10 MB in this process's event loop
    # would delay this client's own reads and be measured as the server's stall.
    payload = json.dumps(
        {"model": model, "prompt": "y" * STALL_BODY_BYTES, "max_tokens": 1}
    ).encode()

    async def stream(http: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": model,
            "prompt": prompts[i],
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise RuntimeError(
                    f"the server refused a stall-check stream: {response.status_code} {detail}"
                )
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    times[i].append(time.perf_counter())
                    if all(len(t) >= 4 for t in times):
                        flowing.set()

    async def big(http: httpx.AsyncClient) -> tuple[int, float]:
        await flowing.wait()
        start = time.perf_counter()
        window.append(start)
        response = await http.post(
            "/v1/completions", content=payload, headers={"content-type": "application/json"}
        )
        window.append(time.perf_counter())
        return response.status_code, window[1] - start

    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        tasks = [asyncio.create_task(stream(http, i)) for i in range(len(prompts))]
        streams = asyncio.gather(*tasks)
        flows = asyncio.create_task(flowing.wait())
        # A stream that fails (or ends before 4 tokens) must end the wait, not leave it.
        waiting: set[asyncio.Future[Any]] = {streams, flows}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not flowing.is_set():
            flows.cancel()
            await streams  # raises the failed stream's error
            raise RuntimeError("the stall-check streams ended before each had 4 tokens")
        status, took = (0, 0.0)
        if large:
            status, took = await big(http)
        await streams
    worst = 0.0
    medians = []
    for t in times:
        gaps = [b - a for a, b in itertools.pairwise(t[3:])]  # decode cadence, prefills past
        if len(gaps) < 2:
            continue
        median = sorted(gaps)[len(gaps) // 2]
        medians.append(median)
        worst = max(worst, max(gaps) / median)
    out: dict[str, Any] = {
        "max_gap_over_median": worst,
        "median_gap_s": sorted(medians)[len(medians) // 2] if medians else 0.0,
    }
    if large:
        out["large_request_status"] = status
        out["large_request_s"] = took
    return out


async def _drive(
    url: str,
    model: str,
    prompts: Sequence[list[int]],
    *,
    new_tokens: int,
    concurrency: int,
    response_format: dict[str, Any] | None = None,
) -> ClientRun:
    """Stream every prompt with ``concurrency`` clients pulling from one queue."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    token_times: list[list[float]] = [[] for _ in prompts]
    submit_times = [0.0] * len(prompts)
    texts = [""] * len(prompts)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if response_format is not None:
                body["response_format"] = response_format
            submit_times[i] = time.perf_counter()
            usage = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise RuntimeError(f"server answered {response.status_code}: {response.text}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", ()):
                        token_times[i].append(time.perf_counter())
                        texts[i] += choice["text"]
            if usage is None or usage["completion_tokens"] != len(token_times[i]):
                raise RuntimeError(f"request {i}: usage {usage} vs {len(token_times[i])} chunks")

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return ClientRun(
        start=start, wall_s=wall, token_times=token_times, submit_times=submit_times, texts=texts
    )


def _model_id(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


@contextlib.contextmanager
def _server(settings: BenchSettings, *, overrides: Sequence[str]) -> Iterator[str]:
    if settings.server:
        url = settings.server.rstrip("/")
        _wait_healthy(url, proc=None, log=None)
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="llmrt-bench-") as tmp:
        log = Path(tmp) / "serve.log"
        sets = [arg for o in overrides for arg in ("--set", o)]
        with log.open("w") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "llmrt.cli", "serve", settings.recipe, "--port", "0", *sets],
                stdout=subprocess.DEVNULL,
                stderr=sink,
                env=os.environ.copy(),
            )
        try:
            url = _listening(log, proc)
            _wait_healthy(url, proc=proc, log=log)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _listening(log: Path, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log.read_text())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"llmrt serve exited {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise TimeoutError("llmrt serve did not bind")


def _wait_healthy(url: str, *, proc: subprocess.Popen[bytes] | None, log: Path | None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None else ""
            raise RuntimeError(f"llmrt serve exited {proc.returncode}: {tail}")
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health not ready after {START_TIMEOUT_S} s")
