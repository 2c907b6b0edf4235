"""The one interface every drafter implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from specdec.sampling_params import SamplingParams


@dataclass
class DraftRequest:
    req_id: str
    token_ids: list[int]  # prompt + output so far (the last one is not yet in the target's KV)
    max_num_drafts: int  # cap for this step (0 = do not draft)
    sampling: SamplingParams
    seed: int = 0  # the request's seed: drafts sampled for output position t use uniform(seed, t)
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt

    @property
    def next_position(self) -> int:
        """The output position of the first draft (the token after ``token_ids``)."""
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class DraftInput:
    requests: list[DraftRequest]
    hidden_states: list[torch.Tensor] | None = None  # only for drafters with needs_hidden_states


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
    """

    needs_hidden_states: bool = False
    # Proposing costs next to nothing and the drafter sizes its own drafts (prompt lookup, suffix
    # trees). The controller then only decides whether to draft (all of the cap or nothing), and
    # while it says no, the engine still asks for drafts and scores them against the tokens that
    # arrive ("shadow" drafts), so the decision stays informed at no verification cost.
    free_drafts: bool = False

    @abstractmethod
    def propose(self, inp: DraftInput) -> DraftOutput: ...

    def add_request(self, req_id: str) -> None:  # noqa: B027 (optional hook)
        """A request starts; stateful drafters set up per-request state."""

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:  # noqa: B027
        """A request ends (finished or aborted); ``token_ids`` are its final prompt + output."""

    def reset_cache(self) -> None:  # noqa: B027 (optional hook)
        """Forget what finished requests taught the drafter (running requests keep their state)."""
