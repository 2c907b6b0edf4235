"""``LLM.get_metrics()``: the Prometheus registry read back as plain dataclasses, in the shapes of
vLLM's ``vllm.v1.metrics.reader`` (``Counter``, ``Gauge``, ``Histogram``, ``Vector``), the
``vllm:``-named metrics only, as vLLM returns them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

VLLM_PREFIX = "vllm:"
# vLLM's one counter read back as a list: accepted draft tokens by draft position
_VECTOR_METRICS = {"vllm:spec_decode_num_accepted_tokens_per_pos": "position"}


@dataclass
class Metric:
    """One metric under one set of labels (a name may come under several label sets)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A total that only grows."""

    value: int


@dataclass
class Vector(Metric):
    """Counters indexed by position (``vllm:spec_decode_num_accepted_tokens_per_pos``)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations by bucket: ``buckets`` maps each upper bound (as Prometheus writes it,
    ``"+Inf"`` included) to the observations at or below it; ``count`` is the ``"+Inf"``
    bucket's, ``sum`` the observations' total."""

    count: int
    sum: float
    buckets: dict[str, int]


def _key(labels: dict[str, str], drop: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def snapshot(registry: CollectorRegistry, prefix: str = VLLM_PREFIX) -> list[Metric]:
    """Every metric of ``registry`` whose name starts with ``prefix``, one per label set."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        samples = family.samples
        if family.name in _VECTOR_METRICS:
            out.extend(_vectors(family.name, samples, _VECTOR_METRICS[family.name]))
        elif family.type == "counter":
            out.extend(
                Counter(family.name, dict(s.labels), int(s.value))
                for s in samples
                if s.name.endswith("_total")
            )
        elif family.type == "gauge":
            out.extend(Gauge(family.name, dict(s.labels), float(s.value)) for s in samples)
        elif family.type == "histogram":
            out.extend(_histograms(family.name, samples))
    return out


def _vectors(name: str, samples: Iterable, index: str) -> list[Vector]:
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in samples:
        if s.name.endswith("_total"):
            by_labels.setdefault(_key(s.labels, index), {})[int(s.labels[index])] = int(s.value)
    vectors = []
    for key, counts in by_labels.items():
        values = [0] * (max(counts) + 1)
        for pos, n in counts.items():
            values[pos] = n
        vectors.append(Vector(name, dict(key), values))
    return vectors


def _histograms(name: str, samples: Iterable) -> list[Histogram]:
    by_labels: dict[tuple, Histogram] = {}
    for s in samples:
        key = _key(s.labels, "le")
        h = by_labels.setdefault(key, Histogram(name, dict(key), 0, 0.0, {}))
        if s.name.endswith("_bucket"):
            h.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            h.count = int(s.value)
        elif s.name.endswith("_sum"):
            h.sum = float(s.value)
    return list(by_labels.values())
