"""The rejection sampler: greedy exactness, distribution preservation, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.sample.ops import target_probs
from specdec.sample.rejection_sampler import PenaltyState, verify
from specdec.sampling_params import SamplingParams

V = 6


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def _tv_bound(n: int) -> float:
    """Three times the largest expected TV distance of n draws over V categories."""
    return 3 * 0.5 * math.sqrt(2 * V / (math.pi * n))


def test_greedy_accepts_while_drafts_match_argmax() -> None:
    logits = torch.full((4, V), -1.0)
    for row, best in enumerate([2, 3, 1, 5]):
        logits[row, best] = 5.0
    sp = SamplingParams(temperature=0.0)
    all_ok = verify(logits, [2, 3, 1], None, sp, None, None)
    assert all_ok.token_ids == [2, 3, 1, 5] and all_ok.num_accepted == 3  # bonus token
    first_bad = verify(logits, [4, 3, 1], None, sp, None, None)
    assert first_bad.token_ids == [2] and first_bad.num_accepted == 0
    mid_bad = verify(logits, [2, 0, 1], None, sp, None, None)
    assert mid_bad.token_ids == [2, 3]
    no_drafts = verify(logits[:1], [], None, sp, None, None)
    assert no_drafts.token_ids == [2]


def test_greedy_penalties_see_earlier_drafts() -> None:
    # Row 1 would pick token 3, but with a frequency penalty token 3 (drafted at row 0) loses.
    logits = torch.zeros(2, V)
    logits[0, 3] = 5.0
    logits[1, 3] = 1.0
    logits[1, 4] = 0.5
    sp = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    state = PenaltyState(torch.zeros(V, dtype=torch.bool), torch.zeros(V))
    out = verify(logits, [3], None, sp, state, None)
    assert out.token_ids == [3, 4]


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
        SamplingParams(temperature=1.3, min_p=0.05),
    ],
    ids=["plain", "topk_topp", "minp"],
)
def test_random_sampling_preserves_target_distribution(with_q: bool, sp: SamplingParams) -> None:
    """First token ~ p0; second token given the first draft survived ~ p1 (TV bound)."""
    g = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(3, V, generator=g) * 1.5
    draft_logits = torch.randn(2, V, generator=g) * 1.5
    p = target_probs(target_logits, sp, None, None)
    q = target_probs(draft_logits, sp, None, None)
    first = torch.zeros(V)
    second = torch.zeros(V)
    n = 4000
    for _ in range(n):
        if with_q:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            res = verify(target_logits, drafts, q, sp, None, g)
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            res = verify(target_logits, drafts, None, sp, None, g)  # point-mass drafts
        first[res.token_ids[0]] += 1
        if res.token_ids[0] == drafts[0]:
            second[res.token_ids[1]] += 1
    assert _tv(first, p[0]) < _tv_bound(n)
    assert second.sum() > 200
    assert _tv(second, p[1]) < _tv_bound(int(second.sum()))


def test_q_zero_and_bonus_edge_cases() -> None:
    g = torch.Generator().manual_seed(0)
    target = torch.zeros(2, V)
    q = torch.zeros(1, V)
    q[0, 0] = 1.0  # the draft says it would only ever propose token 0 ...
    res = verify(
        target, [1], q, SamplingParams(temperature=1.0), None, g
    )  # ... but proposes 1: q(x) = 0
    assert res.num_accepted == 1 and len(res.token_ids) == 2  # p > 0 accepts, then a bonus token
    # p(x) = 0 (masked by top-k) always rejects, and the recovered token is never x.
    target = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0], [0.0] * V])
    sp = SamplingParams(temperature=1.0, top_k=2)
    for _ in range(50):
        res = verify(target, [3], None, sp, None, g)
        assert res.num_accepted == 0 and res.token_ids[0] in (0, 1)


def test_seeded_runs_repeat() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))
    sp = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(7)
        runs.append([verify(logits, [1, 2, 3], None, sp, None, g).token_ids for _ in range(20)])
    assert runs[0] == runs[1]


def test_logprobs_are_raw_target_logprobs() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    res = verify(
        logits,
        [int(logits[0].argmax())],
        None,
        SamplingParams(temperature=0.0, logprobs=0),
        None,
        None,
    )
    expected = logits.log_softmax(-1)
    assert res.logprobs == pytest.approx(
        [float(expected[i, t]) for i, t in enumerate(res.token_ids)]
    )
