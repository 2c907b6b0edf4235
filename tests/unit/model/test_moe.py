"""The MoE layer's elementwise helpers give a row the same bits whatever the rows beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specdec import LLM, SamplingParams
from specdec.model.moe import (
    SPREAD_WINDOW,
    ExpertSpread,
    _sigmoid_rows,
    _silu_mul,
    distinct_experts,
    expert_mask,
)
from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer
from specdec.spec_decode.controller import CostModel


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # NOTE: thread chunks that start mid-row are what breaks plain SiLU
    yield
    torch.set_num_threads(saved)


def test_silu_mul_is_row_invariant(two_threads) -> None:
    # 4,075 rows of 40: plain F.silu(gate) * up gives one row other bits (2 threads, AVX2)
    gate_up = torch.randn(4075, 80, generator=torch.Generator().manual_seed(2)) * 6
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    alone = torch.cat([F.silu(gate[i : i + 1]) * up[i : i + 1] for i in range(len(gate))])
    assert torch.equal(_silu_mul(gate, up), alone)


def test_sigmoid_rows_is_row_invariant() -> None:
    # a contiguous [T, 1] column: plain torch.sigmoid puts rows on vector or scalar lanes
    x = torch.randn(5001, 1, generator=torch.Generator().manual_seed(0)) * 6
    alone = torch.cat([_sigmoid_rows(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(_sigmoid_rows(x), alone)
    assert torch.allclose(alone, torch.sigmoid(x))


def suffix_spread(routes: np.ndarray, num_experts: int) -> list[float]:
    """The reference: [n, L, k] consecutive rows -> distinct experts per layer of the last 1, 2,
    ... n rows."""
    n, num_layers, _ = routes.shape
    # NOTE: per (layer, expert), how many rows back it was last chosen (n: never): the last m
    # rows touched the experts whose age is under m. Oldest row first, so newer ages overwrite.
    ages = np.full((num_layers, num_experts), n, dtype=np.int64)
    layers = np.arange(num_layers)[:, None]
    for i in range(n):
        ages[layers, routes[i]] = n - 1 - i
    counts = np.bincount(ages.ravel(), minlength=n + 1)[:n]
    return (counts.cumsum() / num_layers).tolist()


def test_suffix_spread_counts_the_distinct_experts_of_the_newest_rows() -> None:
    # 3 rows, 2 layers, top-2 of 8 experts, oldest first
    routes = np.array([[[0, 1], [4, 5]], [[1, 2], [4, 5]], [[2, 3], [6, 7]]])
    # newest row: 2 and 2; + the middle one: 3 and 4; + the oldest: 4 and 4
    assert suffix_spread(routes, 8) == [2.0, 3.5, 4.0]
    assert distinct_experts(routes, 8) == 4.0
    assert expert_mask(routes[:1], 8).sum(axis=1).tolist() == [2, 2]


def test_suffix_spread_matches_a_one_hot_reference() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, layers = int(rng.integers(1, 17)), int(rng.integers(1, 6))
        routes = np.stack(
            [[rng.permutation(16)[:3] for _ in range(layers)] for _ in range(n)]
        )  # [n, L, 3]
        one_hot = np.zeros((n, layers, 16), dtype=bool)
        np.put_along_axis(one_hot, routes[::-1], True, axis=2)  # newest first
        want = (np.logical_or.accumulate(one_hot, axis=0).sum(axis=2).mean(axis=1)).tolist()
        assert suffix_spread(routes, 16) == pytest.approx(want)


def test_expert_spread_learns_from_the_accepted_rows() -> None:
    spread = ExpertSpread(num_experts=8, top_k=2)
    assert spread.predict("new", 3) == pytest.approx([2.0, 8 * (1 - 0.75**2), 8 * (1 - 0.75**3)])
    same = np.array([[[0, 1]]] * 6)  # [6, 1, 2]: every row the same two experts
    spread.observe("a", same, num_valid=6, decode=False)  # a prompt
    for _ in range(20):
        spread.observe("a", same[:3], num_valid=2, decode=True)  # 1 draft of 2 accepted
    assert spread.predict("a", 4) == pytest.approx([2.0] * 4, abs=0.01)
    assert spread.hit_fraction == 1.0  # the previous step's rows held every expert
    # rows that each take new experts: the prediction widens, and the hits fall
    for i in range(20):
        rows = np.array([[[(2 * i) % 8, (2 * i + 1) % 8]], [[(2 * i + 2) % 8, (2 * i + 3) % 8]]])
        spread.observe("a", rows, num_valid=1, decode=True)
    assert spread.predict("a", 4)[3] > 7.0
    assert spread.hit_fraction < 0.6
    # rows not accepted do not enter the window; a removed request starts from the prior
    spread.observe("b", np.array([[[0, 1]], [[6, 7]]]), num_valid=1, decode=False)
    assert spread.requests["b"].last_set.tolist() == [[e in (0, 1) for e in range(8)]]
    spread.remove("a")
    assert "a" not in spread.requests
    assert spread.predict("a", 2)[1] > 2.0  # the prior moved towards what requests showed


def test_expert_spread_measures_the_window_of_accepted_rows() -> None:
    # what ExpertSpread keeps step by step equals suffix_spread over the last 16 accepted rows
    rng = np.random.default_rng(1)
    spread, accepted = ExpertSpread(num_experts=12, top_k=3), []
    for step in range(40):
        n = int(rng.integers(1, 30 if step == 0 else 6))
        routes = np.stack([[rng.permutation(12)[:3] for _ in range(4)] for _ in range(n)])
        valid = int(rng.integers(0 if step else 1, n + 1))
        spread.observe("r", routes, valid, decode=step > 0)
        accepted += list(routes[:valid])
        want = suffix_spread(np.stack(accepted[-SPREAD_WINDOW:]), 12)
        assert spread.requests["r"].measured() == pytest.approx(want)


def test_moe_engine_prices_experts_and_a_dense_one_does_not(tiny_qwen3_moe, tiny_llama) -> None:
    cfg = {"method": "suffix", "num_speculative_tokens": 4}
    moe = LLM(str(tiny_qwen3_moe), max_model_len=256, speculative_config=cfg)
    sp = moe.engine.speculator
    cost = sp.controller.cost
    top_k = sp.spread.top_k
    # the curve's rows (all token 0) routed alike: top_k experts per layer
    assert cost.curve_experts == top_k and cost.num_experts == sp.spread.num_experts
    assert cost.expert_ms >= 0.0
    plain = LLM(str(tiny_qwen3_moe), max_model_len=256)
    prompt = "one two three one two three one two three"
    sampling = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = moe.generate([prompt], sampling)[0].outputs[0].token_ids
    assert out == plain.generate([prompt], sampling)[0].outputs[0].token_ids
    assert sp.spread.num_touched > 0 and sp.spread.requests == {}
    dense = LLM(str(tiny_llama), max_model_len=256, speculative_config=cfg).engine.speculator
    assert dense.spread is None and dense.controller.cost.expert_ms == 0.0


class _OneRight(Proposer):
    """The target's next token, then a wrong one: one draft of every step survives."""

    free_drafts = confident_drafts = True

    def __init__(self, plain: list[int], num_prompt: int) -> None:
        self.plain, self.num_prompt = plain, num_prompt

    def propose(self, inp: DraftInput) -> DraftOutput:
        out = []
        for r in inp.requests:
            p = r.next_position
            right = self.plain[p : p + 1]
            out.append(
                (right + [(t + 1) % 64 for t in self.plain[p + 1 : p + 4]])[: r.max_num_drafts]
            )
        return DraftOutput(out, [None] * len(out))


def test_engine_passes_expert_spreads_to_the_controller(tiny_qwen3_moe) -> None:
    # Drafts priced by the experts the speculator predicts (here the uniform prior, 8 experts of
    # which 2 a row: 2, 3.5, 4.6, 5.5, 6.1 per layer for 1..5 rows) at 3 ms an expert: one
    # draft (always right) pays, 14.6 ms for 2 tokens; four (one right) cost 22.7 ms for 2.
    # Unpriced, a confident drafter alone gets its cap.
    prompt = list(range(3, 20))
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_moe), max_model_len=256).generate([prompt], sampling)[0]
    plain_ids = list(plain.outputs[0].token_ids)
    chosen = {}
    for expert_ms in (0.0, 3.0):
        cfg = {"method": "suffix", "num_speculative_tokens": 4}
        llm = LLM(str(tiny_qwen3_moe), max_model_len=256, speculative_config=cfg)
        sp = llm.engine.speculator
        sp.proposer = _OneRight(plain_ids, len(prompt))
        prior = list(sp.spread.prior)
        sp.spread.predict = lambda req_id, n, prior=prior: prior[:n]
        ctl = sp.controller
        ctl.clock = lambda: 0.0
        ctl._record = lambda *_: None
        ctl.cost = CostModel([10.0 + 0.1 * n for n in range(8)], expert_ms=expert_ms)
        ctl.cost.curve_experts, ctl.cost.num_experts = 2.0, 8
        out = llm.generate([prompt], sampling)[0]
        assert list(out.outputs[0].token_ids) == plain_ids
        chosen[expert_ms] = out.spec_decode_stats.mean_chosen_k
    assert chosen[0.0] > 3.5  # the cap, but where max_tokens clips it
    assert 0.8 < chosen[3.0] < 1.5


def test_moe_batch_with_expert_pricing_is_exact(tiny_qwen3_moe) -> None:
    # two requests at once: the batch rule prices each draft by its request's predicted experts
    prompts = ["one two three one two three one two three", "a b c d a b c d a b c d a b"]
    sampling = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_moe), max_model_len=256).generate(prompts, sampling)
    cfg = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(tiny_qwen3_moe), max_model_len=256, speculative_config=cfg)
    sp = llm.engine.speculator
    sp.controller.cost.expert_ms = max(sp.controller.cost.expert_ms, 0.05)  # priced, always
    out = llm.generate(prompts, sampling)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert sp.spread.requests == {}
