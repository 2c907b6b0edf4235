"""The adaptive speculation controller: decision rule, and behaviour with bad and perfect drafters."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer
from specdec.spec_decode.controller import (
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


def test_controller_learns_per_position() -> None:
    ctl = SpecController(4, CostModel([10.0, 10.5, 11.0, 11.5, 12.0]))
    for _ in range(20):
        ctl.choose(["r"], [4])
        ctl.observe("r", 4, 0)  # the first draft always fails
    assert ctl.choose(["r"], [4]) == [0]
    for _ in range(30):
        ctl.observe("r", 4, 4)
    assert ctl.choose(["r"], [4]) == [4]


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
    llm.engine.proposer = _WrongProposer(never)
    out = _run(llm, "hello there", 60)
    assert out.outputs[0].token_ids == plain
    st = out.spec_decode_stats
    # After a handful of failures it stops drafting, and only probes again with backing off.
    assert st.num_drafts <= 12, st
    assert st.mean_chosen_k < 0.5


def test_perfect_drafter_grows_to_the_bound(tiny_llama) -> None:
    cfg = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 5}
    llm = LLM(str(tiny_llama), max_model_len=256, speculative_config=cfg)
    # drafting with the target itself costs as much as verifying; pretend it is free to test the rule
    llm.engine.controller.cost.draft_ms_per_token = 0.0
    llm.engine.controller.observe_draft_time = lambda *_: None
    llm.engine.controller.cost.verify_ms = [10.0 + 0.1 * n for n in range(8)]
    out = _run(llm, "hello there", 80)
    st = out.spec_decode_stats
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
    assert st.accepted_per_pos[4] > 0  # it reached k = 5
    assert st.mean_chosen_k > 4.0


def test_adaptive_false_keeps_fixed_k(tiny_llama) -> None:
    cfg = {
        "method": "draft_model",
        "model": str(tiny_llama),
        "num_speculative_tokens": 3,
        "adaptive": False,
    }
    llm = LLM(str(tiny_llama), max_model_len=256, speculative_config=cfg)
    assert llm.engine.controller is None
    st = _run(llm, "hello there", 41).spec_decode_stats
    assert st.num_draft_tokens == 3 * st.num_drafts
