"""Prometheus metrics for the server, named like vLLM's: ``specdec:*`` and, as aliases that
dashboards built for vLLM find, ``vllm:*`` (``prefixes``; both by default).

Each ``EngineMetrics`` owns its own ``CollectorRegistry`` so several servers can live in one
process (tests). Counters are fed by diffing the engine's running totals after each step, so the
engine itself knows nothing about Prometheus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest as _generate_latest

if TYPE_CHECKING:
    from specdec.engine.llm_engine import LLMEngine
    from specdec.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
METRIC_PREFIXES = ("specdec", "vllm")  # ours, and vLLM's for dashboards built for it
PREFIX_CHOICES = {"both": METRIC_PREFIXES, "specdec": ("specdec",), "vllm": ("vllm",)}


class _Fanout:
    """One metric under several prefixes: ``labels`` / ``inc`` / ``set`` / ``observe`` reach all."""

    def __init__(self, metrics: list[Any]) -> None:
        self.metrics = metrics

    def labels(self, *values: str) -> _Fanout:
        return _Fanout([m.labels(*values) for m in self.metrics])

    def inc(self, amount: float = 1.0) -> None:
        for m in self.metrics:
            m.inc(amount)

    def set(self, value: float) -> None:
        for m in self.metrics:
            m.set(value)

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)


class EngineMetrics:
    """The server's metrics; ``update`` and ``observe_*`` are called from the engine thread."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        prefixes: tuple[str, ...] = METRIC_PREFIXES,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.prefixes = tuple(prefixes)
        # NOTE: registered in /metrics' order: speculative decoding, tokens and requests,
        # queues, latencies
        self._add_spec_decode_metrics()
        self._add_token_metrics()
        self._add_queue_metrics()
        self._add_latency_metrics()
        self._last: dict[str, int] = {}
        self._last_per_pos: list[int] = []

    def _metric(
        self, kind: type, name: str, doc: str, labels: list[str] | None = None, **kw: Any
    ) -> _Fanout:
        """One metric under every prefix, labelled by model name unless ``labels`` says."""
        labels = labels or ["model_name"]
        return _Fanout(
            [kind(f"{p}:{name}", doc, labels, registry=self.registry, **kw) for p in self.prefixes]
        )

    def _add_spec_decode_metrics(self) -> None:
        metric = self._metric
        self.num_drafts = metric(
            Counter, "spec_decode_num_drafts", "Verification steps that carried drafts."
        )
        self.num_draft_tokens = metric(
            Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed."
        )
        self.num_accepted_tokens = metric(
            Counter,
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted and returned (none past a stop inside an accepted run).",
        )
        self.num_grammar_draft_tokens = metric(
            Counter, "spec_decode_num_grammar_draft_tokens",
            "Draft tokens forced by a structured-output grammar (no model ran for them).",
        )  # fmt: skip
        self.num_grammar_accepted_tokens = metric(
            Counter, "spec_decode_num_grammar_accepted_tokens",
            "Grammar-forced draft tokens accepted.",
        )  # fmt: skip
        self.num_drafter_failures = metric(
            Counter, "spec_decode_num_drafter_failures",
            "Drafter faults: requests whose drafting was switched off after the drafter raised "
            "(plain decoding went on), and request hooks that raised.",
        )  # fmt: skip
        self.accepted_per_pos = metric(
            Counter, "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position.", ["model_name", "position"],
        )  # fmt: skip

    def _add_token_metrics(self) -> None:
        """Tokens, the prefix cache, finished and failed requests."""
        metric = self._metric
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = metric(
            Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = metric(
            Counter, "prefix_cache_hits", "Prompt tokens served from the prefix cache."
        )
        self.request_success = metric(
            Counter, "request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
        )  # fmt: skip
        self.request_failure = metric(
            Counter, "request_failure",
            "Requests the engine failed (finish_reason error, or a failed step); others went on.",
        )  # fmt: skip

    def _add_queue_metrics(self) -> None:
        metric = self._metric
        self.num_running = metric(Gauge, "num_requests_running", "Requests in the running batch.")
        self.num_waiting = metric(
            Gauge, "num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_usage = metric(
            Gauge, "kv_cache_usage_perc",
            "Fraction of the running sequences' KV-cache slots in use (0 to 1).",
        )  # fmt: skip

    def _add_latency_metrics(self) -> None:
        metric = self._metric
        self.ttft = metric(
            Histogram, "time_to_first_token_seconds", "Time to first token.",
            buckets=_TTFT_BUCKETS,
        )  # fmt: skip
        self.tpot = metric(
            Histogram, "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.", buckets=_TPOT_BUCKETS,
        )  # fmt: skip
        self.e2e = metric(
            Histogram, "e2e_request_latency_seconds", "Arrival to finish.", buckets=_E2E_BUCKETS
        )

    def _delta(self, key: str, value: int) -> int:
        """Growth of a running total since the previous call (a reset counts from zero)."""
        last = self._last.get(key, 0)
        self._last[key] = value
        return value - last if value >= last else value

    def update(self, engine: LLMEngine) -> None:
        """Fold the engine's totals and queue sizes into the metrics (engine thread only)."""
        name = self.model_name
        st = engine.spec_stats
        totals = (
            (self.num_drafts, "drafts", st.num_drafts),
            (self.num_draft_tokens, "draft_tokens", st.num_draft_tokens),
            (self.num_accepted_tokens, "accepted", st.num_accepted_tokens),
            (self.num_grammar_draft_tokens, "grammar_drafts", st.num_grammar_draft_tokens),
            (self.num_grammar_accepted_tokens, "grammar_accepted", st.num_grammar_accepted_tokens),
            (self.num_drafter_failures, "drafter_failures", engine.num_drafter_failures),
            (self.prompt_tokens, "prompt", engine.num_prompt_tokens),
            (self.generation_tokens, "generation", engine.num_generation_tokens),
            (self.prefix_cache_queries, "prefix_queries", engine.num_prefix_cache_queries),
            (self.prefix_cache_hits, "prefix_hits", engine.num_prefix_cache_hits),
            (self.request_failure, "failed", engine.num_failed_requests),
        )
        for metric, key, total in totals:
            metric.labels(name).inc(self._delta(key, total))
        per_pos = list(st.accepted_per_pos)
        last = self._last_per_pos if len(self._last_per_pos) <= len(per_pos) else []
        for pos, n in enumerate(per_pos):
            prev = last[pos] if pos < len(last) else 0
            if n > prev:
                self.accepted_per_pos.labels(name, str(pos)).inc(n - prev)
        self._last_per_pos = per_pos
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
