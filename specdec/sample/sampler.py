"""One token from one row of logits and one uniform: top-k, top-p and min-p, then the inverse CDF.

The token is a pure function of the row and ``u``, so a position sampled with the same uniform
gives the same token with or without speculation (see ``specdec.sample.random``).

Definitions (every path below computes exactly these):

- canonical order: logits descending, ties by token id ascending;
- top-k keeps the tokens whose logit is >= the k-th largest (ties at the k-th all stay);
- top-p keeps, in canonical order, each token whose preceding mass (within the top-k set) is
  below ``top_p`` times that set's mass (vLLM's rule: the top token always stays);
- min-p keeps the tokens whose probability is >= ``min_p`` times the top token's;
- sampling order: the leading tokens (those above the ``NUM_LEADING``-th largest logit) in
  canonical order, then every other kept token by id. The CDF is walked in that order with
  ``u`` times the kept mass, so a small ``u`` picks a likely token.

NOTE: a full sort of a 49k vocabulary costs ~3 ms on this CPU, as much as a decode step; the
truncation is found among the top ``NUM_LEADING`` (then ``NUM_CANDIDATES``) logits whenever
they decide it, and only otherwise among all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.sampling_params import SamplingParams

NUM_LEADING = 32
NUM_CANDIDATES = 1024


@dataclass
class _Candidates:
    ids: list[int]  # canonical order
    logits: list[float]
    weights: list[float]  # exp(logit - max logit), read from the row's weights
    complete: bool  # these are all the tokens of the row


@dataclass
class _Kept:
    """The kept tokens: ``positions`` into the candidates, or (``positions`` None) every token
    of the row whose weight is >= ``min_weight``."""

    cands: _Candidates
    positions: list[int] | None
    min_weight: float = 0.0


def _canonical(z: torch.Tensor, w: torch.Tensor, k: int) -> tuple[_Candidates, int]:
    """The tokens whose logit exceeds the k-th largest (every token when k covers the row),
    and how many of them lead the sampling order (logit above the NUM_LEADING-th largest)."""
    if k >= z.numel():
        vals, ids = torch.sort(z, descending=True, stable=True)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        complete = True
    else:
        vals, ids = torch.topk(z, k)
        floor = float(vals[-1])
        pairs = sorted((-v, i) for v, i in zip(vals.tolist(), ids.tolist()) if v > floor)
        vals_l, ids_l = [-v for v, _ in pairs], [i for _, i in pairs]
        complete = False
    weights = w[ids_l].tolist() if ids_l else []
    if z.numel() <= NUM_LEADING:
        num_lead = len(ids_l)
    else:
        lead_floor = float(vals[NUM_LEADING - 1])  # vals: descending, with multiplicity
        num_lead = sum(1 for v in vals_l if v > lead_floor)
    return _Candidates(ids_l, vals_l, weights, complete), num_lead


def _top_k_prefix(cands: _Candidates, top_k: int) -> int | None:
    """How many candidates top-k keeps, or None when tied tokens may lie outside them."""
    if top_k > len(cands.ids):
        return None
    kth = cands.logits[top_k - 1]
    end = top_k
    while end < len(cands.ids) and cands.logits[end] == kth:
        end += 1
    if end == len(cands.ids) and not cands.complete:
        return None
    return end


def _nucleus(weights: list[float], limit: int, threshold: float) -> int | None:
    """How many of the first `limit` tokens top-p keeps; None if it keeps all of them."""
    cum = 0.0
    for j in range(limit):
        if j > 0 and cum >= threshold:
            return j
        cum += weights[j]
    return None


def _truncate(
    cands: _Candidates, w: torch.Tensor, sp: SamplingParams, row_mass: float
) -> _Kept | None:
    """The kept set, or None when these candidates do not decide it."""
    n = len(cands.ids)
    prefix: int | None = None  # kept by top-k / top-p: the first `prefix` candidates
    if sp.top_k != -1 and sp.top_k < w.numel():
        prefix = _top_k_prefix(cands, sp.top_k)
        if prefix is None:
            return None
    if sp.top_p < 1.0:
        limit = prefix if prefix is not None else n
        mass = math.fsum(cands.weights[:limit]) if prefix is not None else row_mass
        nucleus = _nucleus(cands.weights, limit, sp.top_p * mass)
        if nucleus is None and prefix is None and not cands.complete:
            return None
        prefix = limit if nucleus is None else nucleus
    if prefix is None and not cands.complete:
        if sp.min_p <= 0.0:
            return _Kept(cands, None)
        # NOTE: the top token's weight is exp(0) = 1, so min-p keeps weights >= min_p.
        inside = sum(1 for x in cands.weights if x >= sp.min_p)
        if int((w >= sp.min_p).sum()) != inside:
            return _Kept(cands, None, sp.min_p)
        prefix = n
    end = n if prefix is None else prefix
    return _Kept(cands, [i for i in range(end) if cands.weights[i] >= sp.min_p])


class NonFiniteLogits(ValueError):
    """The model's logits hold NaN or infinity (the engine's own words: safe to show a client)."""

    def __init__(self) -> None:
        super().__init__("the logits are not finite")


def _kept_set(z: torch.Tensor, sp: SamplingParams) -> tuple[_Kept, torch.Tensor, int]:
    """(the kept set, the row's weights exp(z - max) [V], the number of leading tokens)."""
    num = z.numel()
    top = z.max()
    if not math.isfinite(float(top)):
        raise NonFiniteLogits()
    w = (z - top).exp_()  # [V]
    top_k = sp.top_k if sp.top_k != -1 and sp.top_k < num else 0
    needs_mass = sp.top_p < 1.0 and not top_k
    row_mass = float(w.sum(dtype=torch.float64)) if needs_mass else 0.0
    first = max(NUM_LEADING, top_k + 1)
    for k in sorted({min(first, num), min(max(first, NUM_CANDIDATES), num), num}):
        cands, num_lead = _canonical(z, w, k)  # NOTE: num_lead is the same for every k
        kept = _truncate(cands, w, sp, row_mass)
        if kept is not None:
            return kept, w, num_lead
    raise AssertionError("every token as a candidate always decides the kept set")


def _ordered(kept: _Kept, num_lead: int) -> tuple[list[int], list[float]]:
    """Kept candidates in sampling order: the leading ones canonically, then the rest by id."""
    cands, positions = kept.cands, kept.positions
    assert positions is not None
    head = [p for p in positions if p < num_lead]
    tail = sorted((cands.ids[p], cands.weights[p]) for p in positions if p >= num_lead)
    ids = [cands.ids[p] for p in head] + [i for i, _ in tail]
    weights = [cands.weights[p] for p in head] + [x for _, x in tail]
    return ids, weights


def _walk(ids: list[int], weights: list[float], x: float) -> int | None:
    cum = 0.0
    for i, wt in zip(ids, weights):
        cum += wt
        if x < cum:
            return i
    return None


def sample_row(z: torch.Tensor, sp: SamplingParams, u: float) -> int:  # z [V] float32
    """The token that uniform ``u`` picks from the row's truncated distribution. ``z`` holds
    the temperature-scaled (and penalised) logits."""
    return _sample(*_kept_set(z, sp), u)


def sample_row_and_probs(
    z: torch.Tensor, sp: SamplingParams, u: float
) -> tuple[int, torch.Tensor]:  # z [V] -> (token, probs [V] float64)
    """``sample_row`` and ``row_probs`` of one row, truncating it once (drafts sampled from q)."""
    kept, w, num_lead = _kept_set(z, sp)
    return _sample(kept, w, num_lead, u), _probs(kept, w)


def _sample(kept: _Kept, w: torch.Tensor, num_lead: int, u: float) -> int:
    if kept.positions is not None:
        ids, weights = _ordered(kept, num_lead)
        token = _walk(ids, weights, u * math.fsum(weights))
        return token if token is not None else ids[-1]
    head = [p for p in range(num_lead) if kept.cands.weights[p] >= kept.min_weight]
    head_ids = [kept.cands.ids[p] for p in head]
    head_w = [kept.cands.weights[p] for p in head]
    rest = w.double()  # [V]: the kept tokens outside the head
    rest[kept.cands.ids[:num_lead]] = 0.0
    if kept.min_weight > 0.0:
        rest[w < kept.min_weight] = 0.0
    head_mass, rest_mass = math.fsum(head_w), float(rest.sum())
    x = u * (head_mass + rest_mass)
    token = _walk(head_ids, head_w, x)
    if token is not None:
        return token
    if rest_mass <= 0.0:
        return head_ids[-1]  # x rounded up to the head's mass
    # NOTE: the prefix sums only when the head did not take x (the head holds most of the mass)
    return search_cdf(rest, rest.cumsum(0), x - head_mass)


def search_cdf(weights: torch.Tensor, cum: torch.Tensor, x: float) -> int:
    """The first index whose cumulative weight exceeds ``x`` (weights, cum [V] float64, some
    weight > 0); the last weighted index when rounding put ``x`` at or past the total."""
    target = torch.tensor([x], dtype=cum.dtype, device=cum.device)
    j = int(torch.searchsorted(cum, target, right=True))
    if j >= cum.numel() or weights[j] <= 0:
        return int(weights.nonzero()[-1])
    return j


def row_probs(z: torch.Tensor, sp: SamplingParams) -> torch.Tensor:  # [V] float64
    """The distribution ``sample_row`` samples from (for Leviathan/Chen acceptance tests)."""
    kept, w, _ = _kept_set(z, sp)
    return _probs(kept, w)


def _probs(kept: _Kept, w: torch.Tensor) -> torch.Tensor:  # w [V] -> [V] float64
    if kept.positions is not None:
        probs = torch.zeros(w.numel(), dtype=torch.float64, device=w.device)
        ids = [kept.cands.ids[p] for p in kept.positions]
        probs[ids] = torch.tensor(
            [kept.cands.weights[p] for p in kept.positions], dtype=torch.float64
        ).to(w.device)
    else:
        probs = w.double()
        if kept.min_weight > 0.0:
            probs[w < kept.min_weight] = 0.0
    return probs / probs.sum()
