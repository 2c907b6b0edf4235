"""Lossless verification of drafts (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318).

Plain decoding is the special case of zero drafts, so sampling with and without speculation
goes through the same transform and the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.sample.logprobs import LogitsAdjust, TokenLogprobs, row_logprobs
from specdec.sample.ops import argmax_rows_finite, one_thread, processed_logits
from specdec.sample.random import Purpose, uniform
from specdec.sample.sampler import NonFiniteLogits, row_probs, sample_row, search_cdf
from specdec.sampling_params import SamplingParams
from specdec.structured.grammar import TokenMask


@dataclass
class PenaltyState:
    """What penalties need to know about a request's history."""

    prompt_mask: torch.Tensor  # [V] bool
    output_counts: torch.Tensor  # [V] float32

    def rows(self, draft_token_ids: list[int]) -> torch.Tensor:  # [k+1, V]
        """Output counts seen by each verification row: row r also counts drafts[:r]."""
        k = len(draft_token_ids)
        counts = self.output_counts.unsqueeze(0).repeat(k + 1, 1)
        for r, tok in enumerate(draft_token_ids):
            counts[r + 1 :, tok] += 1
        return counts


@dataclass
class VerifyResult:
    token_ids: list[int]  # accepted drafts, then one recovered or bonus token
    num_accepted: int  # drafts accepted
    # per token, if asked: log p(token), its rank and the top-N under the raw target distribution
    logprobs: list[TokenLogprobs] | None


def verify(
    target_logits: torch.Tensor,  # [k+1, V]: rows for the last token and each draft
    draft_token_ids: list[int],  # k drafts
    draft_probs: torch.Tensor | None,  # [k, V] draft distributions q, or None for point-mass drafts
    sp: SamplingParams,
    penalty: PenaltyState | None,
    seed: int,  # the request's seed (see specdec.sample.random)
    position: int,  # output position of the first row's token
    adjust: LogitsAdjust | None = None,  # logit_bias / bad_words, before penalties
    mask: TokenMask | None = None,  # structured output: the tokens row r may take
) -> VerifyResult:
    """Greedy rows accept drafts while they equal the argmax. Random rows with point-mass
    drafts sample each position with its keyed uniform and accept a draft iff it equals that
    sample ("sample and match"): the output is exactly plain sampling's. With ``q`` they follow
    Leviathan/Chen (accept with probability min(1, p/q), else draw from norm(max(0, p - q))).
    With a grammar ``mask`` every row's distribution is the target's restricted to the tokens
    the grammar allows after the drafts before it, exactly as plain constrained decoding."""
    k = len(draft_token_ids)
    assert target_logits.shape[0] == k + 1
    counts = penalty.rows(draft_token_ids) if (penalty is not None and sp.has_penalties) else None
    seen = penalty.prompt_mask if penalty is not None else None
    base = target_logits if adjust is None else adjust.apply(target_logits.float(), draft_token_ids)
    if sp.is_greedy:
        tokens = _greedy(processed_logits(base, sp, seen, counts), draft_token_ids, mask)
    else:
        with one_thread(target_logits.device):
            if mask is not None:
                base = mask.apply(base)
            logits = processed_logits(base, sp, seen, counts)  # [k+1, V]
            if draft_probs is None:
                tokens = _sample_and_match(logits, draft_token_ids, sp, seed, position)
            else:
                tokens = _rejection(logits, draft_token_ids, draft_probs, sp, seed, position)
    logprobs = None
    if sp.logprobs is not None:
        logprobs = row_logprobs(target_logits[: len(tokens)], tokens, sp.logprobs)
    return VerifyResult(tokens, len(tokens) - 1, logprobs)


def _greedy(
    logits: torch.Tensor, draft_token_ids: list[int], mask: TokenMask | None = None
) -> list[int]:
    best, finite = argmax_rows_finite(logits)  # [k+1]
    if mask is not None:
        # NOTE: the row's first maximum is the allowed tokens' first maximum when the grammar
        # allows it (masking only lowers other tokens); only the other rows need the full mask.
        for r in range(len(best)):
            if not mask.allows(r, best[r]):
                best[r] = _masked_argmax(logits[r], mask, r)
                if r < len(draft_token_ids) and best[r] != draft_token_ids[r]:
                    break  # later rows are not read
        finite = _finite_at(logits, best)  # the rows the mask moved too
    if not finite:
        raise NonFiniteLogits()
    tokens: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        if draft != best[i]:
            break
        tokens.append(draft)
    tokens.append(best[len(tokens)])
    return tokens


def _masked_argmax(row: torch.Tensor, mask: TokenMask, r: int) -> int:  # row [V]
    allowed = mask.allowed(r, row.device)
    if not bool(allowed.any()):
        raise ValueError("structured output: the grammar allows no token here")
    return int(row.masked_fill(~allowed, float("-inf")).argmax())


def _finite_at(logits: torch.Tensor, cols: list[int]) -> bool:  # logits [R, V]
    """Whether logits[r, cols[r]] is finite for every row (an all-NaN row has no argmax)."""
    # NOTE: on the CPU a few scalar reads cost ~2 us, the gather below ~11 us; on a GPU each read
    # is a device sync, so one gather
    if len(cols) <= 8 and logits.device.type == "cpu":
        return all(math.isfinite(float(logits[r, c])) for r, c in enumerate(cols))
    chosen = logits[torch.arange(len(cols), device=logits.device), cols]  # [R]
    return bool(torch.isfinite(chosen).all())


def _sample_and_match(
    logits: torch.Tensor,  # [k+1, V] temperature-scaled
    draft_token_ids: list[int],
    sp: SamplingParams,
    seed: int,
    position: int,
) -> list[int]:
    tokens: list[int] = []
    for i in range(len(draft_token_ids) + 1):
        token = sample_row(logits[i], sp, uniform(seed, position + i, Purpose.TARGET))
        tokens.append(token)
        if i == len(draft_token_ids) or token != draft_token_ids[i]:
            break
    return tokens


def _rejection(
    logits: torch.Tensor,  # [k+1, V] temperature-scaled
    draft_token_ids: list[int],
    draft_probs: torch.Tensor,  # [k, V]
    sp: SamplingParams,
    seed: int,
    position: int,
) -> list[int]:
    tokens: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p = row_probs(logits[i], sp)  # [V] float64
        q = draft_probs[i].to(p.dtype)
        px, qx = float(p[x]), float(q[x])
        # NOTE: accept with probability min(1, p/q); q == 0 means the draft could not have
        # proposed x, so any p > 0 accepts.
        u = uniform(seed, position + i, Purpose.ACCEPT)
        if (qx > 0 and u * qx < px) or (qx <= 0 < px):
            tokens.append(x)
            continue
        residual = (p - q).clamp_min(0)
        if float(residual.sum()) > 0:
            tokens.append(_inverse_cdf(residual, uniform(seed, position + i, Purpose.RESIDUAL)))
        else:
            tokens.append(sample_row(logits[i], sp, uniform(seed, position + i, Purpose.TARGET)))
        return tokens
    k = len(draft_token_ids)
    tokens.append(sample_row(logits[k], sp, uniform(seed, position + k, Purpose.TARGET)))
    return tokens


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:  # weights [V] float64, not all 0
    cum = weights.cumsum(0)
    return search_cdf(weights, cum, u * float(cum[-1]))
