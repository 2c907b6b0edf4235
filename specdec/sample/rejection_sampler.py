"""Lossless verification of drafts (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318).

Plain decoding is the special case of zero drafts, so sampling with and without speculation
goes through the same transform and the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sample.ops import argmax_rows, processed_logits


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
    logprobs: list[float] | None  # log p(token) under the raw target distribution, if asked


def verify(
    target_logits: torch.Tensor,  # [k+1, V]: rows for the last token and each draft
    draft_token_ids: list[int],  # k drafts
    draft_probs: torch.Tensor | None,  # [k, V] draft distributions q, or None for point-mass drafts
    sp,  # SamplingParams
    penalty: PenaltyState | None,
    generator: torch.Generator | None,
) -> VerifyResult:
    k = len(draft_token_ids)
    assert target_logits.shape[0] == k + 1
    counts = penalty.rows(draft_token_ids) if (penalty is not None and sp.has_penalties) else None
    mask = penalty.prompt_mask if penalty is not None else None
    logits = processed_logits(target_logits, sp, mask, counts)  # [k+1, V]
    if sp.is_greedy:
        tokens = _greedy(logits, draft_token_ids)
    else:
        tokens = _random(logits.softmax(dim=-1), draft_token_ids, draft_probs, generator)
    logprobs = None
    if sp.logprobs is not None:
        raw = target_logits[: len(tokens)].float().log_softmax(dim=-1)
        idx = torch.tensor(tokens, device=raw.device).unsqueeze(1)
        logprobs = raw.gather(1, idx).squeeze(1).tolist()
    return VerifyResult(tokens, len(tokens) - 1, logprobs)


def _greedy(logits: torch.Tensor, draft_token_ids: list[int]) -> list[int]:
    best = argmax_rows(logits)  # [k+1]
    tokens: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        if draft != best[i]:
            break
        tokens.append(draft)
    tokens.append(best[len(tokens)])
    return tokens


def _random(
    probs: torch.Tensor,  # [k+1, V]
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,  # [k, V]
    generator: torch.Generator | None,
) -> list[int]:
    tokens: list[int] = []
    k = len(draft_token_ids)
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist() if k else []
    for i, x in enumerate(draft_token_ids):
        p = float(probs[i, x])
        q = float(draft_probs[i, x]) if draft_probs is not None else 1.0
        # NOTE: accept with probability min(1, p/q); q == 0 means the draft could not have
        # proposed x, so any p > 0 accepts.
        if (q > 0 and uniforms[i] * q < p) or (q <= 0 < p):
            tokens.append(x)
            continue
        if draft_probs is not None:
            residual = (probs[i] - draft_probs[i].to(probs.dtype)).clamp_min(0)
        else:
            residual = probs[i].clone()
            residual[x] = 0.0
        total = float(residual.sum())
        dist = residual / total if total > 0 else probs[i]
        tokens.append(int(torch.multinomial(dist, 1, generator=generator).item()))
        return tokens
    tokens.append(int(torch.multinomial(probs[k], 1, generator=generator).item()))
    return tokens
