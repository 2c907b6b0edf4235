"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.outputs import RequestMetrics
from specdec.sample.logprobs import LogitsAdjust, TokenLogprobs
from specdec.sample.rejection_sampler import PenaltyState
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.metrics import SpecDecodeStats
from specdec.structured.grammar import Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    seed: int = 0  # keys every random draw of this request (specdec.sample.random)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1..P-1
    logits_adjust: LogitsAdjust | None = None  # logit_bias / bad_words
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in the target cache
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # drafts proposed for the next step (the scheduler hands them to the runner once)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [k, V] or None (point-mass drafts)
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    output_text: str = ""  # text after stop-string truncation
    # of output_token_ids / output_logprobs: how many the output processor was sent
    num_reported_tokens: int = 0
    num_reported_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    penalty: PenaltyState | None = None
    error: str | None = None  # set when the request failed (finish_reason "error")
    cache_salt: int = 0  # prefixes are shared only between requests of the same salt
    grammar: Grammar | None = None  # structured output: follows the committed tokens
    num_forced_drafts: int = 0  # of draft_token_ids, the last ones the grammar forced
    # per output token: where its text ends in the output text before any stop-string cut, and
    # whether it was an accepted draft (else the target sampled it): streamed provenance
    output_char_ends: list[int] = field(default_factory=list)
    output_from_draft: list[bool] = field(default_factory=list)
    num_step_committed: int = 0  # tokens the last verification step appended (stops cut a run)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int) -> list[int]:
        """all_token_ids[start:] without building the whole list (the decode hot path)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token is missing from the KV cache."""
        return self.num_tokens - self.num_computed_tokens > 1 or not self.output_token_ids
