"""Adaptive speculation: choose each request's draft length every step.

Decision. Per request, the chance that draft i survives given that draft i-1 did is tracked online
(an exponentially weighted estimate per position; a new request starts from the engine's running
average). The expected tokens of a step with k drafts are 1 + sum_{i<=k} prod_{j<=i} a_j
(Leviathan et al.'s (1 - a^(k+1)) / (1 - a) with per-position rates). Each step picks the k's that
maximise expected tokens per millisecond of the whole batch under CostModel: the start-up
measured forward over n tokens plus, learnt from real cycles, a signed per-step offset (start-up
timings run up to 40% high), the extra a step with drafts costs per number of tokens verified
(the curve's error at that n, what drafting does to the next forward), the time per draft, and,
for a request the drafter has fallen behind on, its catch-up spread over CATCH_UP_HORIZON steps.
Each request's rows are priced at its own context: the start-up measurement also times 1 and
several rows after 1,024 cached tokens, and what a token of context adds to a request's first row
and to each further row scales its rows (a verify row at 2,000 tokens cost 2.3x one at 200 on an
AVX2 machine); the guard compares cycles net of the context cost a plain step would have.
On a mixture of experts a step's cost also grows with the distinct experts its rows touch: the
start-up measurement times the grouped experts over rows routed alike and routed apart
(``CostModel.expert_ms``), the speculator predicts each request's spread from the routers of its
accepted rows (``moe.ExpertSpread``), and each candidate k is priced by the experts its rows
would touch; there, confident drafters get the priced k, not their cap.

Accounting. Time is measured per cycle, from one draft call (or the decision not to draft) to the
next: the drafting, then the step that verifies those drafts, with scheduling, sampling, commit
and the caller's time between steps. A model drafter that did not draft in the previous cycle
first catches up on every token produced meanwhile, the whole prompt on a request's first draft:
on SmolLM2-135M a layer_skip probe after 64 steps off took 63 ms, six plain steps, and was booked
as a cost per draft (120 ms), hiding what a steady draft costs (10 ms). So steady calls (every
drafting request drafted in the previous cycle too) teach the time per draft, the others the time
per token caught up on.

Exploration. k = 0 switches a request's drafter off; while off it is probed with one draft after a
back-off that doubles after every probe that does not switch it back on (4, 8, ... 64 steps). A
probe is made only if drafting could pay were every draft accepted, and only while the measured
cost of probes beyond plain decoding, plus this probe's predicted cost (catch-up included), stays
within EXPLORE_BUDGET of all measured time. NOTE: waiting longer does not make a model drafter's
probe cheaper (it has more to catch up on), so without the budget probes cost it 10-15%.

Drafters that cost next to nothing to ask (Proposer.free_drafts: n-gram, suffix) are not probed
for a request running alone: whenever one of their requests gets no drafts, the engine still asks
for them and scores them against the tokens that arrive, so the rates stay current. Their k is
priced like any drafter's. NOTE: until 2026-11-27 a lone request got the whole cap whenever some
k paid ("all or nothing", on the view that such drafters stop where their match ends); prompt
lookup does not (it returns the k tokens after its match), and on an AVX2 machine, where each
verified row costs ~0.2 of a one-row step, n-gram then verified ~5 drafts for ~0.7 accepted: on
held-out chat 1.00x plain against 1.13x priced, on code edits 1.26x against 1.31x (paired, quiet,
one process). (All or nothing came in with the shadow drafts, e085483: per-position pricing had
then had drafting off for whole categories, mt_bench and gsm8k, where a fixed k gained 1.3-1.6x;
the shadow drafts keep the rates current now. Those categories were not measured again.)
Drafters whose drafts end where their own confidence does
(Proposer.confident_drafts: suffix decoding, hybrid) are not gated by the rates at all for a
request alone, only by the guard: a suffix draft from a 12-token match survives ~0.97 a token and
one from a 1-token match ~0.25, so one request's running rates mostly reflect which kind came
last. Gating on them turned suffix decoding off for ~30% of its steps and cost it ~1.6% (2-core Xeon, 2026-11-25).

Guard. Whatever the model says, the realised milliseconds per generated token of the whole batch
are tracked per batch size, for cycles that drafted by choice and for cycles that drafted nothing
(probes count in neither). Once drafting has GUARD_MIN_SAMPLES cycles and is slower per token than
not drafting by more than GUARD_MARGIN, drafting is off for every request for a back-off (16, 32,
... 256 steps; back to 16 once drafting is measured to pay), after which its samples start afresh.
Until there are GUARD_MIN_SAMPLES plain cycles, the start-up measurement of a plain step stands in.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PRIOR = 0.6  # a first draft is accepted more often than not for copy-heavy drafters
ALPHA = 0.4  # weight of the newest observation
PRIOR_ALPHA = 0.1  # weight of an observation in the rates a new request starts from
MIN_EXTRA_COST = 0.03  # each verified draft costs at least this fraction of a 1-token step
FIRST_BACKOFF, MAX_BACKOFF = 4, 64
CATCH_UP_HORIZON = 64  # steps a catch-up is spread over when the cost model weighs switching on
MIN_CATCH_UP = 4  # tokens behind, to learn what catching up costs per token
EXPLORE_BUDGET = 0.01  # probes may cost this fraction of the measured time beyond plain decoding
# a probe only where every draft accepted would beat plain by this much: at the margin, acceptance
# that is never perfect and a model drafter's catch-ups make drafting a loss
PROBE_MIN_GAIN = 0.1
GUARD_MIN_SAMPLES = 16  # cycles of each kind before the guard judges
GUARD_ALPHA = 0.05  # weight of the newest cycle (a plain mean over the first 20)
GUARD_MARGIN = 0.03  # drafting must be this much slower per token to be switched off
GUARD_FIRST_BACKOFF, GUARD_MAX_BACKOFF = 16, 256
OVERHEAD_WINDOW = 32  # plain cycles whose median is the per-step overhead


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
    overhead_ms: float = 0.0  # per step, outside the forward; negative when verify_ms ran high
    # per number of tokens verified, what a step with drafts costs beyond verify(n) + overhead_ms
    # (and the draft calls): the curve's error at n, what drafting does to the next forward
    draft_step_extra_ms: dict[int, float] = field(default_factory=dict)
    catch_up_ms_per_token: float = 0.0  # per token a drafter that did not draft must catch up on
    # Context: verify_ms was measured after context_base cached tokens; each token of context
    # beyond it costs a request's first row ctx_ms_first and each further row of it ctx_ms_row
    # (attention reads the cache once per row, or once for all rows: measured, not assumed)
    context_base: int = 0
    ctx_ms_first: float = 0.0
    ctx_ms_row: float = 0.0
    # Mixture of experts: what one more distinct expert per MoE layer costs a step (all layers
    # together), beyond the curve, whose rows touched curve_experts per layer (0: a dense model)
    expert_ms: float = 0.0
    curve_experts: float = 0.0
    num_experts: int = 0
    _extra_keys: list[int] = field(default_factory=list, repr=False)  # sorted draft_step_extra_ms

    def verify(self, n: int) -> float:
        # NOTE: sampling, bookkeeping and noise make no extra row free, whatever the timing says.
        floor = self.verify_ms[0] * (1.0 + MIN_EXTRA_COST * (n - 1))
        if n <= len(self.verify_ms):
            return max(self.verify_ms[n - 1], floor)
        slope = (self.verify_ms[-1] - self.verify_ms[0]) / max(1, len(self.verify_ms) - 1)
        return max(self.verify_ms[-1] + slope * (n - len(self.verify_ms)), floor)

    def step_ms(self, num_tokens: int, num_drafts: int, draft_ms: float | None = None) -> float:
        """draft_ms: what drafting them costs, when known (else the learnt time per draft)."""
        plain = self.verify(num_tokens - num_drafts) + self.overhead_ms
        if not num_drafts:
            return max(plain, 1e-3)
        if draft_ms is None:
            draft_ms = self.draft_ms_per_token * num_drafts
        ms = (
            self.verify(num_tokens)
            + self.overhead_ms
            + self.draft_step_extra(num_tokens)
            + draft_ms
        )
        # NOTE: a learnt extra is noisy and can be negative; on a 1 ms step it made drafts cheaper
        # than none, so drafts that never survive kept being chosen. Drafts never make a step
        # cheaper than the same step without them.
        floor = plain + MIN_EXTRA_COST * self.verify_ms[0] * num_drafts
        return max(ms, floor, 1e-3)

    def context_ms(self, context: int, rows: int) -> float:
        """What ``rows`` rows of one request cost beyond the curve at ``context`` cached tokens."""
        excess = context - self.context_base
        if excess <= 0 or rows <= 0:
            return 0.0
        return excess * (self.ctx_ms_first + self.ctx_ms_row * (rows - 1))

    def experts_ms(self, distinct: float) -> float:
        """What a step whose rows touch ``distinct`` experts per MoE layer costs beyond the curve."""
        if not self.expert_ms:
            return 0.0
        return self.expert_ms * (min(distinct, self.num_experts) - self.curve_experts)

    @property
    def prices_experts(self) -> bool:
        return self.expert_ms > 0.0

    def draft_step_extra(self, n: int) -> float:
        """The learnt extra at n, else at the nearest n learnt below (above), else 0."""
        known = self.draft_step_extra_ms
        if not known:
            return 0.0
        if len(self._extra_keys) != len(known):  # entries are only ever added
            self._extra_keys = sorted(known)
        i = bisect.bisect_right(self._extra_keys, n)
        return known[self._extra_keys[i - 1 if i else 0]]


def choose_num_drafts(
    rates: list[list[float]],
    caps: list[int],
    cost: CostModel,
    switch_on_ms: list[float] | None = None,
    contexts: list[int] | None = None,
    spreads: list[list[float]] | None = None,
) -> list[int]:
    """Draft lengths maximising expected tokens per millisecond for a batch.

    switch_on_ms: per request, what drafting at all costs it this step (a catch-up, spread out).
    contexts: per request, its cached tokens (prompt + output): each row verified at a long
    context costs its attention over it (``CostModel.context_ms``).
    spreads: per request, the distinct experts per MoE layer its 1, 2, ... cap + 1 rows are
    predicted to touch (``moe.ExpertSpread``), priced by ``CostModel.experts_ms``; a batch's
    are summed (an upper bound: requests share experts too).
    One request: exhaustive over 0..cap. Several: greedy, one draft at a time to whichever request
    gains most, while the batch's throughput still improves.
    """
    switch_on_ms = switch_on_ms or [0.0] * len(rates)
    contexts = contexts or [0] * len(rates)
    if spreads is not None:
        caps = [min(cap, len(sp) - 1) for cap, sp in zip(caps, spreads)]
    else:
        spreads = [[cost.curve_experts] * (cap + 1) for cap in caps]
    if len(rates) == 1:  # exhaustive, the expected tokens summed as k grows (O(cap))
        rate, switch, ctx, spread = rates[0], switch_on_ms[0], contexts[0], spreads[0]
        best_k = 0
        best = 1.0 / (cost.step_ms(1, 0) + cost.context_ms(ctx, 1) + cost.experts_ms(spread[0]))
        tokens = survive = 1.0
        for k in range(1, min(caps[0], len(rate)) + 1):
            survive *= rate[k - 1]
            tokens += survive
            ms = cost.step_ms(1 + k, k) + switch + cost.context_ms(ctx, 1 + k)
            value = tokens / (ms + cost.experts_ms(spread[k]))
            if value > best:  # ties: the smaller k
                best_k, best = k, value
        return [best_k]
    return _choose_batch(rates, caps, cost, switch_on_ms, contexts, spreads)


def _choose_batch(
    rates: list[list[float]],
    caps: list[int],
    cost: CostModel,
    switch_on_ms: list[float],
    contexts: list[int],
    spreads: list[list[float]],
) -> list[int]:
    # NOTE: one more draft changes only the batch's total drafts, one request's expected tokens
    # (by the chance its new last draft survives), its context cost by one row, its experts and,
    # for its first draft, the switch-on cost, so each round of the greedy costs O(requests),
    # not O(requests x k).
    ks = [0] * len(rates)
    survive = [1.0] * len(rates)  # chance that request i's drafts so far all survive
    tokens = float(len(rates))
    row_ms = [cost.context_ms(c, 2) - cost.context_ms(c, 1) for c in contexts]  # one more row
    extra_ms = sum(cost.context_ms(c, 1) for c in contexts)  # switch-ons and context, so far
    experts = sum(sp[0] for sp in spreads)  # distinct experts per layer, summed over requests
    total = 0
    best = tokens / (cost.step_ms(len(rates), 0) + extra_ms + cost.experts_ms(experts))
    while True:
        ms = cost.step_ms(len(rates) + total + 1, total + 1) + extra_ms
        value, pick = -1.0, -1
        for i, cap in enumerate(caps):
            if ks[i] < cap:
                gain = survive[i] * rates[i][ks[i]]
                more = row_ms[i] + (0.0 if ks[i] else switch_on_ms[i])
                spread = experts + spreads[i][ks[i] + 1] - spreads[i][ks[i]]
                trial = (tokens + gain) / (ms + more + cost.experts_ms(spread))
                if trial >= value:  # ties go to the later request
                    value, pick = trial, i
        if pick < 0 or value <= best:
            return ks
        best = value
        survive[pick] *= rates[pick][ks[pick]]
        tokens += survive[pick]
        extra_ms += row_ms[pick] + (0.0 if ks[pick] else switch_on_ms[pick])
        experts += spreads[pick][ks[pick] + 1] - spreads[pick][ks[pick]]
        ks[pick] += 1
        total += 1


@dataclass
class _RequestState:
    rates: list[float]
    num_observed: int = 0  # positions 0 .. num_observed-1 have been tested at least once
    predicted: float = 0.0  # expected accepted drafts of the pending choice
    off_steps: int = 0  # steps in a row without drafts
    backoff: int = FIRST_BACKOFF
    probing: bool = False
    num_last_drafts: int = 0  # drafts of the previous cycle (0: a model drafter must catch up)
    num_tokens: int = 0  # prompt + output, at the latest choice
    num_tokens_drafted: int = 0  # prompt + output when it last drafted: the drafter has seen these


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
class _Rate:
    """Moving averages of a cycle's milliseconds and tokens; their ratio is ms per token."""

    ms: float = 0.0
    tokens: float = 0.0
    count: int = 0

    def add(self, ms: float, num_tokens: int) -> None:
        self.count += 1
        w = max(1.0 / self.count, GUARD_ALPHA)
        self.ms += w * (ms - self.ms)
        self.tokens += w * (num_tokens - self.tokens)

    @property
    def ms_per_token(self) -> float:
        return self.ms / max(self.tokens, 1e-9)


@dataclass
class _Cycle:
    """Drafting (or deciding not to), then the engine step that verifies those drafts."""

    start: float
    kind: str  # "plain" (no drafts), "draft" (drafts the cost model chose) or "probe"
    num_reqs: int
    draft_ms: float
    num_drafts: int = 0  # verified in the step (the scheduler may have dropped some)
    num_tokens: int = -1  # generated in the step; -1 until it ran
    valid: bool = True  # the step decoded exactly this cycle's requests, no prefill
    context_ms: float = 0.0  # what the requests' contexts add to the curve (CostModel.context_ms)
    experts_ms: float = 0.0  # what the experts the step touched add (CostModel.experts_ms)
    plain_context_ms: float = 0.0  # what they would add without drafts


@dataclass
class SpecController:
    max_k: int
    cost: CostModel
    clock: Callable[[], float] = time.perf_counter  # seconds
    states: dict[str, _RequestState] = field(default_factory=dict)
    prior: list[float] = field(default_factory=list)  # rates a new request starts from
    rates: dict[tuple[int, str], _Rate] = field(default_factory=dict)  # (batch size, kind)
    guard_off: int = 0  # steps left with drafting switched off by the guard
    guard_backoff: int = GUARD_FIRST_BACKOFF
    measured_ms: float = 0.0  # all measured cycles
    explore_ms: float = 0.0  # what probe cycles took beyond plain decoding
    _cycle: _Cycle | None = None
    _mark: float = 0.0  # where the current draft call started
    _num_samples: dict[str, int] = field(default_factory=dict)  # per learnt cost
    _overhead_obs: deque = field(default_factory=lambda: deque(maxlen=OVERHEAD_WINDOW))
    # this step's answers of _may_probe's "could drafting pay", by (batch size, cap)
    _could_pay: dict[tuple[int, int], bool] = field(default_factory=dict)
    # per batch size, this choice's (plain step, what one probe draft adds to it): the same for
    # every request of a batch, so computed once a step (_may_probe)
    _probe_prices: dict[int, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prior = self.prior or [PRIOR] * self.max_k

    def _state(self, req_id: str) -> _RequestState:
        if req_id not in self.states:
            self.states[req_id] = _RequestState(list(self.prior))
        return self.states[req_id]

    def choose(
        self,
        req_ids: list[str],
        caps: list[int],
        num_tokens: list[int] | None = None,
        free: bool = False,
        confident: bool = False,
        spreads: list[list[float]] | None = None,
    ) -> list[int]:
        """Draft lengths for the running requests; num_tokens: each one's prompt + output.

        free (drafters that cost next to nothing to ask, Proposer.free_drafts): a request
        running alone is not probed (the engine scores drafts it does not verify, so the rates
        stay current while drafting is off). With confident (Proposer.confident_drafts: the
        drafts end where the drafter's own confidence does) it gets its cap whenever the guard
        allows: the request's running rates are not asked. In a batch every verified row costs
        about as much as another request's token, so drafts are still given one at a time where
        they gain most.
        spreads (mixture of experts, ``choose_num_drafts``): where the cost model prices
        experts, every draft row costs the experts it is predicted to touch, so extra cap is not
        free: the k chosen is the cap, for confident drafters too.
        """
        states = [self._state(r) for r in req_ids]
        self._could_pay, self._probe_prices = {}, {}
        priced = spreads is not None and self.cost.prices_experts
        for s, n in zip(states, num_tokens or [0] * len(states)):
            s.num_tokens = n
        if self.guard_off > 0:
            self.guard_off -= 1
            ks = [0] * len(states)
            for s in states:
                s.probing = False
        elif free and confident and len(states) == 1 and not priced:
            ks = list(caps)
        else:
            switch_on = [self._catch_up_ms(s) / CATCH_UP_HORIZON for s in states]
            ks = choose_num_drafts(
                [_extrapolated(s) for s in states], caps, self.cost, switch_on,
                [s.num_tokens for s in states], spreads if priced else None,
            )  # fmt: skip
            if len(states) == 1 and ks[0] > 0 and not self._best_case_pays(1, caps[0]):
                ks = [0]  # NOTE: before _explore, which then counts this step as one off
            if not (free and len(states) == 1):
                ks = [self._explore(s, k, cap, len(states)) for s, k, cap in zip(states, ks, caps)]
        for s, k in zip(states, ks):
            s.predicted = expected_tokens(s.rates, k) - 1.0
        return ks

    def _explore(self, s: _RequestState, k: int, cap: int, num_reqs: int) -> int:
        s.probing = False
        if k == 0 and cap > 0:
            s.off_steps += 1
            if s.off_steps >= s.backoff and self._may_probe(s, cap, num_reqs):
                k, s.probing, s.off_steps = 1, True, 0  # one draft, to see if things changed
                s.backoff = min(2 * s.backoff, MAX_BACKOFF)
        elif k > 0:  # drafting pays again: probe quickly next time it stops paying
            s.off_steps, s.backoff = 0, FIRST_BACKOFF
        return k

    def _may_probe(self, s: _RequestState, cap: int, num_reqs: int) -> bool:
        """Only if drafting could pay well (PROBE_MIN_GAIN) were every draft accepted, and the
        budget has room for it.

        NOTE: the default layer_skip (28 of SmolLM2's 30 layers) drafts for ~0.95 of a target
        step: one draft, always accepted, would gain ~1%. Probing it let noisy timings and a good
        run of acceptance switch drafting on, and one held-out chat prompt ran 1.5x slower.
        """
        prices = self._probe_prices.get(num_reqs)
        if prices is None:
            plain = self.cost.step_ms(num_reqs, 0)
            prices = self._probe_prices[num_reqs] = (plain, self.cost.step_ms(num_reqs + 1, 1))
        probe_ms = self._catch_up_ms(s) + prices[1] - prices[0]
        if self.explore_ms + probe_ms > EXPLORE_BUDGET * self.measured_ms:
            return False  # NOTE: checked first: in a large batch the budget is usually spent
        return self._best_case_pays(num_reqs, cap)

    def could_pay(self, num_reqs: int, cap: int) -> bool:
        """Whether drafting could beat plain decoding by PROBE_MIN_GAIN for a batch of
        ``num_reqs`` were every draft accepted (at the prices learnt so far)."""
        self._could_pay = {}
        return self._best_case_pays(num_reqs, cap)

    def _best_case_pays(self, num_reqs: int, cap: int) -> bool:
        """Whether some k <= cap, every draft accepted, beats plain by PROBE_MIN_GAIN.

        NOTE: also asked of a request running alone before it drafts at all: a drafter that
        costs nearly a target step per draft (the target as its own draft, layer_skip on 28 of
        30 layers) can gain a few percent at best, less than the cost model's errors; with
        acceptance learnt near 1 the target drafting for itself drafted 30-60 times a prompt and
        ran at 0.86x plain on held-out chat (2-core AVX2 EPYC, 2026-11-27).
        """
        key = (num_reqs, cap)  # the same for every request of a batch: computed once a step
        if key not in self._could_pay:
            cost = self.cost
            plain = cost.step_ms(num_reqs, 0)
            self._could_pay[key] = any(
                (num_reqs + k) / cost.step_ms(num_reqs + k, k)
                > (1.0 + PROBE_MIN_GAIN) * num_reqs / plain
                for k in range(1, cap + 1)
            )
        return self._could_pay[key]

    def _catch_up_ms(self, s: _RequestState) -> float:
        """What the drafter needs to catch up on the request, if it did not draft last cycle."""
        if s.num_last_drafts > 0:
            return 0.0
        return self.cost.catch_up_ms_per_token * (s.num_tokens - s.num_tokens_drafted)

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
            self.prior[i] += PRIOR_ALPHA * (hit - self.prior[i])
        state.num_observed = max(state.num_observed, tested)

    def remove_request(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    # ---- timing: the engine calls end_cycle, (choose,) observe_drafts, observe_step ---------------
    def end_cycle(self) -> None:
        """Drafting is about to start (or be skipped): the previous cycle ends here."""
        self._mark = self.clock()
        cycle, self._cycle = self._cycle, None
        if cycle is not None and cycle.valid and cycle.num_tokens > 0:
            self._record(cycle, 1000.0 * (self._mark - cycle.start))

    def observe_drafts(self, req_ids: list[str], num_drafts: list[int]) -> None:
        """The running requests got these many drafts (0 = none); a cycle starts."""
        draft_ms = 1000.0 * (self.clock() - self._mark)
        states = [self._state(r) for r in req_ids]
        drafting = [s for s, n in zip(states, num_drafts) if n > 0]
        if drafting:
            self._learn_draft_cost(draft_ms, sum(num_drafts), drafting)
        if not drafting:
            kind = "plain"
        else:
            kind = "probe" if all(s.probing for s in drafting) else "draft"
        for s, n in zip(states, num_drafts):
            s.num_last_drafts = n
            if n:
                s.num_tokens_drafted = s.num_tokens
        cost = self.cost
        self._cycle = _Cycle(self._mark, kind, len(req_ids), draft_ms)
        self._cycle.context_ms = sum(
            cost.context_ms(s.num_tokens, 1 + n) for s, n in zip(states, num_drafts)
        )
        self._cycle.plain_context_ms = sum(cost.context_ms(s.num_tokens, 1) for s in states)

    def _learn_draft_cost(self, ms: float, num_drafts: int, drafting: list[_RequestState]) -> None:
        """Steady calls teach the time per draft; the others the time per token caught up on."""
        cost = self.cost
        catching_up = [s for s in drafting if s.num_last_drafts == 0]
        if not catching_up:
            w = self._weight("draft")
            cost.draft_ms_per_token += w * (ms / num_drafts - cost.draft_ms_per_token)
            return
        behind = sum(s.num_tokens - s.num_tokens_drafted for s in catching_up)
        # NOTE: before a steady call has measured the drafts, they count as catching up (a few
        # drafts against a prompt): a first probe must not go blind into a 500 ms catch-up.
        if behind >= MIN_CATCH_UP:
            per_token = max(0.0, ms - cost.draft_ms_per_token * num_drafts) / behind
            w = self._weight("catch_up")
            cost.catch_up_ms_per_token += w * (per_token - cost.catch_up_ms_per_token)

    def observe_step(
        self,
        num_reqs: int,
        num_drafts: int,
        num_tokens: int,
        decode_only: bool,
        distinct_experts: float | None = None,
    ) -> None:
        """An engine step verified `num_drafts` drafts of `num_reqs` requests into `num_tokens`;
        on a mixture of experts its rows touched `distinct_experts` per MoE layer."""
        cycle = self._cycle
        if cycle is None:
            return
        if distinct_experts is not None:
            cycle.experts_ms = self.cost.experts_ms(distinct_experts)
        if not decode_only or num_reqs != cycle.num_reqs or cycle.num_tokens >= 0:
            cycle.valid = False
        cycle.num_drafts, cycle.num_tokens = num_drafts, num_tokens

    def _record(self, cycle: _Cycle, ms: float) -> None:
        self.measured_ms += ms
        cost = self.cost
        n = cycle.num_reqs + cycle.num_drafts
        extra = ms - cycle.draft_ms - cost.verify(n) - cycle.context_ms - cycle.experts_ms
        if cycle.num_drafts:
            old = cost.draft_step_extra(n)
            w = self._weight(f"draft_step{n}")
            cost.draft_step_extra_ms[n] = old + w * (extra - cost.overhead_ms - old)
        else:
            # NOTE: a median, not a moving mean: one stalled step (a page fault, the collector, a
            # neighbour on the VM) of 30 ms put 8-12 ms of "overhead" into every step's price for
            # a while, which made extra tokens per step look precious, and the default
            # layer_skip (which never pays here) drafted and lost ~50% on such prompts.
            self._overhead_obs.append(extra)
            cost.overhead_ms = statistics.median(self._overhead_obs)
        # NOTE: the guard compares cycles at the context cost of a plain step: a conversation's
        # plain and drafted cycles come at different lengths, and each grows with its length.
        ms -= cycle.plain_context_ms
        if cycle.kind == "probe":
            self.explore_ms += ms - cycle.num_tokens * self._plain_ms_per_token(cycle.num_reqs)
            return
        rate = self.rates.setdefault((cycle.num_reqs, cycle.kind), _Rate())
        rate.add(ms, cycle.num_tokens)
        if cycle.kind == "draft" and rate.count >= GUARD_MIN_SAMPLES:
            self._guard(cycle.num_reqs, rate)

    def _weight(self, key: str) -> float:
        """A plain mean over the first samples, then the usual exponential weight."""
        n = self._num_samples[key] = self._num_samples.get(key, 0) + 1
        return max(1.0 / n, ALPHA)

    def _plain_ms_per_token(self, num_reqs: int) -> float:
        rate = self.rates.get((num_reqs, "plain"))
        if rate is not None and rate.count >= GUARD_MIN_SAMPLES:
            return rate.ms_per_token
        return self.cost.verify(num_reqs) / num_reqs  # the start-up measurement of a plain step

    def _guard(self, num_reqs: int, drafting: _Rate) -> None:
        plain = self._plain_ms_per_token(num_reqs)
        if drafting.ms_per_token > (1.0 + GUARD_MARGIN) * plain:
            self.guard_off = self.guard_backoff
            self.guard_backoff = min(2 * self.guard_backoff, GUARD_MAX_BACKOFF)
            del self.rates[(num_reqs, "draft")]  # judged afresh after the back-off
        elif drafting.ms_per_token < plain:
            self.guard_backoff = GUARD_FIRST_BACKOFF


def measure_verify_cost(
    model,
    kv,
    slot: int,
    max_n: int,
    context: int = 64,
    repeats: int = 5,
    batch_ns: tuple[int, ...] = (),
    long_context: int = 0,
) -> CostModel:
    """Time one target forward over n = 1..max_n new tokens after `context` cached tokens, and
    over each n in batch_ns (larger: batches of requests with drafts), linear in between; with
    long_context, what a token of context adds to a request's first row and to each further row
    (``CostModel.context_ms``), from 1 and up to 9 rows at both contexts.

    NOTE: the fastest of the repeats: on shared cores a median ran 40% high. The learnt offset
    adds what real steps cost beyond; the guard's stand-in for a plain step errs strict.
    """
    from specdec.model.llama import SeqBatch

    device = model.device
    ids = torch.zeros(context, dtype=torch.long, device=device)
    model.forward(
        ids[:context], torch.arange(context, device=device), SeqBatch([slot], [0], [context]), kv
    )
    points = list(range(1, max_n + 1)) + sorted(n for n in set(batch_ns) if n > max_n)
    top = points[-1]
    ids = torch.zeros(context + top, dtype=torch.long, device=device)
    timings: list[list[float]] = [[] for _ in points]
    for _ in range(repeats):
        for i, n in enumerate(points):
            pos = torch.arange(context, context + n, device=device)
            start = time.perf_counter()
            hidden = model.forward(ids[:n], pos, SeqBatch([slot], [context], [n]), kv)
            model.compute_logits(hidden)
            timings[i].append(1000.0 * (time.perf_counter() - start))
    fastest = [min(t) for t in timings]
    # NOTE: costs never fall with n (noise can make them): keep the curve monotone.
    for i in range(1, len(fastest)):
        fastest[i] = max(fastest[i], fastest[i - 1])
    curve = fastest[:max_n]
    for (n0, c0), (n1, c1) in zip(zip(points, fastest), zip(points[1:], fastest[1:])):
        curve += [
            c0 + (c1 - c0) * (n - n0) / (n1 - n0) for n in range(max(n0 + 1, max_n + 1), n1 + 1)
        ]
    cost = CostModel(curve, context_base=context)
    _measure_expert_cost(model, cost, max_n)
    rows = min(max_n, 9)
    if long_context > context and long_context + rows <= kv.max_len:
        _measure_context_cost(model, kv, slot, cost, rows, long_context)
    return cost


def _measure_expert_cost(model, cost: CostModel, max_n: int) -> None:
    """Mixture of experts: the experts the curve's rows touched (read from the routers of its
    last forward), and what one more distinct expert per layer costs a step."""
    from specdec.model.moe import distinct_experts, latest_routes, measure_expert_cost, moe_blocks

    blocks = moe_blocks(model)
    routes = latest_routes(blocks)
    if routes is None:
        return
    cost.num_experts = model.cfg.num_experts
    cost.curve_experts = distinct_experts(routes, cost.num_experts)
    # NOTE: all-zero tokens route every row alike: the curve is the narrowest step of each n
    rows = min(max(max_n, 2), 16)
    cost.expert_ms = measure_expert_cost(blocks, rows, model.cfg.hidden_size, model.dtype)


def _measure_context_cost(model, kv, slot: int, cost: CostModel, n: int, long: int) -> None:
    """Fill the cache's first ``long`` positions (their values do not matter to the time), then
    time 1 and n rows after ``cost.context_base`` and after ``long`` cached tokens, interleaved."""
    from specdec.model.llama import SeqBatch

    with torch.no_grad():
        kv.clear(slot, long + n)
    device = model.device
    ids = torch.zeros(n, dtype=torch.long, device=device)
    fastest: dict[tuple[int, int], float] = {}
    for _ in range(3):
        for start in (cost.context_base, long):
            for m in (1, n):
                pos = torch.arange(start, start + m, device=device)
                t0 = time.perf_counter()
                model.compute_logits(
                    model.forward(ids[:m], pos, SeqBatch([slot], [start], [m]), kv)
                )
                ms = 1000.0 * (time.perf_counter() - t0)
                fastest[start, m] = min(ms, fastest.get((start, m), ms))
    span = long - cost.context_base
    first = max(0.0, fastest[long, 1] - fastest[cost.context_base, 1]) / span
    all_rows = max(0.0, fastest[long, n] - fastest[cost.context_base, n]) / span
    cost.ctx_ms_first = first
    cost.ctx_ms_row = max(0.0, all_rows - first) / max(1, n - 1)
