"""The engine's per-step message about one request: what the output processor builds from.

vLLM v1's ``EngineCoreOutput``: the scheduler's live ``Request`` stays inside the engine; each
step hands the output processor, per changed request, only what that step added (new token ids,
their log-probabilities and provenance), the text so far, the finish and the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.engine.request import Request
from specdec.outputs import RequestMetrics
from specdec.sample.logprobs import TokenLogprobs
from specdec.spec_decode.metrics import SpecDecodeStats


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step (or from its abort)."""

    req_id: str
    new_token_ids: list[int]
    output_text: str  # the whole output text so far (after a stop-string cut)
    new_char_ends: list[int]  # per new token: where its text ends, before any stop-string cut
    new_from_draft: list[bool]  # per new token: an accepted draft (else the target sampled it)
    new_logprobs: list[TokenLogprobs]  # per new token, when the request asked for logprobs
    spec_stats: SpecDecodeStats  # a copy: the request's acceptance figures so far
    metrics: RequestMetrics
    num_cached_tokens: int
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


def take_core_output(req: Request) -> EngineCoreOutput:
    """The request's news since the last message (its report cursors move on)."""
    start, lp_start = req.num_reported_tokens, req.num_reported_logprobs
    req.num_reported_tokens = len(req.output_token_ids)
    req.num_reported_logprobs = len(req.output_logprobs)
    return EngineCoreOutput(
        req_id=req.req_id,
        new_token_ids=req.output_token_ids[start:],
        output_text=req.output_text,
        new_char_ends=req.output_char_ends[start:],
        new_from_draft=req.output_from_draft[start:],
        new_logprobs=req.output_logprobs[lp_start:],
        spec_stats=req.spec_stats.copy(),
        metrics=req.metrics,
        num_cached_tokens=req.num_cached_tokens,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        error=req.error,
    )
