"""Acceptance statistics, per request and per engine.

The one definition of the figures every report derives (README, "Acceptance figures"; vLLM's):
``num_drafts`` counts verification steps that carried drafts, ``num_accepted_tokens`` the
accepted drafts the request returned (none past a stop inside an accepted run: the speculator
observes ``min(accepted, committed)``); acceptance rate = accepted / draft tokens, mean
acceptance length = 1 + accepted / verification steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # adaptive controller: steps it decided, drafts it chose, accepted drafts it predicted
    num_decisions: int = 0
    num_chosen_drafts: int = 0
    predicted_accepted_tokens: float = 0.0
    # structured output: draft tokens the grammar forced (no model ran for them), and how many
    # of those were accepted
    num_grammar_draft_tokens: int = 0
    num_grammar_accepted_tokens: int = 0

    def observe_choice(self, k: int, predicted_accepted: float) -> None:
        self.num_decisions += 1
        self.num_chosen_drafts += k
        self.predicted_accepted_tokens += predicted_accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def observe_grammar(self, num_forced: int, num_accepted: int) -> None:
        self.num_grammar_draft_tokens += num_forced
        self.num_grammar_accepted_tokens += num_accepted

    def copy(self) -> SpecDecodeStats:
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))

    def merge(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_decisions += other.num_decisions
        self.num_chosen_drafts += other.num_chosen_drafts
        self.predicted_accepted_tokens += other.predicted_accepted_tokens
        self.num_grammar_draft_tokens += other.num_grammar_draft_tokens
        self.num_grammar_accepted_tokens += other.num_grammar_accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend(
                [0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos))
            )
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 + accepted / drafts (1.0 when nothing was drafted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance_rate_per_pos(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_chosen_k": round(self.mean_chosen_k, 4),
            "predicted_accepted_tokens": round(self.predicted_accepted_tokens, 2),
            "num_grammar_draft_tokens": self.num_grammar_draft_tokens,
            "num_grammar_accepted_tokens": self.num_grammar_accepted_tokens,
        }

    @property
    def mean_chosen_k(self) -> float:
        """Mean draft length the adaptive controller chose per step (0 when it is off)."""
        return self.num_chosen_drafts / self.num_decisions if self.num_decisions else 0.0
