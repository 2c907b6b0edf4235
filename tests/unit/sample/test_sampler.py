"""The keyed sampler: its fast paths equal a brute-force reading of its definition; the keyed
uniforms are deterministic, independent across keys and uniform."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specdec.sample.random import Purpose, normalize_seed, uniform
from specdec.sample.sampler import NUM_LEADING, row_probs, sample_row, sample_row_and_probs
from specdec.sampling_params import SamplingParams


def _reference_kept(z: torch.Tensor, sp: SamplingParams) -> tuple[set[int], list[float]]:
    """The sampler's kept set, straight from its module docstring, by a full sort."""
    zl = z.tolist()
    w = (z - z.max()).exp().tolist()
    order = sorted(range(len(zl)), key=lambda i: (-zl[i], i))
    kept = set(order)
    if sp.top_k != -1 and sp.top_k < len(zl):
        kth = zl[order[sp.top_k - 1]]
        kept = {i for i in kept if zl[i] >= kth}
    if sp.top_p < 1.0:
        ranked = [i for i in order if i in kept]
        if len(kept) < len(zl):
            mass = math.fsum(w[i] for i in ranked)
        else:
            mass = float((z - z.max()).exp().sum(dtype=torch.float64))
        cum, nucleus = 0.0, set()
        for j, i in enumerate(ranked):
            if j > 0 and cum >= sp.top_p * mass:
                break
            nucleus.add(i)
            cum += w[i]
        kept = nucleus
    if sp.min_p > 0:
        kept = {i for i in kept if w[i] >= sp.min_p}
    return kept, w


def _reference_sample(z: torch.Tensor, sp: SamplingParams, u: float) -> int:
    kept, w = _reference_kept(z, sp)
    zl = z.tolist()
    order = sorted(range(len(zl)), key=lambda i: (-zl[i], i))
    if NUM_LEADING < len(zl):
        floor = zl[order[NUM_LEADING - 1]]
        lead = [i for i in order if zl[i] > floor]
    else:
        lead = order
    head = [i for i in lead if i in kept]
    tail = sorted(kept - set(lead))
    seq = head + tail
    x = u * math.fsum(w[i] for i in seq)
    cum = 0.0
    for i in seq:
        cum += w[i]
        if x < cum:
            return i
    return seq[-1]


def test_sample_row_matches_its_definition() -> None:
    """Random rows (some with many tied logits), vocabularies below and above the leading and
    candidate sizes, every truncation alone and combined."""
    rng = random.Random(0)
    for trial in range(250):
        num = rng.choice([6, 40, 300, 2000])
        z = torch.randn(num, generator=torch.Generator().manual_seed(trial))
        z = z * rng.choice([0.5, 2.0, 8.0])
        if trial % 3 == 0:
            z = (z * 2).round() / 2  # ties everywhere
        sp = SamplingParams(
            temperature=1.0,
            top_k=rng.choice([-1, 1, 5, 50, 500]),
            top_p=rng.choice([1.0, 0.5, 0.9, 0.99]),
            min_p=rng.choice([0.0, 0.01, 0.2]),
        )
        for _ in range(4):
            u = rng.random()
            assert sample_row(z, sp, u) == _reference_sample(z, sp, u), (trial, sp, u)
        kept, w = _reference_kept(z, sp)
        probs = row_probs(z, sp)
        token, probs_too = sample_row_and_probs(z, sp, u)
        assert token == sample_row(z, sp, u) and torch.equal(probs_too, probs)
        assert set(probs.nonzero().flatten().tolist()) == kept
        total = math.fsum(w[i] for i in kept)
        for i in kept:
            assert float(probs[i]) == pytest.approx(w[i] / total, rel=1e-9)


def test_sample_row_frequencies_follow_row_probs() -> None:
    z = torch.randn(50, generator=torch.Generator().manual_seed(3)) * 1.5
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    n = 20000
    counts = torch.zeros(50)
    for i in range(n):
        counts[sample_row(z, sp, uniform(99, i, Purpose.TARGET))] += 1
    tv = 0.5 * float((counts / n - row_probs(z, sp).float()).abs().sum())
    assert tv < 0.03


def test_uniform_is_keyed_deterministic_and_uniform() -> None:
    assert uniform(1, 2, Purpose.TARGET) == uniform(1, 2, Purpose.TARGET)
    keys = {
        uniform(1, 2, Purpose.TARGET),
        uniform(1, 2, Purpose.DRAFT),
        uniform(1, 3, Purpose.TARGET),
        uniform(2, 2, Purpose.TARGET),
        uniform(normalize_seed(-1), 2, Purpose.TARGET),
    }
    assert len(keys) == 5
    draws = [uniform(seed, pos, Purpose.TARGET) for seed in range(50) for pos in range(200)]
    assert all(0.0 <= x < 1.0 for x in draws)
    # Kolmogorov-Smirnov distance of 10000 draws: well under 0.02 for a uniform source.
    draws.sort()
    ks = max(
        max(abs((i + 1) / len(draws) - x), abs(i / len(draws) - x)) for i, x in enumerate(draws)
    )
    assert ks < 0.02
    # Consecutive positions are not correlated.
    pairs = [
        (uniform(5, t, Purpose.TARGET), uniform(5, t + 1, Purpose.TARGET)) for t in range(5000)
    ]
    mean_a = sum(a for a, _ in pairs) / len(pairs)
    mean_b = sum(b for _, b in pairs) / len(pairs)
    cov = sum((a - mean_a) * (b - mean_b) for a, b in pairs) / len(pairs)
    assert abs(cov / (1 / 12)) < 0.05
