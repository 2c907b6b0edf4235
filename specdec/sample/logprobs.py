"""Log-probabilities users ask for (``logprobs``, ``prompt_logprobs``), and the per-request logit
adjustments (``logit_bias``, ``bad_words``).

Log-probabilities are vLLM's default, the raw target distribution: log_softmax of the model's
logits before penalties, bias, temperature or truncation. Every op works along one row, so a
position's values do not depend on how many rows its verification (or prompt chunk) carried:
with speculation they are the values plain decoding computes (the kernels make the logits so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sample.bad_words import BadWords
from specdec.sample.ops import one_thread


@dataclass
class TokenLogprobs:
    """One position: the chosen (or prompt) token's log-probability and rank, and the top-N."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens more likely than it
    top_token_ids: list[int]  # most likely first
    top_logprobs: list[float]


def row_logprobs(
    logits: torch.Tensor,  # [R, V] raw target logits
    token_ids: list[int],  # R: the token whose log-probability each row reports
    num_top: int,
) -> list[TokenLogprobs]:
    """Per row: log p(token), its rank and the ``num_top`` most likely tokens; all rows at once.

    NOTE: each op here reduces or sorts along a row, so a row's figures are the same whatever
    rows share the call (tested against one row at a time, ties included)."""
    assert logits.shape[0] == len(token_ids)
    if not token_ids:
        return []
    with one_thread(logits.device):
        lp = logits.float().log_softmax(dim=-1)  # [R, V]
        index = torch.tensor(token_ids, dtype=torch.long, device=lp.device).unsqueeze(1)
        chosen = lp.gather(1, index)  # [R, 1]
        ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
        top_ids: list[list[int]] = [[] for _ in token_ids]
        top_values: list[list[float]] = [[] for _ in token_ids]
        if num_top:
            values, ids = lp.topk(min(num_top, lp.shape[1]), dim=1)  # [R, N]
            top_ids, top_values = ids.tolist(), values.tolist()
    return [
        TokenLogprobs(token, logprob, rank, ids, values)
        for token, logprob, rank, ids, values in zip(
            token_ids, chosen.squeeze(1).tolist(), ranks, top_ids, top_values
        )
    ]


@dataclass
class LogitsAdjust:
    """What a request adds to its logits before penalties (vLLM's order): a bias per token id,
    and bad words (see ``specdec.sample.bad_words``)."""

    bias_token_ids: torch.Tensor | None = None  # [B] long
    bias_values: torch.Tensor | None = None  # [B] float32
    bad_words: BadWords | None = None
    output_tail: tuple[int, ...] = ()  # the last output tokens (bad_words.max_prefix_len)

    def apply(
        self,
        logits: torch.Tensor,  # [k+1, V] float32
        draft_token_ids: list[int],  # k: row r also saw drafts[:r]
    ) -> torch.Tensor:  # [k+1, V]
        if self.bias_token_ids is not None:
            logits = logits.index_add(1, self.bias_token_ids, _rows(self.bias_values, logits))
        if self.bad_words is not None:
            logits = self.bad_words.apply(logits, self.output_tail, draft_token_ids)
        return logits


def _rows(values: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:  # [R, B]
    assert values is not None
    return values.to(logits.dtype).unsqueeze(0).expand(logits.shape[0], -1)
