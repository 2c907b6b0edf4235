"""The one interface every drafter implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdec.spec_decode.controller import CostModel


@dataclass
class DraftRequest:
    req_id: str
    token_ids: list[int]  # prompt + output so far (the last one is not yet in the target's KV)
    max_num_drafts: int  # cap for this step (0 = do not draft)
    sampling: SamplingParams
    seed: int = 0  # the request's seed: drafts sampled for output position t use uniform(seed, t)
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt
    # drafters with hidden_layers: the target's states for positions hidden_start.. that it
    # computed since the last draft for this request, [n, H * len(hidden_layers)]; None if none.
    # They stop one short of token_ids (the last token has not been through the target yet).
    # NOTE: after a prefix-cache hit the first rows start past 0 (the cached prefix was never
    # computed); a drafter keeps what it has and drafts from that.
    hidden_states: torch.Tensor | None = None
    hidden_start: int = 0
    # a shadow draft (Proposer.free_drafts): scored against the tokens that arrive, never
    # verified, so only what costs next to nothing is worth proposing
    shadow: bool = False
    # the request's cache_salt (LLMEngine.make_request; 0 = unsalted). What a drafter learns from
    # one request and reuses for others (suffix decoding's global tree) is kept per salt.
    cache_salt: int = 0

    @property
    def next_position(self) -> int:
        """The output position of the first draft (the token after ``token_ids``)."""
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class DraftInput:
    requests: list[DraftRequest]


def accepted_prefix(drafts: list[int], arrived: list[int]) -> int:
    """How many drafts the tokens that arrived since they were proposed confirm, in order."""
    m = 0
    while m < len(drafts) and m < len(arrived) and arrived[m] == drafts[m]:
        m += 1
    return m


@dataclass
class DraftOutput:
    draft_token_ids: list[list[int]]  # per request; empty = do not speculate this step
    draft_probs: list[torch.Tensor | None] = field(
        default_factory=list
    )  # per request [k, V] or None


class Proposer(ABC):
    """Proposes draft tokens; the target verifies them.

    Drafts returned without ``q`` are point masses (n-gram, greedy model drafts): verification
    against ``p`` alone is still exact.

    Isolation: anything learnt from one request's tokens that shapes another's drafts must be
    keyed by ``DraftRequest.cache_salt`` (tenants share it only within a salt). Statistics that
    say nothing of any text (acceptance rates, timings) may be shared.
    """

    # The target states this drafter reads (see LlamaModel.forward_capture): HIDDEN_FINAL for
    # the final normed state, i for the residual stream entering layer i. Empty: none.
    hidden_layers: tuple[int, ...] = ()
    # Proposing costs next to nothing (prompt lookup, suffix trees). While the controller gives a
    # request no drafts, the engine still asks for them and scores them against the tokens that
    # arrive ("shadow" drafts), so its rates stay current at no verification cost, and a request
    # running alone is not probed.
    free_drafts: bool = False
    # Drafts end where the drafter's own confidence does (suffix decoding: its match length and
    # probability floor), so their quality varies draft by draft and a request's running rates
    # predict them poorly. For a request running alone the controller then drafts whenever its
    # guard allows, instead of gating on those rates (which, measured, turned off ~30% of suffix
    # decoding's steps and cost it ~1.6%, 2026-11-25). Only with free_drafts.
    confident_drafts: bool = False
    # A cap of the drafter's own above num_speculative_tokens (hybrid: suffix decoding's, while
    # num_speculative_tokens bounds the head). None: num_speculative_tokens.
    max_drafts: int | None = None
    # The engine's learnt cost of a step (controller.CostModel, updated as steps are timed), for a
    # drafter that weighs its own options (hybrid); None without the adaptive controller.
    cost_model: CostModel | None = None

    @property
    def wants_hidden(self) -> bool:
        """False once the drafter no longer reads ``hidden_layers`` (hybrid after judging its
        head): the runner then stops returning them."""
        return True

    @abstractmethod
    def propose(self, inp: DraftInput) -> DraftOutput: ...

    def add_request(self, req_id: str) -> None:  # noqa: B027 (optional hook)
        """A request starts; stateful drafters set up per-request state."""

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:  # noqa: B027
        """A request ends (finished or aborted); ``token_ids`` are its final prompt + output."""

    def reset_cache(self) -> None:  # noqa: B027 (optional hook)
        """Forget what finished requests taught the drafter (running requests keep their state)."""

    def measure_cost(self) -> tuple[float, float] | None:
        """Timed once at start-up, before any request: (milliseconds to draft one token for one
        request, milliseconds per token a request's first draft call catches up on). None: the
        controller learns both from use (drafters that cost next to nothing)."""
        return None
