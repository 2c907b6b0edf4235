"""Prometheus metrics for the server, named like vLLM's (``specdec:`` instead of ``vllm:``).

Each ``EngineMetrics`` owns its own ``CollectorRegistry`` so several servers can live in one
process (tests). Counters are fed by diffing the engine's running totals after each step, so the
engine itself knows nothing about Prometheus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest as _generate_latest

if TYPE_CHECKING:
    from specdec.engine.llm_engine import LLMEngine
    from specdec.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineMetrics:
    """The server's metrics; ``update`` and ``observe_*`` are called from the engine thread."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.num_drafts = Counter(
            "specdec:spec_decode_num_drafts",
            "Verification steps that carried drafts.",
            m,
            registry=r,
        )
        self.num_draft_tokens = Counter(
            "specdec:spec_decode_num_draft_tokens", "Draft tokens proposed.", m, registry=r
        )
        self.num_accepted_tokens = Counter(
            "specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, registry=r
        )
        self.accepted_per_pos = Counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.",
            ["model_name", "position"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "specdec:prompt_tokens", "Prompt tokens admitted.", m, registry=r
        )
        self.generation_tokens = Counter(
            "specdec:generation_tokens", "Tokens generated.", m, registry=r
        )
        self.prefix_cache_queries = Counter(
            "specdec:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            m,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "specdec:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            m,
            registry=r,
        )
        self.request_success = Counter(
            "specdec:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_failure = Counter(
            "specdec:request_failure",
            "Requests the engine failed (finish_reason error, or a failed step); others went on.",
            m,
            registry=r,
        )
        self.num_running = Gauge(
            "specdec:num_requests_running", "Requests in the running batch.", m, registry=r
        )
        self.num_waiting = Gauge(
            "specdec:num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r
        )
        self.kv_usage = Gauge(
            "specdec:kv_cache_usage_perc",
            "Fraction of the running sequences' KV-cache slots in use (0 to 1).",
            m,
            registry=r,
        )
        self.ttft = Histogram(
            "specdec:time_to_first_token_seconds",
            "Time to first token.",
            m,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "specdec:time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            m, buckets=_TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "specdec:e2e_request_latency_seconds",
            "Arrival to finish.",
            m,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self._last: dict[str, int] = {}
        self._last_per_pos: list[int] = []

    def _delta(self, key: str, value: int) -> int:
        """Growth of a running total since the previous call (a reset counts from zero)."""
        last = self._last.get(key, 0)
        self._last[key] = value
        return value - last if value >= last else value

    def update(self, engine: LLMEngine) -> None:
        """Fold the engine's totals and queue sizes into the metrics (engine thread only)."""
        name = self.model_name
        st = engine.spec_stats
        self.num_drafts.labels(name).inc(self._delta("drafts", st.num_drafts))
        self.num_draft_tokens.labels(name).inc(self._delta("draft_tokens", st.num_draft_tokens))
        self.num_accepted_tokens.labels(name).inc(self._delta("accepted", st.num_accepted_tokens))
        per_pos = list(st.accepted_per_pos)
        last = self._last_per_pos if len(self._last_per_pos) <= len(per_pos) else []
        for pos, n in enumerate(per_pos):
            prev = last[pos] if pos < len(last) else 0
            if n > prev:
                self.accepted_per_pos.labels(name, str(pos)).inc(n - prev)
        self._last_per_pos = per_pos
        self.prompt_tokens.labels(name).inc(self._delta("prompt", engine.num_prompt_tokens))
        self.generation_tokens.labels(name).inc(
            self._delta("generation", engine.num_generation_tokens)
        )
        self.prefix_cache_queries.labels(name).inc(
            self._delta("prefix_queries", engine.num_prefix_cache_queries)
        )
        self.prefix_cache_hits.labels(name).inc(
            self._delta("prefix_hits", engine.num_prefix_cache_hits)
        )
        self.request_failure.labels(name).inc(self._delta("failed", engine.num_failed_requests))
        self.num_running.labels(name).set(engine.num_running)
        self.num_waiting.labels(name).set(engine.num_waiting)
        self.kv_usage.labels(name).set(engine.kv_cache_usage)

    def observe_failures(self, n: int) -> None:
        """``n`` requests failed with their whole step (the engine's own count misses them)."""
        self.request_failure.labels(self.model_name).inc(n)

    def observe_first_token(self, out: RequestOutput) -> None:
        ttft = out.metrics.time_to_first_token if out.metrics is not None else None
        if ttft is not None:
            self.ttft.labels(self.model_name).observe(ttft)

    def observe_finished(self, out: RequestOutput) -> None:
        completion = out.outputs[0]
        self.request_success.labels(self.model_name, completion.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.labels(self.model_name).observe(m.finished_time - m.arrival_time)
        n = len(completion.token_ids)
        if m.first_token_time is not None and n > 1:
            self.tpot.labels(self.model_name).observe(
                (m.finished_time - m.first_token_time) / (n - 1)
            )

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return _generate_latest(self.registry)
