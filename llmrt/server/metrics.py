"""Prometheus metrics of one server (its own registry, so several servers can share a process).

Names follow vLLM's where one exists (``llmrt_`` prefix instead of ``vllm:``). The engine
thread updates them after every step; ``GET /metrics`` renders the registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmrt.serving.engine import Engine

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    """Counters, gauges and histograms of one server; thread-safe (prometheus-client)."""

    def __init__(self, *, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**label)

        self.running = gauge("llmrt_num_requests_running", "Requests holding a decode slot.")
        self.waiting = gauge(
            "llmrt_num_requests_waiting", "Requests queued for a slot (bounded by max_waiting)."
        )
        self.kv_blocks_used = gauge("llmrt_kv_blocks_used", "KV blocks referenced by requests.")
        self.kv_blocks_free = gauge(
            "llmrt_kv_blocks_free", "KV blocks free (prefix-cached or not), all lanes."
        )
        self.prefix_hit_rate = gauge(
            "llmrt_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / queried."
        )
        self.prefix_queries = counter(
            "llmrt_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "llmrt_prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.prompt_tokens = counter("llmrt_prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("llmrt_generation_tokens", "Tokens generated.")
        self.steps = counter("llmrt_engine_steps", "Engine steps run.")
        self.running_per_step = histogram(
            "llmrt_iteration_running_requests",
            "Requests running during one engine step (the continuous batch).",
            _BATCH_BUCKETS,
        )
        self.ttft = histogram(
            "llmrt_time_to_first_token_seconds",
            "Submission to first token.",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "llmrt_inter_token_latency_seconds",
            "Time between two tokens of one request.",
            _LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "llmrt_e2e_request_latency_seconds", "Submission to last token.", _LATENCY_BUCKETS
        )
        self._finished = Counter(
            "llmrt_request_success",
            "Finished requests by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._rejected = Counter(
            "llmrt_request_rejected",
            "Requests refused before reaching the engine, by HTTP status.",
            ["model_name", "status"],
            registry=r,
        )
        self._label = model_name
        self._seen_queries = 0
        self._seen_hits = 0

    def finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._label, finished_reason=reason).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(model_name=self._label, status=str(status)).inc()

    def observe_engine(self, engine: Engine, *, pending: int) -> None:
        """Gauges from the engine's state between steps (the engine thread calls this)."""
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting) + pending)
        free = sum(a.num_free_blocks for a in scheduler.allocators)
        total = sum(a.config.num_blocks for a in scheduler.allocators)
        self.kv_blocks_free.set(free)
        self.kv_blocks_used.set(total - free)
        queries = sum(a.prefix_cache_stats.queried_tokens for a in scheduler.allocators)
        hits = sum(a.prefix_cache_stats.hit_tokens for a in scheduler.allocators)
        self.prefix_queries.inc(queries - self._seen_queries)
        self.prefix_hits.inc(hits - self._seen_hits)
        self._seen_queries, self._seen_hits = queries, hits
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
