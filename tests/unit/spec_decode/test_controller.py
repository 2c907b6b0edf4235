"""The adaptive speculation controller: decision rule, and behaviour with bad and perfect drafters."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from specdec import LLM, SamplingParams
from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer
from specdec.spec_decode.controller import (
    EXPLORE_BUDGET,
    GUARD_FIRST_BACKOFF,
    GUARD_MARGIN,
    MAX_BACKOFF,
    CostModel,
    SpecController,
    choose_num_drafts,
    expected_tokens,
)


def test_expected_tokens_generalises_the_geometric_formula() -> None:
    a = 0.7
    for k in range(6):
        assert expected_tokens([a] * 6, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert expected_tokens([0.5, 0.2], 2) == pytest.approx(1 + 0.5 + 0.1)


def test_single_request_optimum_matches_hand_computation() -> None:
    # verify cost 10, 11, 12, 13, 14 ms for 1..5 tokens; drafting free.
    cost = CostModel([10.0, 11.0, 12.0, 13.0, 14.0])
    # a = 0.9: k tokens/ms: k=0 .100, 1 .1727, 2 .2258, 3 .2652, 4 .2924 -> 4
    assert choose_num_drafts([[0.9] * 4], [4], cost) == [4]
    # a = 0.05: k=0 .100, k=1 1.05/11 = .0955 -> 0
    assert choose_num_drafts([[0.05] * 4], [4], cost) == [0]
    # per-position rates [0.8, 0.1]: k=1 1.8/11 = .1636, k=2 1.88/12 = .1567 -> 1
    assert choose_num_drafts([[0.8, 0.1, 0.9, 0.9]], [4], cost) == [1]
    # the cap binds
    assert choose_num_drafts([[0.9] * 4], [2], cost) == [2]
    # a drafting cost of 3 ms per token: a = 0.5: k=0 .1, k=1 1.5/14 = .107, k=2 1.75/18 = .097 -> 1
    assert choose_num_drafts([[0.5] * 4], [4], CostModel([10.0, 11.0, 12.0, 13.0, 14.0], 3.0)) == [
        1
    ]


def test_batch_gives_drafts_to_the_request_that_gains_most() -> None:
    cost = CostModel([10.0 + n for n in range(16)])
    ks = choose_num_drafts([[0.95] * 4, [0.02] * 4], [4, 4], cost)
    assert ks[0] >= 3 and ks[1] == 0


def _greedy_reference(rates, caps, cost, switch_on_ms):
    """The batch rule written plainly: one draft at a time to whichever request raises the
    batch's expected tokens per millisecond most, recomputing everything for every trial."""

    def throughput(ks):
        tokens = sum(expected_tokens(r, k) for r, k in zip(rates, ks))
        ms = cost.step_ms(len(ks) + sum(ks), sum(ks))
        return tokens / (ms + sum(c for c, k in zip(switch_on_ms, ks) if k))

    ks = [0] * len(rates)
    best = throughput(ks)
    while True:
        trials = []
        for i, cap in enumerate(caps):
            if ks[i] < cap:
                trial = ks[:i] + [ks[i] + 1] + ks[i + 1 :]
                trials.append((throughput(trial), i))
        if not trials or max(trials)[0] <= best * (1 + 1e-12):
            return ks
        best, i = max(trials)
        ks[i] += 1


def test_single_request_rule_is_the_exhaustive_optimum_on_random_rates() -> None:
    rng = random.Random(1)
    for _ in range(300):
        k = rng.randint(1, 32)
        rates = [rng.choice([0.02, rng.random(), 0.97]) for _ in range(k)]
        cap = rng.randint(0, k)
        slope = rng.uniform(0.05, 1.5)
        cost = CostModel([10.0 + slope * n for n in range(k + 1)], rng.uniform(0, 0.5))
        switch = rng.choice([0.0, rng.uniform(0, 3)])

        values = [
            expected_tokens(rates, j) / (cost.step_ms(1 + j, j) + (switch if j else 0.0))
            for j in range(cap + 1)
        ]
        want = max(range(cap + 1), key=lambda j: (values[j], -j))
        assert choose_num_drafts([rates], [cap], cost, [switch]) == [want]


def test_batch_rule_equals_the_plain_greedy_on_random_batches() -> None:
    rng = random.Random(0)
    for _ in range(300):
        num = rng.randint(2, 12)
        k = rng.randint(1, 8)
        rates = [[rng.choice([0.02, rng.random(), 0.97]) for _ in range(k)] for _ in range(num)]
        caps = [rng.randint(0, k) for _ in range(num)]
        slope = rng.uniform(0.05, 1.5)
        cost = CostModel([10.0 + slope * n for n in range(num * (k + 1))], rng.uniform(0, 0.5))
        switch_on = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(num)]
        assert choose_num_drafts(rates, caps, cost, switch_on) == _greedy_reference(
            rates, caps, cost, switch_on
        ), (rates, caps, slope, switch_on)


def test_draft_step_extra_takes_the_nearest_learnt_n_below() -> None:
    cost = CostModel([10.0] * 8)
    assert cost.draft_step_extra(5) == 0.0
    cost.draft_step_extra_ms.update({4: 1.0, 9: 2.0})
    assert [cost.draft_step_extra(n) for n in (2, 4, 8, 9, 30)] == [1.0, 1.0, 1.0, 2.0, 2.0]
    cost.draft_step_extra_ms[6] = 3.0  # learnt later
    assert [cost.draft_step_extra(n) for n in (5, 6, 8)] == [1.0, 3.0, 3.0]


def test_a_negative_learnt_extra_never_makes_drafts_free() -> None:
    cost = CostModel([1.0, 1.02, 1.04, 1.06, 1.08])
    cost.draft_step_extra_ms.update({2: -0.5, 3: -0.5, 4: -0.5, 5: -0.5})  # noisy timings
    assert cost.step_ms(2, 1) >= cost.step_ms(1, 0) * (1 + 0.03)
    # a drafter whose drafts never survive is not worth a single draft
    assert choose_num_drafts([[0.0] * 4], [4], cost) == [0]


def test_controller_learns_per_position() -> None:
    ctl = SpecController(4, CostModel([10.0, 10.5, 11.0, 11.5, 12.0]))
    for _ in range(20):
        ctl.choose(["r"], [4])
        ctl.observe("r", 4, 0)  # the first draft always fails
    assert ctl.choose(["r"], [4]) == [0]
    for _ in range(30):
        ctl.observe("r", 4, 4)
    assert ctl.choose(["r"], [4]) == [4]


def test_a_new_request_starts_from_what_the_drafter_achieved() -> None:
    ctl = SpecController(4, CostModel([10.0, 10.5, 11.0, 11.5, 12.0]))
    assert ctl.choose(["a"], [4])[0] > 0  # the prior: a first draft survives more often than not
    for _ in range(30):
        ctl.observe("a", 4, 0)
    assert ctl.choose(["b"], [4]) == [0]


class _WrongProposer(Proposer):
    """Always proposes a token the model never picks greedily (a deliberately bad drafter)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, inp: DraftInput) -> DraftOutput:
        return DraftOutput(
            [[self.token] * r.max_num_drafts for r in inp.requests], [None] * len(inp.requests)
        )


def _run(llm: LLM, prompt: str, max_tokens: int):
    return llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )[0]


def test_bad_drafter_is_switched_off_within_a_few_steps(tiny_llama) -> None:
    llm = LLM(
        str(tiny_llama),
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    plain = _run(LLM(str(tiny_llama), max_model_len=256), "hello there", 60).outputs[0].token_ids
    never = next(t for t in range(200) if t not in plain)
    llm.engine.speculator.proposer = _WrongProposer(never)
    # NOTE: a fixed cost curve (each verified row 20% of a step), not this machine's clock:
    # under load the measured step times wandered and so did the controller's choices
    ctl = llm.engine.speculator.controller
    ctl.clock = lambda: 0.0
    ctl._record = lambda *_: None
    ctl.cost = CostModel([10.0 + 2.0 * n for n in range(8)])
    out = _run(llm, "hello there", 60)
    assert out.outputs[0].token_ids == plain
    st = out.spec_decode_stats
    # After a handful of failures it stops drafting, and only probes again with backing off.
    assert st.num_drafts <= 12, st
    assert st.mean_chosen_k < 0.5


def test_perfect_drafter_grows_to_the_bound(tiny_llama) -> None:
    cfg = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 5}
    llm = LLM(str(tiny_llama), max_model_len=256, speculative_config=cfg)
    # drafting with the target itself costs as much as verifying; pretend it is free to test the
    # rule: a clock that never moves, and no cycle teaches the cost model anything
    llm.engine.speculator.dormant = False  # the start-up prices said it cannot pay
    ctl = llm.engine.speculator.controller
    ctl.clock = lambda: 0.0
    ctl._record = lambda *_: None
    ctl.cost = CostModel([10.0 + 0.1 * n for n in range(8)])
    out = _run(llm, "hello there", 80)
    st = out.spec_decode_stats
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
    assert st.accepted_per_pos[4] > 0  # it reached k = 5
    assert st.mean_chosen_k > 4.0


def test_a_model_drafter_is_timed_before_its_first_draft(tiny_llama) -> None:
    # The target drafting for itself costs a target step per draft: measured at start-up, the
    # controller never drafts with it from the first step on. (Priced at nothing until timed,
    # the default layer_skip drafted at the start of every engine: 0.92x plain, session 18.)
    cfg = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 5}
    llm = LLM(str(tiny_llama), max_model_len=256, speculative_config=cfg)
    ctl = llm.engine.speculator.controller
    cost = ctl.cost
    assert cost.draft_ms_per_token > 0.5 * cost.verify_ms[0]
    assert cost.catch_up_ms_per_token > 0.0
    assert ctl.choose(["fresh"], [5], [16]) == [0]
    # A drafter that costs next to nothing is learnt from use, as before.
    ngram = LLM(str(tiny_llama), max_model_len=256, speculative_config={"method": "ngram"})
    assert ngram.engine.speculator.controller.cost.draft_ms_per_token == 0.0
    assert not ngram.engine.speculator.dormant


def test_a_drafter_that_cannot_pay_leaves_plain_decoding_alone(tiny_llama, monkeypatch) -> None:
    # Even were every draft accepted, a drafter costing a target step per draft cannot beat plain
    # by the controller's margin: the engine decodes plain, without the speculator's per-step
    # work or probes (kept awake, those held the default layer_skip at 0.91-0.95x plain).
    cfg = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 5}
    spec = LLM(str(tiny_llama), max_model_len=256, speculative_config=cfg).engine.speculator
    cost = spec.controller.cost
    # NOTE: prices set here, not the start-up timings (which sit near the margin on tiny models)
    cost.verify_ms = [10.0 + 0.5 * n for n in range(8)]
    cost.overhead_ms = 0.0
    cost.draft_ms_per_token = 10.0
    assert not spec.controller.could_pay(1, 5) and spec._cannot_pay()
    cost.draft_ms_per_token = 0.1
    assert spec.controller.could_pay(1, 5) and not spec._cannot_pay()
    # Wired at start-up: a drafter the prices rule out never runs, nor does the controller.
    monkeypatch.setattr(SpecController, "could_pay", lambda self, n, cap: False)
    llm = LLM(str(tiny_llama), max_model_len=256, speculative_config=cfg)
    spec = llm.engine.speculator
    assert spec.dormant
    calls = []
    spec.controller.choose = lambda *a, **k: calls.append(a) or [0]
    out = _run(llm, "hello there", 80)
    assert calls == [] and out.spec_decode_stats.num_draft_tokens == 0
    plain = _run(LLM(str(tiny_llama), max_model_len=256), "hello there", 80)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert not spec.proposer.states  # the drafter never took the request
    # A fixed k drafts whatever it costs; n-gram costs nothing to ask.
    fixed = LLM(str(tiny_llama), max_model_len=256, speculative_config={**cfg, "adaptive": False})
    assert not fixed.engine.speculator.dormant
    ngram = LLM(str(tiny_llama), max_model_len=256, speculative_config={"method": "ngram"})
    assert not ngram.engine.speculator.dormant


def test_adaptive_false_keeps_fixed_k(tiny_llama) -> None:
    cfg = {
        "method": "draft_model",
        "model": str(tiny_llama),
        "num_speculative_tokens": 3,
        "adaptive": False,
    }
    llm = LLM(str(tiny_llama), max_model_len=256, speculative_config=cfg)
    assert llm.engine.speculator.controller is None
    st = _run(llm, "hello there", 41).spec_decode_stats
    assert st.num_draft_tokens == 3 * st.num_drafts


# ---- timing: a fake clock and scripted costs, driven in the engine's order ---------------------------
class _Clock:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, ms: float) -> None:
        self.seconds += ms / 1000.0


class _Believer(CostModel):
    """A cost model that learns nothing and always thinks four drafts pay."""

    def step_ms(self, num_tokens: int, num_drafts: int) -> float:
        return 10.0 + 0.01 * num_tokens


@dataclass
class _Run:
    ms: float = 0.0
    tokens: int = 0
    steps: int = 0
    drafting_steps: int = 0
    guard_trips: int = 0

    @property
    def ms_per_token(self) -> float:
        return self.ms / self.tokens


def _drive(
    ctl,
    clock,
    steps,
    draft_ms,
    step_ms,
    accept,
    ids=("r",),
    prompt_len=100,
    spread=None,
    shadow=False,
) -> _Run:
    """Step the controller as LLMEngine does: end_cycle, choose, draft, observe_drafts, verify.

    draft_ms(ks, behind) -> ms of the draft call (behind[i]: tokens request i produced since it
    last drafted); step_ms(ks) -> ms of the step verifying ks; accept(k) -> accepted drafts;
    spread(n) (mixture of experts): distinct experts per layer of n rows of one request, what
    the speculator predicts and what the step touches; shadow: a request without drafts is
    scored on the drafts it would have had (the engine does this for self-sizing drafters).
    """
    run, ids = _Run(), list(ids)
    num_tokens = [prompt_len] * len(ids)
    num_seen = [0] * len(ids)  # by the drafter: a first draft catches up on the prompt
    for _ in range(steps):
        guard_off = ctl.guard_off
        ctl.end_cycle()  # the guard judges here, when a cycle ends
        run.guard_trips += ctl.guard_off > guard_off
        start = clock()
        if spread is None:
            ks = ctl.choose(ids, [4] * len(ids), num_tokens)
        else:
            spreads = [[spread(n) for n in range(1, 6)] for _ in ids]
            ks = ctl.choose(ids, [4] * len(ids), num_tokens, spreads=spreads)
        behind = [n - seen for n, seen in zip(num_tokens, num_seen)]
        clock.advance(draft_ms(ks, behind) if any(ks) else 0.0)
        ctl.observe_drafts(ids, ks)
        clock.advance(step_ms(ks))
        new_tokens = 0
        for i, (req_id, k) in enumerate(zip(ids, ks)):
            accepted = accept(k) if k else 0
            if k:
                ctl.observe(req_id, k, accepted)
                num_seen[i] = num_tokens[i]
            elif shadow:
                ctl.observe(req_id, 4, accept(4))
            num_tokens[i] += 1 + accepted
            new_tokens += 1 + accepted
        distinct = None if spread is None else sum(spread(1 + k) for k in ks)
        ctl.observe_step(len(ids), sum(ks), new_tokens, True, distinct)
        run.ms += 1000.0 * (clock() - start)
        run.tokens += new_tokens
        run.steps += 1
        run.drafting_steps += any(ks)
    return run


def test_a_stalled_step_does_not_make_a_costly_drafter_draft() -> None:
    # A drafter costing 9 ms a draft against 10 ms steps (1 ms of it beyond the 9 ms forward):
    # with the prior's 0.6 acceptance, one draft gives 1.6 tokens in 9.3 + 1 + 9 ms, a loss (and
    # even perfect drafts would gain under 10%: no probes). A 40 ms stall every 20 steps must not
    # price the next steps as if 30 ms of every step were overhead that drafts amortise (a
    # moving mean did, and such a drafter drafted).
    clock = _Clock()
    ctl = SpecController(4, CostModel([9.0, 9.3, 9.6, 9.9, 10.2], draft_ms_per_token=9.0),
                         clock=clock)  # fmt: skip
    stalls = iter(range(10**6))

    def step_ms(ks):
        stall = next(stalls) % 20 == 19
        return (40.0 if stall else 10.0) + 0.3 * sum(ks)

    run = _drive(ctl, clock, 200, lambda ks, behind: 9.0 * sum(ks), step_ms, lambda k: 0)
    assert run.drafting_steps == 0
    assert ctl.cost.overhead_ms == pytest.approx(1.0, abs=0.1)


def test_guard_switches_off_drafting_that_is_slower_per_token() -> None:
    # The model believes drafts pay; really only the first survives, and drafting it takes 10 ms
    # and verifying 12: 22 ms for 2 tokens (11 ms per token) against 10 ms per plain token.
    clock = _Clock()
    ctl = SpecController(4, _Believer([10.0, 10.5, 11.0, 11.5, 12.0]), clock=clock)
    world = {
        "draft_ms": lambda ks, behind: 10.0 * sum(ks),
        "step_ms": lambda ks: 12.0 if any(ks) else 10.0,
        "accept": lambda k: min(k, 1),
    }
    run = _drive(ctl, clock, 600, **world)
    assert run.guard_trips >= 3
    assert ctl.guard_backoff > 4 * GUARD_FIRST_BACKOFF  # each trip backs off longer
    assert run.drafting_steps < 0.25 * run.steps
    assert run.ms_per_token < 10.7  # always drafting: 11
    # each trip costs the GUARD_MIN_SAMPLES cycles that judge drafting afresh; later, more rarely
    later = _drive(ctl, clock, 600, **world)
    assert later.ms_per_token < 10.2


def test_guard_keeps_drafting_that_pays() -> None:
    # Three drafts survive, the fourth never: 3 drafts take 1.5 ms, verifying 12: 13.5 ms for 4
    # tokens against 10 ms per plain token.
    clock = _Clock()
    ctl = SpecController(4, _Believer([10.0, 10.5, 11.0, 11.5, 12.0]), clock=clock)
    run = _drive(
        ctl, clock, 600,
        draft_ms=lambda ks, behind: 0.5 * sum(ks),
        step_ms=lambda ks: 12.0 if any(ks) else 10.0,
        accept=lambda k: min(k, 3),
    )  # fmt: skip
    assert run.guard_trips == 0
    assert run.drafting_steps == run.steps
    assert run.ms_per_token == pytest.approx(13.5 / 4, rel=0.01)


def test_guard_judges_the_batch_against_plain_steps_of_the_same_size() -> None:
    # One request alone: drafts never survive, so the believer runs it plain, 10 ms per token.
    # Two together: a plain step is 12 ms for 2 tokens (6 ms per token, the start-up curve); one
    # draft each (the first survives) costs 2 + 2 + 22 = 26 ms for 4 tokens (6.5 ms per token).
    clock = _Clock()
    ctl = SpecController(4, _Believer([10.0, 12.0, 14.0, 16.0, 18.0]), clock=clock)
    alone = _drive(ctl, clock, 100, lambda ks, behind: 0.0, lambda ks: 10.0, lambda k: 0)
    assert alone.drafting_steps < 0.25 * alone.steps
    pair = _drive(
        ctl, clock, 200,
        draft_ms=lambda ks, behind: 2.0 * sum(ks),
        step_ms=lambda ks: 22.0 if any(ks) else 12.0,
        accept=lambda k: min(k, 1),
        ids=("a", "b"),
    )  # fmt: skip
    # 6.5 ms per token beats one request's plain 10, not two requests' plain 6
    assert pair.guard_trips >= 1
    assert pair.drafting_steps < 0.5 * pair.steps


def _model_drafter_ms(catch_up_ms: float):
    """8 ms per draft, plus catch_up_ms per token behind when the drafter did not draft last step."""

    def draft_ms(ks: list[int], behind: list[int]) -> float:
        return sum(8.0 * k + (catch_up_ms * b if b > 2 else 0.0) for k, b in zip(ks, behind) if k)

    return draft_ms


def _verify_ms(ks: list[int]) -> float:
    return 10.0 + sum(ks) + (3.0 if any(ks) else 0.0)  # after drafting, 3 ms more (cache)


def test_catch_up_is_not_a_cost_per_draft() -> None:
    # One good draft per step does not pay: 2 tokens in 8 + 11 + 3 = 22 ms against 2 x 10 ms.
    clock = _Clock()
    ctl = SpecController(4, CostModel([10.0, 11.0, 12.0, 13.0, 14.0]), clock=clock)
    draft_ms = _model_drafter_ms(4.0)
    run = _drive(ctl, clock, 300, draft_ms, _verify_ms, lambda k: min(k, 1))
    assert 0 < run.drafting_steps < 5
    assert ctl.cost.draft_ms_per_token == pytest.approx(8.0, rel=0.05)
    assert ctl.cost.catch_up_ms_per_token == pytest.approx(4.0, rel=0.1)
    assert ctl.cost.draft_step_extra(2) == pytest.approx(3.0, abs=0.5)
    assert ctl.cost.overhead_ms == pytest.approx(0.0, abs=0.5)
    # the next request starts off; a probe would first catch up on 100+ tokens (400+ ms), more
    # than the budget (1% of 3 s) holds
    later = _drive(ctl, clock, 300, draft_ms, _verify_ms, lambda k: min(k, 1), ids=("next",))
    assert later.drafting_steps == 0
    assert later.ms_per_token == pytest.approx(10.0)


def test_switching_on_weighs_the_catch_up() -> None:
    # Steady, one draft pays a little: 1.35 tokens in 11 + 2 = 13 ms against 1 in 10. Switching on
    # first catches up 1 ms per token behind, spread over CATCH_UP_HORIZON steps.
    cost = CostModel([10.0, 11.0], draft_ms_per_token=2.0, catch_up_ms_per_token=1.0)
    ctl = SpecController(1, cost, prior=[0.35])
    assert ctl.choose(["short"], [1], [20]) == [1]  # 20 / 64 ms more: 1.35 / 13.3 > 1 / 10
    assert ctl.choose(["long"], [1], [500]) == [0]  # 500 / 64 ms more: 1.35 / 20.8 < 1 / 10


def test_probes_keep_to_the_budget() -> None:
    # A drafter that is never right, with nothing to catch up on: a probe costs the 4 ms of
    # verifying one more token; probes fit the budget now and then.
    clock = _Clock()
    ctl = SpecController(4, CostModel([10.0, 11.0, 12.0, 13.0, 14.0]), clock=clock)
    run = _drive(ctl, clock, 3000, lambda ks, behind: 0.1 * sum(ks), _verify_ms, lambda k: 0)
    assert 20 < run.drafting_steps < 100
    assert ctl.explore_ms <= EXPLORE_BUDGET * ctl.measured_ms
    assert run.ms_per_token < 10.0 * (1 + 2 * EXPLORE_BUDGET)
    assert run.guard_trips == 0


def test_no_probes_where_even_perfect_drafts_would_barely_pay() -> None:
    # A model drafter costing 9 ms a draft against a 10 ms step: one draft, always accepted,
    # gives 2 tokens in 10.3 + 9 ms, 3.6% better than plain: never probed (it was: noisy
    # timings then switched such a drafter on). At 7 ms a draft the best case gains 15%: probed.
    clock = _Clock()
    for draft_ms, probed in ((9.0, False), (7.0, True)):
        cost = CostModel([10.0, 10.3], draft_ms_per_token=draft_ms)
        ctl = SpecController(1, cost, prior=[0.0], clock=clock)
        ctl.measured_ms = 1e6  # the budget is not what decides here
        ks = [ctl.choose(["r"], [1], [16])[0] for _ in range(2 * MAX_BACKOFF)]
        assert (sum(ks) > 0) == probed, draft_ms


def test_a_drafter_that_could_barely_pay_even_when_perfect_never_drafts() -> None:
    # The target drafting for itself: 9.5 ms a draft against a 10 ms step, every draft accepted.
    # Three drafts give 4 tokens in 10.9 + 28.5 ms against 10 ms a token: 1.5% better on paper,
    # less than the cost model's errors (it ran at 0.86x plain on held-out chat). Alone, it never
    # drafts; a drafter whose perfect drafts would gain 10% or more is left to the rates.
    for draft_ms, drafts in ((9.5, False), (6.0, True)):
        cost = CostModel([10.0, 10.3, 10.6, 10.9], draft_ms_per_token=draft_ms)
        ctl = SpecController(3, cost, prior=[1.0, 1.0, 1.0])
        assert (ctl.choose(["r"], [3], [16]) != [0]) == drafts, draft_ms


def test_free_drafters_get_the_priced_k_and_no_probes() -> None:
    # Drafters that cost next to nothing to ask (ngram, suffix) are priced like any other: prompt
    # lookup returns k tokens after its match whatever k is, so a cap it is given is verified in
    # full. (Given the whole cap whenever some k paid, n-gram verified ~5 drafts a step for ~0.7
    # accepted on an AVX2 machine, where each row costs ~0.2 of a step: 1.00x plain on held-out
    # chat against 1.13x priced.)
    ctl = SpecController(4, CostModel([10.0, 11.0, 12.0, 13.0, 14.0]))
    ctl.observe("a", 2, 1)  # rates [0.76, 0.36] (+0.36 beyond): k=2 2.03/12 beats k=3 2.13/13
    assert ctl.choose(["a"], [4]) == [2]
    assert ctl.choose(["a"], [4], free=True) == [2]
    for _ in range(6):
        ctl.observe("b", 4, 0)
    assert ctl.choose(["b"], [4], free=True) == [0]
    # no probes for them: off stays off (the engine scores shadow drafts instead) ...
    assert all(ctl.choose(["b"], [4], free=True) == [0] for _ in range(200))
    # ... while other drafters are probed after a back-off (the budget is not what decides here)
    ctl.measured_ms = 1e6
    assert all(ctl.choose(["b"], [4], free=True) == [0] for _ in range(200))
    assert any(ctl.choose(["b"], [4]) != [0] for _ in range(200))


def _confident(ctl: SpecController) -> SpecController:
    """The controller choosing as the engine has it choose for suffix decoding."""
    choose = ctl.choose
    ctl.choose = lambda ids, caps, n=None, free=False, spreads=None: choose(
        ids, caps, n, free=True, confident=True, spreads=spreads
    )
    return ctl


def test_confident_drafts_are_not_gated_by_the_rates_only_by_the_guard() -> None:
    # A drafter whose drafts end where its own confidence does (suffix decoding): a request
    # alone drafts its cap even where its running rates say no draft pays ...
    ctl = SpecController(4, CostModel([10.0, 11.0, 12.0, 13.0, 14.0]))
    for _ in range(6):
        ctl.observe("b", 4, 0)
    assert ctl.choose(["b"], [4], free=True) == [0]
    assert ctl.choose(["b"], [4], free=True, confident=True) == [4]
    assert ctl.choose(["b"], [0], free=True, confident=True) == [0]  # its own cap
    # ... but not while the guard has drafting off
    ctl.guard_off = 2
    assert ctl.choose(["b"], [4], free=True, confident=True) == [0]
    assert ctl.guard_off == 1
    # in a batch each draft still goes where it gains most, by the rates
    ctl.guard_off = 0
    ctl.observe("a", 2, 2)
    ks = ctl.choose(["a", "b"], [4, 4], free=True, confident=True)
    assert ks[1] == 0 and ks[0] > 0


def test_confident_drafts_guard_still_trips_when_drafting_loses() -> None:
    # Drafts that never survive, verified every step: the guard measures drafting slower per
    # token than plain steps and switches it off, confident or not.
    clock = _Clock()
    ctl = _confident(SpecController(4, CostModel([10.0, 11.0, 12.0, 13.0, 14.0]), clock=clock))
    run = _drive(ctl, clock, 600, lambda ks, behind: 0.1 * sum(ks), _verify_ms, lambda k: 0)
    assert run.guard_trips >= 2
    assert run.drafting_steps < 300


def test_unverified_drafts_keep_the_rates_current(tiny_llama) -> None:
    # Drafting never pays under this cost model, so nothing is verified; the engine still
    # scores the ngram drafter's proposals against the tokens that arrive, and the controller
    # learns from them (the output stays plain decoding's).
    llm = LLM(
        str(tiny_llama),
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    ctl = llm.engine.speculator.controller
    ctl.clock = lambda: 0.0
    ctl._record = lambda *_: None
    ctl.cost = CostModel([10.0] + [1000.0] * 7)
    seen: list[tuple[int, int]] = []
    observe = ctl.observe

    def spy(req_id: str, num_drafts: int, num_accepted: int) -> None:
        seen.append((num_drafts, num_accepted))
        observe(req_id, num_drafts, num_accepted)

    ctl.observe = spy
    prompt = "a b c a b c a b c a b"
    plain = _run(LLM(str(tiny_llama), max_model_len=256), prompt, 40).outputs[0].token_ids
    out = _run(llm, prompt, 40)
    assert out.outputs[0].token_ids == plain
    assert out.spec_decode_stats.num_drafts == 0  # nothing verified
    assert seen and all(0 <= a <= d for d, a in seen)  # ...yet drafts were scored


@pytest.mark.parametrize("method,confident", [("suffix", True), ("ngram", False)])
def test_engine_verifies_confident_drafts_the_rates_would_refuse(
    tiny_llama, method: str, confident: bool
) -> None:
    # The same cost model as above says no draft ever pays: suffix decoding's drafts (which end
    # where its confidence does) are verified anyway while the guard allows; ngram's are not.
    llm = LLM(
        str(tiny_llama),
        max_model_len=256,
        speculative_config={"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1}
        if method == "ngram"
        else {"method": method},
    )
    assert llm.engine.speculator.proposer.confident_drafts is confident
    ctl = llm.engine.speculator.controller
    ctl.clock = lambda: 0.0
    ctl._record = lambda *_: None
    ctl.cost = CostModel([10.0] + [1000.0] * 40)
    prompt = "a b c a b c a b c a b"
    plain = _run(LLM(str(tiny_llama), max_model_len=256), prompt, 40).outputs[0].token_ids
    out = _run(llm, prompt, 40)
    assert out.outputs[0].token_ids == plain
    assert (out.spec_decode_stats.num_drafts > 0) is confident


def test_cost_curve_covers_batches_with_drafts(tiny_llama) -> None:
    # The start-up curve is measured up to a full batch with drafts (linear between the points
    # measured), not extrapolated from one request's k + 1 tokens.
    cfg = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama), max_model_len=256, max_num_seqs=4, speculative_config=cfg)
    curve = llm.engine.speculator.controller.cost.verify_ms
    assert len(curve) == 4 * (3 + 1)
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    # A short max_model_len bounds the rows measured in one slot (context + rows must fit).
    small = LLM(str(tiny_llama), max_model_len=32, max_num_seqs=8, speculative_config=cfg)
    assert len(small.engine.speculator.controller.cost.verify_ms) == 32 // 2


class _ConstantProposer(Proposer):
    def propose(self, inp: DraftInput) -> DraftOutput:
        return DraftOutput(
            [[7] * r.max_num_drafts for r in inp.requests], [None] * len(inp.requests)
        )


def test_no_drafts_while_prompts_are_being_prefilled(tiny_llama) -> None:
    # A step that carries prompt chunks is compute-bound already: drafts would cost a full row
    # each and delay those prompts, so the adaptive engine drafts for nobody until they are in.
    cfg = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(
        str(tiny_llama), max_model_len=256, max_num_seqs=2, max_num_batched_tokens=16,
        speculative_config=cfg,
    )  # fmt: skip
    eng = llm.engine
    eng.speculator.proposer = _ConstantProposer()
    ctl = eng.speculator.controller
    ctl.clock = lambda: 0.0
    ctl._record = lambda *_: None
    ctl.cost = CostModel([10.0 + 0.01 * n for n in range(64)])  # drafting is all but free
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = eng.add_request([5, 6, 7, 8], sp)
    while eng.requests[a].num_computed_tokens < 4:
        eng.step()
    assert eng.requests[a].draft_token_ids  # A alone: it drafts
    b = eng.add_request(list(range(10, 70)), sp)  # 60 tokens: four 16-token chunks
    prefill_steps = 0
    while eng.requests[b].is_prefilling:
        eng.step()
        if eng.requests[b].is_prefilling:
            prefill_steps += 1
            assert eng.requests[a].draft_token_ids == []
    assert prefill_steps >= 2
    assert eng.requests[a].draft_token_ids  # prompt in: drafting resumes
    # A request queued for a slot (both taken) is not prefilled next step: drafting goes on.
    eng.add_request(list(range(10, 40)), sp)
    eng.step()
    assert eng.requests[a].draft_token_ids and eng.requests[b].draft_token_ids


def test_drafts_are_priced_at_the_request_context() -> None:
    # Every verified row reads the whole cache: 0.004 ms per cached token beyond the curve's 64.
    cost = CostModel([10.0, 11.0, 12.0, 13.0, 14.0], context_base=64)
    cost.ctx_ms_first = cost.ctx_ms_row = 0.004
    assert cost.context_ms(64, 5) == 0.0 and cost.context_ms(1064, 1) == pytest.approx(4.0)
    assert cost.context_ms(1064, 3) == pytest.approx(12.0)
    # a = 0.5: at 100 tokens drafting pays (k=2: 1.75 / 12.4 ms > 1 / 10.1 ms); at 4,000 one
    # draft costs a second pass over the cache (1.5 / 42.5 ms < 1 / 25.7 ms)
    assert choose_num_drafts([[0.5] * 4], [4], cost, contexts=[100])[0] > 0
    assert choose_num_drafts([[0.5] * 4], [4], cost, contexts=[4000]) == [0]
    # in a batch, the same rates: the drafts go to the short request
    short, long_ = choose_num_drafts([[0.6] * 4, [0.6] * 4], [4, 4], cost, contexts=[100, 4000])
    assert short > 0 and long_ == 0
    # without a context cost the long request drafts as the short one does
    flat = CostModel([10.0, 11.0, 12.0, 13.0, 14.0])
    assert choose_num_drafts([[0.5] * 4], [4], flat, contexts=[4000])[0] > 0


def test_a_long_request_after_short_ones_is_priced_at_its_context() -> None:
    # Each verified row reads the cache: ~1 ms of attention at a few hundred tokens, 16 ms at
    # ~4,000. Every other single draft survives: at short contexts one draft pays (1.5 tokens in
    # 13 ms against 1 in 11), at ~4,000 it loses 10% (1.5 in 43 ms against 1 in 26). Priced at
    # each request's context, the controller drafts the short requests and stops at once for
    # the long one; priced at the start-up context it carries the short requests' lesson over.
    def run(ctx_ms_row: float) -> tuple[_Run, _Run]:
        clock = _Clock()
        cost = CostModel([10.0, 11.0, 12.0, 13.0, 14.0], context_base=64)
        cost.ctx_ms_first = cost.ctx_ms_row = ctx_ms_row
        ctl = SpecController(4, cost, clock=clock)
        flips = iter(range(10**6))

        def phase(row_ms: float, prompt_len: int, req_id: str) -> _Run:
            return _drive(
                ctl, clock, 300, lambda ks, behind: 0.1 * sum(ks),
                lambda ks: 10.0 + sum(ks) + row_ms * (len(ks) + sum(ks)),
                lambda k: min(k, next(flips) % 2), ids=(req_id,), prompt_len=prompt_len,
            )  # fmt: skip

        return phase(1.0, 200, "short"), phase(16.0, 4000, "long")

    (short, long_), (_, unpriced_long) = run(0.004), run(0.0)
    assert short.drafting_steps == short.steps  # drafting pays there
    assert long_.drafting_steps <= 10
    assert long_.ms_per_token <= 26.0 * (1 + 2 * EXPLORE_BUDGET)
    assert unpriced_long.drafting_steps > long_.drafting_steps
    assert unpriced_long.ms_per_token > long_.ms_per_token


# ---- mixture of experts: drafts priced by the experts they would touch ------------------------------
def _uniform_spread(n: int) -> float:
    """Distinct experts per layer of n rows routed independently, 8 of 128 each (Qwen3-30B-A3B)."""
    return 128 * (1 - (1 - 8 / 128) ** n)


def _moe_cost(expert_ms: float) -> CostModel:
    """The start-up curve (rows all routed alike: 8 experts per layer) and the expert price."""
    cost = CostModel([10.0 + 0.3 * n for n in range(5)], expert_ms=expert_ms)
    cost.curve_experts, cost.num_experts = 8.0, 128
    return cost


def _moe_world(expert_ms: float, survive: float = 0.6):
    """Verifying k drafts: 0.3 ms a row, expert_ms per distinct expert beyond the narrowest
    step; each draft survives with probability ``survive`` (seeded)."""
    rng = random.Random(0)

    def accept(k: int) -> int:
        return next((i for i in range(k) if rng.random() >= survive), k)

    return {
        "draft_ms": lambda ks, behind: 0.1 * sum(ks),
        "step_ms": lambda ks: (
            10.0 + sum(0.3 * k + expert_ms * (_uniform_spread(1 + k) - 8) for k in ks)
        ),
        "accept": accept,
    }


def test_drafts_are_priced_by_the_experts_they_would_touch() -> None:
    spread = [_uniform_spread(n) for n in range(1, 6)]  # 8, 15.5, 22.5, 29.1, 35.3
    rates = [[0.6] * 4]
    # a = 0.6, 0.5 ms per expert: k=4 costs 12 + 13.6 ms for 2.3 tokens; k=1, 10.8 ms for 1.6
    assert choose_num_drafts(rates, [4], _moe_cost(0.5), spreads=[spread]) == [1]
    assert choose_num_drafts(rates, [4], _moe_cost(1.0), spreads=[spread]) == [0]
    assert choose_num_drafts(rates, [4], _moe_cost(0.0), spreads=[spread]) == [4]  # dense
    # rows that keep to the same experts cost what the curve says
    narrow = [8.0] * 5
    assert choose_num_drafts(rates, [4], _moe_cost(1.0), spreads=[narrow]) == [4]
    # in a batch the drafts go to the request whose rows share their experts
    ks = choose_num_drafts(rates * 2, [4, 4], _moe_cost(1.0), spreads=[spread, narrow])
    assert ks[0] == 0 and ks[1] > 0


def test_expert_spread_shrinks_k_for_a_confident_drafter() -> None:
    # A confident drafter (suffix decoding) alone gets its cap, 4; on this mixture of experts a
    # step verifying 4 drafts costs 11.6 + 13.6 ms for 2.3 tokens (10.8 ms each) against a plain
    # 10 ms. Priced by experts the controller keeps to about 1 draft (14.1 ms for 1.6 tokens,
    # 8.8 ms each); unpriced, it drafts its cap until the guard finds that slower than plain.
    def run(priced: bool) -> tuple[_Run, float]:
        clock = _Clock()
        ctl = _confident(SpecController(4, _moe_cost(0.5 if priced else 0.0), clock=clock))
        run = _drive(ctl, clock, 600, **_moe_world(0.5), spread=_uniform_spread, shadow=True)
        return run, ctl.cost.expert_ms

    (priced, _), (unpriced, _) = run(True), run(False)
    assert priced.drafting_steps > 0.5 * priced.steps
    assert priced.ms_per_token < 0.95 * 10.0
    assert priced.ms_per_token < 0.93 * unpriced.ms_per_token
    # at the prior rates (0.6 a draft) one draft is the optimum
    ctl = _confident(SpecController(4, _moe_cost(0.5)))
    assert ctl.choose(["r"], [4], [100], spreads=[[_uniform_spread(n) for n in range(1, 6)]]) == [1]
    assert ctl.choose(["r"], [4], [100]) == [4]  # no spreads: the cap


def test_expert_spread_never_slower_than_plain() -> None:
    # 1 ms per expert: even one draft loses (17.8 ms for 1.6 tokens against 10 for 1). Priced
    # by experts, only a lucky run of the (noisy) rates has it draft; unpriced, it drafts its
    # cap and the guard has to find out, over and over.
    def run(priced: bool) -> _Run:
        clock = _Clock()
        ctl = _confident(SpecController(4, _moe_cost(1.0 if priced else 0.0), clock=clock))
        return _drive(ctl, clock, 600, **_moe_world(1.0), spread=_uniform_spread, shadow=True)

    priced, unpriced = run(True), run(False)
    print(priced, unpriced)
    assert priced.drafting_steps < 0.2 * priced.steps
    assert priced.ms_per_token < 10.0 * (1 + GUARD_MARGIN)
    assert unpriced.ms_per_token > priced.ms_per_token + 0.3


def test_dense_decisions_are_unchanged_by_spreads() -> None:
    # A dense model's cost prices no experts: whatever spreads say, the same choices as without.
    rng = random.Random(3)
    for _ in range(200):
        num = rng.randint(1, 4)
        rates = [[rng.random() for _ in range(6)] for _ in range(num)]
        caps = [rng.randint(0, 6) for _ in range(num)]
        spreads = [[8.0 + 7 * n * rng.random() for n in range(cap + 1)] for cap in caps]
        cost = CostModel([10.0 + rng.random() * n for n in range(12)])
        contexts = [rng.randint(0, 3000) for _ in range(num)]
        assert choose_num_drafts(rates, caps, cost, None, contexts, spreads) == choose_num_drafts(
            rates, caps, cost, None, contexts
        )
    # the controller too, confident drafters included, over whole simulated runs
    runs = []
    for spread in (None, _uniform_spread):
        clock = _Clock()
        ctl = _confident(SpecController(4, CostModel([10.0 + n for n in range(5)]), clock=clock))
        runs.append(_drive(ctl, clock, 300, **_moe_world(0.5), spread=spread))
    assert runs[0] == runs[1]
