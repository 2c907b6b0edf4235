"""Adaptive speculation: choose each request's draft length every step.

Per request, the chance that draft i survives given that draft i-1 did is tracked online (an
exponentially weighted estimate per position). The expected tokens of a step with k drafts are
1 + sum_{i<=k} prod_{j<=i} a_j (Leviathan et al.'s (1 - a^(k+1)) / (1 - a) with per-position
rates). Each step picks the k's that maximise expected tokens per second of the whole batch,
against the measured cost of verifying n tokens and of drafting one token. k = 0 is allowed, so
a drafter that does not pay is switched off; while off, it is probed with one draft after a
back-off that doubles after every probe that does not switch it back on (4, 8, ... 64 steps).
Costs are the start-up measurement of the forward plus, learnt online, the per-step overhead
outside it and the time per drafted token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PRIOR = 0.6  # a first draft is accepted more often than not for copy-heavy drafters
ALPHA = 0.4  # weight of the newest observation
MIN_EXTRA_COST = 0.03  # each verified draft costs at least this fraction of a 1-token step
FIRST_BACKOFF, MAX_BACKOFF = 4, 64


def expected_tokens(rates: list[float], k: int) -> float:
    """1 + the expected number of accepted drafts when k are verified."""
    total, survive = 1.0, 1.0
    for a in rates[:k]:
        survive *= a
        total += survive
    return total


@dataclass
class CostModel:
    """Milliseconds of one target forward over n tokens, and of drafting one token."""

    verify_ms: list[float]  # index n - 1
    draft_ms_per_token: float = 0.0
    overhead_ms: float = 0.0  # per step, outside the forward: scheduling, sampling, commit

    def verify(self, n: int) -> float:
        # NOTE: sampling, bookkeeping and noise make no extra row free, whatever the timing says.
        floor = self.verify_ms[0] * (1.0 + MIN_EXTRA_COST * (n - 1))
        if n <= len(self.verify_ms):
            return max(self.verify_ms[n - 1], floor)
        slope = (self.verify_ms[-1] - self.verify_ms[0]) / max(1, len(self.verify_ms) - 1)
        return max(self.verify_ms[-1] + slope * (n - len(self.verify_ms)), floor)

    def step_ms(self, num_tokens: int, num_drafts: int) -> float:
        return self.verify(num_tokens) + self.overhead_ms + self.draft_ms_per_token * num_drafts


def choose_num_drafts(rates: list[list[float]], caps: list[int], cost: CostModel) -> list[int]:
    """Draft lengths maximising expected tokens per millisecond for a batch.

    One request: exhaustive over 0..cap. Several: greedy, one draft at a time to whichever request
    gains most, while the batch's throughput still improves.
    """

    def throughput(ks: list[int]) -> float:
        tokens = sum(expected_tokens(r, k) for r, k in zip(rates, ks))
        return tokens / cost.step_ms(len(ks) + sum(ks), sum(ks))

    if len(rates) == 1:
        options = range(caps[0] + 1)
        return [max(options, key=lambda k: (throughput([k]), -k))]
    ks = [0] * len(rates)
    best = throughput(ks)
    while True:
        trials = []
        for i, cap in enumerate(caps):
            if ks[i] < cap:
                ks[i] += 1
                trials.append((throughput(ks), i))
                ks[i] -= 1
        if not trials:
            return ks
        value, i = max(trials)
        if value <= best:
            return ks
        best = value
        ks[i] += 1


@dataclass
class _RequestState:
    rates: list[float]
    num_observed: int = 0  # positions 0 .. num_observed-1 have been tested at least once
    predicted: float = 0.0  # expected accepted drafts of the pending choice
    off_steps: int = 0  # steps in a row without drafts
    backoff: int = FIRST_BACKOFF
    probing: bool = False


def _extrapolated(state: _RequestState) -> list[float]:
    """Positions never tested take the rate of the deepest tested one (else the prior).

    NOTE: without this, positions beyond the k in use keep the prior forever and a drafter that is
    right 95% of the time never gets a longer k.
    """
    n = state.num_observed
    if n == 0 or n >= len(state.rates):
        return state.rates
    return state.rates[:n] + [state.rates[n - 1]] * (len(state.rates) - n)


@dataclass
class SpecController:
    max_k: int
    cost: CostModel
    states: dict[str, _RequestState] = field(default_factory=dict)

    def _state(self, req_id: str) -> _RequestState:
        if req_id not in self.states:
            self.states[req_id] = _RequestState([PRIOR] * self.max_k)
        return self.states[req_id]

    def choose(self, req_ids: list[str], caps: list[int]) -> list[int]:
        states = [self._state(r) for r in req_ids]
        ks = choose_num_drafts([_extrapolated(s) for s in states], caps, self.cost)
        for i, s in enumerate(states):
            s.probing = False
            if ks[i] == 0 and caps[i] > 0:
                s.off_steps += 1
                if s.off_steps >= s.backoff:  # explore: one draft, to see if things changed
                    ks[i], s.probing, s.off_steps = 1, True, 0
                    s.backoff = min(2 * s.backoff, MAX_BACKOFF)
            elif ks[i] > 0:  # drafting pays again: probe quickly next time it stops paying
                s.off_steps, s.backoff = 0, FIRST_BACKOFF
            s.predicted = expected_tokens(s.rates, ks[i]) - 1.0
        return ks

    def predicted(self, req_id: str) -> float:
        return self._state(req_id).predicted

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Position i was tested only if every earlier draft survived."""
        state = self._state(req_id)
        rates = state.rates
        tested = min(num_drafts, num_accepted + 1)
        for i in range(tested):
            if i >= state.num_observed:  # first observation of this position
                rates[i] = _extrapolated(state)[i]
            hit = 1.0 if i < num_accepted else 0.0
            rates[i] += ALPHA * (hit - rates[i])
        state.num_observed = max(state.num_observed, tested)

    def observe_draft_time(self, seconds: float, num_drafted: int) -> None:
        if num_drafted > 0:
            per_token = 1000.0 * seconds / num_drafted
            self.cost.draft_ms_per_token += ALPHA * (per_token - self.cost.draft_ms_per_token)

    def observe_step(self, seconds: float, num_tokens: int) -> None:
        """A whole engine step (forward, verification, commit; drafting excluded) took `seconds`."""
        extra = 1000.0 * seconds - self.cost.verify(num_tokens)
        self.cost.overhead_ms += ALPHA * (max(0.0, extra) - self.cost.overhead_ms)

    def remove_request(self, req_id: str) -> None:
        self.states.pop(req_id, None)


def measure_verify_cost(
    model, kv, slot: int, max_n: int, context: int = 64, repeats: int = 3
) -> CostModel:
    """Time one target forward over n = 1..max_n new tokens after `context` cached tokens."""
    from specdec.model.llama import SeqBatch

    device = model.device
    ids = torch.zeros(context + max_n, dtype=torch.long, device=device)
    model.forward(
        ids[:context], torch.arange(context, device=device), SeqBatch([slot], [0], [context]), kv
    )
    timings: list[list[float]] = [[] for _ in range(max_n)]
    for _ in range(repeats):
        for n in range(1, max_n + 1):
            pos = torch.arange(context, context + n, device=device)
            start = time.perf_counter()
            hidden = model.forward(ids[:n], pos, SeqBatch([slot], [context], [n]), kv)
            model.compute_logits(hidden)
            timings[n - 1].append(1000.0 * (time.perf_counter() - start))
    medians = [sorted(t)[len(t) // 2] for t in timings]
    # NOTE: costs never fall with n (noise can make them): keep the curve monotone.
    for i in range(1, len(medians)):
        medians[i] = max(medians[i], medians[i - 1])
    return CostModel(medians)
