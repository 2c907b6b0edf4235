"""Log-probabilities users ask for (``logprobs``, ``prompt_logprobs``), and the per-request logit
adjustments (``logit_bias``, ``bad_words``).

Log-probabilities are vLLM's default, the raw target distribution: log_softmax of the model's
logits before penalties, bias, temperature or truncation. Each row is computed alone, on one
thread, so a position's values do not depend on how many rows its verification carried: with
speculation they are the values plain decoding computes (the kernels make the logits so).
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
    """Per row: log p(token), its rank and the ``num_top`` most likely tokens."""
    out: list[TokenLogprobs] = []
    with one_thread(logits.device):
        for r, token in enumerate(token_ids):
            lp = logits[r].float().log_softmax(dim=-1)  # [V]
            chosen = lp[token]
            rank = int((lp > chosen).sum()) + 1
            ids: list[int] = []
            values: list[float] = []
            if num_top:
                top_values, top_ids = lp.topk(min(num_top, lp.numel()))
                ids, values = top_ids.tolist(), top_values.tolist()
            out.append(TokenLogprobs(token, float(chosen), rank, ids, values))
    return out


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
