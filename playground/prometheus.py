"""The server's metrics in Prometheus's text format (`GET /metrics`), named as vLLM names those of the same meaning
with this project's prefix (`playground:` for `vllm:`), so that dashboards built on vLLM's read them with the prefix
changed (docs/serving.md lists them side by side).

Request metrics (outcomes, token counts, latencies) are recorded by the engine's thread as each request ends; the
engine's state (requests running and waiting, KV blocks, preemptions, the speculative counters) is read from the
worker's latest snapshot when the metrics are scraped, so a scrape never touches the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "playground:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds; a 135M model on 2 cores answers its first token in tens of milliseconds, a large one in seconds
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class EngineState(Collector):
    """The engine's gauges and counters, read from the worker's snapshot (`EngineWorker.state`) at each scrape."""

    def __init__(self, state: Callable[[], dict[str, Any]], model: str) -> None:
        self.state, self.model = state, model

    def collect(self) -> Iterator[Metric]:
        state, labels = self.state(), [self.model]

        def gauge(name: str, text: str, value: float) -> Metric:
            metric = GaugeMetricFamily(PREFIX + name, text, labels=["model_name"])
            metric.add_metric(labels, value)
            return metric

        def counter(name: str, text: str, value: float) -> Metric:
            metric = CounterMetricFamily(PREFIX + name, text, labels=["model_name"])
            metric.add_metric(labels, value)
            return metric
        kv = state["kv"]
        yield gauge("num_requests_running", "Requests in the running batch.", state["running"])
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", state["waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (1 = all).",
                    kv["blocks_used"] / max(kv["blocks_total"], 1))
        yield gauge("kv_blocks_used", "KV cache blocks in use.", kv["blocks_used"])
        yield gauge("kv_blocks_free", "KV cache blocks free.", kv["blocks_total"] - kv["blocks_used"])
        yield counter("num_preemptions", "Requests preempted (their KV dropped, to be recomputed).",
                      state["preemptions"])
        yield counter("engine_steps", "Engine steps run.", state["steps"])
        drafts = state["drafts"]
        if drafts is None:  # plain decoding proposes nothing
            return
        yield counter("spec_decode_num_drafts", "Proposals verified (a request's step that verified any node).",
                      drafts["drafts"])
        yield counter("spec_decode_num_draft_tokens", "Proposed tokens (tree nodes) verified.", drafts["draft_tokens"])
        yield counter("spec_decode_num_accepted_tokens", "Proposed tokens kept.", drafts["accepted"])
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Proposed tokens kept at each position of the kept path (0: the first).",
                                           labels=["model_name", "position"])
        for position, count in enumerate(drafts["accepted_at"]):
            per_position.add_metric([self.model, str(position)], count)
        yield per_position


class ServerMetrics:
    """A server's metrics in a registry of their own (a process may serve twice, as the tests do)."""

    def __init__(self, state: Callable[[], dict[str, Any]], model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self.success = Counter(PREFIX + "request_success", "Requests answered in full, by why they finished.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.failure = Counter(PREFIX + "request_failure", "Requests answered with an error, by its HTTP status.",
                               ["model_name", "status"], registry=self.registry)
        model_only, registry = ["model_name"], self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the requests answered.", model_only,
                                     registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated for the requests answered.",
                                         model_only, registry=registry)
        self.first_token = Histogram(PREFIX + "time_to_first_token_seconds", "From a request's arrival (its body read) "
                                     "to its first generated token, queueing included.", model_only, registry=registry,
                                     buckets=LATENCY_BUCKETS)
        self.per_token = Histogram(PREFIX + "time_per_output_token_seconds", "A request's time per generated "
                                   "token after its first.", model_only, registry=registry, buckets=TOKEN_BUCKETS)
        self.latency = Histogram(PREFIX + "e2e_request_latency_seconds", "From a request's arrival (its body read) to "
                                 "its last token.", model_only, registry=registry, buckets=LATENCY_BUCKETS)
        self.registry.register(EngineState(state, model))

    def answered(self, reason: str, prompt_tokens: int, generated: int, first_s: float | None, total_s: float
                 ) -> None:
        """A request answered in full: why it finished, its token counts, the seconds to its first token (None when
        it generated none) and to its end, from its arrival."""
        self.success.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.generation_tokens.labels(self.model).inc(generated)
        self.latency.labels(self.model).observe(total_s)
        if first_s is not None:
            self.first_token.labels(self.model).observe(first_s)
            if generated > 1:
                self.per_token.labels(self.model).observe((total_s - first_s) / (generated - 1))

    def failed(self, status: int) -> None:
        self.failure.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
