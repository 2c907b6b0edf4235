"""Per-request figures where the chat apps look, and streamed token provenance.

- ``timings``: llama.cpp's server object (tools/server/server-common.cpp ``server_slot_stats``),
  on every non-streamed response and on the last stream chunk; ``draft_n`` and
  ``draft_n_accepted`` appear, as there, only when the request verified drafts.
- ``metrics.speculative_decoding``: vLLM's per-request figures (``--per-request-spec-decode-metrics
  summary``, vLLM PR 48915), beside our own ``spec_decode``.
- ``ProvenanceAligner``: cuts a choice's streamed text at token ends so that each chunk's
  ``token_provenance`` covers whole tokens and its characters add up to the chunk's text.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from specdec.outputs import RequestMetrics, TokenProvenance
from specdec.spec_decode.metrics import SpecDecodeStats


def _per_second(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0


def _per_token_ms(n: int, ms: float) -> float:
    return ms / n if n > 0 else 0.0


def timings(
    num_prompt: int,
    num_cached: int,
    num_generated: int,
    metrics: Iterable[RequestMetrics | None],
    stats: SpecDecodeStats,
) -> dict[str, Any]:
    """llama.cpp's ``timings`` for the engine requests behind one response.

    NOTE: as llama.cpp measures: the prompt phase runs from arrival to the first token (here it
    includes queueing), generation from the first token to the end, and ``predicted_n`` counts
    every generated token (the first included)."""
    known = [m for m in metrics if m is not None]
    arrival = min((m.arrival_time for m in known), default=0.0)
    firsts = [m.first_token_time for m in known if m.first_token_time is not None]
    first = min(firsts, default=None)
    end = max((m.finished_time or time.monotonic() for m in known), default=0.0)
    prompt_ms = (first - arrival) * 1e3 if first is not None else 0.0
    predicted_ms = (end - first) * 1e3 if first is not None else 0.0
    num_processed = num_prompt - num_cached
    out: dict[str, Any] = {
        "cache_n": num_cached,
        "prompt_n": num_processed,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": _per_token_ms(num_processed, prompt_ms),
        "prompt_per_second": _per_second(num_processed, prompt_ms),
        "predicted_n": num_generated,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": _per_token_ms(num_generated, predicted_ms),
        "predicted_per_second": _per_second(num_generated, predicted_ms),
    }
    if stats.num_draft_tokens > 0:
        out["draft_n"] = stats.num_draft_tokens
        out["draft_n_accepted"] = stats.num_accepted_tokens
    return out


def acceptance_histogram(stats: SpecDecodeStats, k: int) -> list[int]:
    """vLLM's: index j = verification steps that accepted exactly j drafts (j = 0..k)."""
    size = max(k, len(stats.accepted_per_pos))
    at_least = [
        stats.num_drafts,
        *stats.accepted_per_pos,
        *[0] * (size - len(stats.accepted_per_pos)),
    ]
    return [at_least[j] - at_least[j + 1] for j in range(size)] + [at_least[size]]


def vllm_spec_metrics(stats: SpecDecodeStats, k: int) -> dict[str, Any]:
    """vLLM's top-level ``metrics`` with its ``speculative_decoding`` summary."""
    return {
        "speculative_decoding": {
            "mean_acceptance_length": stats.mean_acceptance_length,
            "draft_acceptance_rate": stats.acceptance_rate,
            "acceptance_histogram": acceptance_histogram(stats, k),
            "num_spec_steps": stats.num_drafts,
            "num_accepted_draft_tokens": stats.num_accepted_tokens,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_spec_tokens": k,
        }
    }


class ProvenanceAligner:
    """One choice's stream: text is handed out up to the end of the last token whose text is
    complete, with one ``[characters, 1 if accepted draft else 0]`` per token.

    NOTE: the engine's deltas can end inside a token (a stop string's possible start is held
    back) and a token can write no text at all (the first bytes of a multi-byte character, or
    text a stop string cut): such tokens get 0 characters, so every output token is listed
    exactly once and the counts match the request's statistics."""

    def __init__(self) -> None:
        self._held = ""  # text received, not yet handed out
        self._emitted = 0  # characters handed out
        self._tokens: deque[TokenProvenance] = deque()

    def feed(self, text: str, provenance: list[TokenProvenance]) -> tuple[str, list[list[int]]]:
        """The text to send now and its tokens."""
        self._held += text
        self._tokens.extend(provenance)
        available = self._emitted + len(self._held)
        spans: list[list[int]] = []
        end = self._emitted
        while self._tokens and self._tokens[0].text_end <= available:
            token = self._tokens.popleft()
            token_end = max(end, token.text_end)
            spans.append([token_end - end, int(token.from_draft)])
            end = token_end
        cut = end - self._emitted
        out, self._held = self._held[:cut], self._held[cut:]
        self._emitted = end
        return out, spans
