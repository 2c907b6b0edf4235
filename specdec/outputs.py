"""What a request returns: vLLM-like RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.spec_decode.metrics import SpecDecodeStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None  # log p of each chosen token (raw target distribution)

    def finished(self) -> bool:
        return self.finish_reason is not None


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
