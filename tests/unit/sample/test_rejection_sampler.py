"""The rejection sampler: greedy exactness, distribution preservation, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.sample.ops import processed_logits
from specdec.sample.rejection_sampler import PenaltyState, verify
from specdec.sample.sampler import row_probs
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
    all_ok = verify(logits, [2, 3, 1], None, sp, None, 0, 0)
    assert all_ok.token_ids == [2, 3, 1, 5] and all_ok.num_accepted == 3  # bonus token
    first_bad = verify(logits, [4, 3, 1], None, sp, None, 0, 0)
    assert first_bad.token_ids == [2] and first_bad.num_accepted == 0
    mid_bad = verify(logits, [2, 0, 1], None, sp, None, 0, 0)
    assert mid_bad.token_ids == [2, 3]
    no_drafts = verify(logits[:1], [], None, sp, None, 0, 0)
    assert no_drafts.token_ids == [2]


def test_greedy_penalties_see_earlier_drafts() -> None:
    # Row 1 would pick token 3, but with a frequency penalty token 3 (drafted at row 0) loses.
    logits = torch.zeros(2, V)
    logits[0, 3] = 5.0
    logits[1, 3] = 1.0
    logits[1, 4] = 0.5
    sp = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    state = PenaltyState(torch.zeros(V, dtype=torch.bool), torch.zeros(V))
    out = verify(logits, [3], None, sp, state, 0, 0)
    assert out.token_ids == [3, 4]


def _probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:  # [R, V]
    z = processed_logits(logits, sp, None, None)
    return torch.stack([row_probs(z[i], sp) for i in range(z.shape[0])]).float()


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
    """First token ~ p0; second token given the first draft survived ~ p1 (TV bound), over
    4000 seeds: with drafts sampled from q (Leviathan/Chen) and as point masses (sample and
    match)."""
    g = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(3, V, generator=g) * 1.5
    draft_logits = torch.randn(2, V, generator=g) * 1.5
    p = _probs(target_logits, sp)
    q = _probs(draft_logits, sp)
    first = torch.zeros(V)
    second = torch.zeros(V)
    n = 4000
    for seed in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        res = verify(target_logits, drafts, q if with_q else None, sp, None, seed, 0)
        first[res.token_ids[0]] += 1
        if res.token_ids[0] == drafts[0]:
            second[res.token_ids[1]] += 1
    assert _tv(first, p[0]) < _tv_bound(n)
    assert second.sum() > 200
    assert _tv(second, p[1]) < _tv_bound(int(second.sum()))


def test_q_zero_and_bonus_edge_cases() -> None:
    target = torch.zeros(2, V)
    q = torch.zeros(1, V)
    q[0, 0] = 1.0  # the draft says it would only ever propose token 0 ...
    res = verify(target, [1], q, SamplingParams(temperature=1.0), None, 3, 0)  # ... but proposes 1
    assert res.num_accepted == 1 and len(res.token_ids) == 2  # p > 0 accepts, then a bonus token
    # p(x) = 0 (masked by top-k) always rejects, and the recovered token is never x.
    target = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0], [0.0] * V])
    sp = SamplingParams(temperature=1.0, top_k=2)
    for seed in range(50):
        for draft_q in (None, torch.full((1, V), 1.0 / V)):
            res = verify(target, [3], draft_q, sp, None, seed, 0)
            assert res.num_accepted == 0 and res.token_ids[0] in (0, 1)


def test_seeded_runs_repeat_and_seeds_differ() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))
    sp = SamplingParams(temperature=1.0)
    runs = [
        [verify(logits, [1, 2, 3], None, sp, None, seed, pos).token_ids for pos in range(20)]
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_p=0.8, top_k=3),
        SamplingParams(temperature=0.9, min_p=0.1, frequency_penalty=0.5),
    ],
    ids=["temperature", "topk_topp", "minp_penalty"],
)
def test_sample_and_match_equals_plain_sampling(sp: SamplingParams) -> None:
    """Whatever the drafts, verification yields exactly the tokens plain decoding samples one
    position at a time with the same seed (each row seen through the same penalties)."""
    g = torch.Generator().manual_seed(11)
    for seed in range(40):
        logits = torch.randn(5, V, generator=g) * 2  # rows for positions 3..7
        state = PenaltyState(torch.zeros(V, dtype=torch.bool), torch.zeros(V))
        plain: list[int] = []
        for i in range(5):
            counts = PenaltyState(state.prompt_mask, state.output_counts.clone())
            for t in plain:
                counts.output_counts[t] += 1
            plain += verify(logits[i : i + 1], [], None, sp, counts, seed, 3 + i).token_ids
        drafts = [plain[0], plain[1], (plain[2] + seed % 2) % V, plain[3]]
        res = verify(logits, drafts, None, sp, state, seed, 3)
        assert res.token_ids == plain[: len(res.token_ids)]
        assert res.num_accepted == (4 if drafts[2] == plain[2] else 2)


def test_logprobs_are_raw_target_logprobs() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    res = verify(
        logits,
        [int(logits[0].argmax())],
        None,
        SamplingParams(temperature=0.0, logprobs=0),
        None,
        0,
        0,
    )
    expected = logits.log_softmax(-1)
    assert [lp.logprob for lp in res.logprobs] == pytest.approx(
        [float(expected[i, t]) for i, t in enumerate(res.token_ids)]
    )
