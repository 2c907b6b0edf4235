"""What a request returns: vLLM-like RequestOutput / CompletionOutput."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from specdec.spec_decode.metrics import SpecDecodeStats


@dataclass
class Logprob:
    """vLLM's: a token's log-probability under the raw target distribution, its rank (1 = the
    most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, the chosen (or prompt) token and the top-N (vLLM's shape).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    # with SamplingParams.logprobs: per output token, the chosen token and the top-N
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None  # sum of the chosen tokens' log-probabilities

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenProvenance:
    """One output token: the end of its text in the output text (characters), and whether it
    was an accepted draft token (False: the target sampled it: first, recovered or bonus)."""

    text_end: int
    from_draft: bool


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_decode_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    delta_text: str = ""  # text new since the previous output of this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why the request failed (finish_reason "error"); others go on
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then each one's
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # per token of delta_token_ids: where its text ends in the output text, and whether it was an
    # accepted draft (False: the target sampled it). A token's text may still be held back.
    delta_provenance: list[TokenProvenance] = field(default_factory=list)


def merge_samples(
    request_id: str, outs: list[RequestOutput], n: int, keep_logprobs: bool
) -> RequestOutput:
    """One RequestOutput for the samples of one prompt (``n`` / ``best_of``): with more samples
    than ``n``, the ``n`` of highest cumulative log-probability (vLLM's best_of), re-indexed in
    that order; acceptance statistics over all of them."""
    ranked = outs
    if len(outs) > n:
        ranked = sorted(outs, key=lambda o: -(o.outputs[0].cumulative_logprob or -math.inf))
    completions = []
    for i, o in enumerate(ranked[:n]):
        c = o.outputs[0]
        completions.append(replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None))
    stats = SpecDecodeStats()
    for o in outs:
        stats.merge(o.spec_decode_stats)
    first = outs[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=all(o.finished for o in outs),
        spec_decode_stats=stats,
        metrics=first.metrics,
        num_cached_tokens=first.num_cached_tokens,
        error=next((o.error for o in outs if o.error), None),
        prompt_logprobs=first.prompt_logprobs,
    )
