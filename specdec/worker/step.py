"""What the scheduler hands the runner each step, and what the runner hands back per request.

``SchedulerOutput`` is self-contained: the runner reads it and never ``Request``. The engine's
scheduler (engine/scheduler.py) builds it; the executor passes it to every rank's runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.sample.logprobs import LogitsAdjust
from specdec.sample.rejection_sampler import PenaltyState, VerifyResult
from specdec.sample.sampler import NonFiniteLogits
from specdec.sampling_params import SamplingParams
from specdec.structured.grammar import TokenMask


@dataclass
class ScheduledRequest:
    """What the runner needs of one request this step (it never reads ``Request``)."""

    req_id: str
    slot: int
    start_pos: int  # position of the first fed token (= tokens already in the KV cache)
    token_ids: list[int]  # fed this step: missing real tokens, then drafts
    num_drafts: int
    needs_logits: bool  # the chunk reaches the end of the known tokens: sample / verify
    sampling: SamplingParams
    seed: int
    output_pos: int  # output position of the first token sampled this step
    penalty: PenaltyState | None = None
    draft_probs: torch.Tensor | None = None  # [num_drafts, V] or None (point-mass drafts)
    adjust: LogitsAdjust | None = None  # logit_bias / bad_words (with the output's tail)
    # prompt_logprobs: top-N, and the prompt token each fed prompt row predicts (rows of the fed
    # prompt positions that have a next prompt token, in order)
    prompt_logprobs: int | None = None
    prompt_next_token_ids: list[int] = field(default_factory=list)
    mask: TokenMask | None = None  # structured output: the tokens each verified row may take
    num_forced_drafts: int = 0  # the last drafts, forced by the grammar
    # a shared prefix (kv_cache/pool.py): the slot holding this sequence's first prefix_len
    # positions (-1, 0: none)
    prefix_slot: int = -1
    prefix_len: int = 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts :]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass
class RequestFailure:
    """The request cannot go on: ``message`` (fixed text, shown to the client) says why;
    ``detail`` (one escaped line) goes to the log only."""

    message: str
    detail: str = ""


def failure(stage: str, e: BaseException) -> RequestFailure:
    """A fixed message per stage for the client; the exception's type and the first line of its
    text for the log. NOTE: an exception's text may hold client text (a sampler's KeyError) or
    internal state (a grammar engine's dump): never in the response."""
    first = str(e).partition("\n")[0]
    known = f": {e}" if isinstance(e, NonFiniteLogits) else ""  # fixed text of the engine's own
    return RequestFailure(f"{stage} failed{known}", f"{type(e).__name__}: {ascii(first[:200])}")


StepResult = VerifyResult | RequestFailure | None  # None: a prefill chunk, nothing sampled
