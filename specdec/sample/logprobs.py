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
    and bad words (token sequences whose last token is banned where the output so far ends with
    the rest)."""

    bias_token_ids: torch.Tensor | None = None  # [B] long
    bias_values: torch.Tensor | None = None  # [B] float32
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    output_tail: tuple[int, ...] = ()  # the last output tokens (as many as the longest prefix)

    def apply(
        self,
        logits: torch.Tensor,  # [k+1, V] float32
        draft_token_ids: list[int],  # k: row r also saw drafts[:r]
    ) -> torch.Tensor:  # [k+1, V]
        if self.bias_token_ids is not None:
            logits = logits.index_add(1, self.bias_token_ids, _rows(self.bias_values, logits))
        if self.bad_words_token_ids:
            banned = banned_rows(
                self.bad_words_token_ids, self.output_tail, draft_token_ids, logits.shape[0]
            )
            if banned:
                logits = logits.clone()
                rows, cols = zip(*banned)
                logits[list(rows), list(cols)] = float("-inf")
        return logits


def _rows(values: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:  # [R, B]
    assert values is not None
    return values.to(logits.dtype).unsqueeze(0).expand(logits.shape[0], -1)


def banned_rows(
    bad_words: tuple[tuple[int, ...], ...],
    output_tail: tuple[int, ...],
    draft_token_ids: list[int],
    num_rows: int,
) -> list[tuple[int, int]]:
    """(row, token) pairs to ban: row r follows the output plus drafts[:r]; a bad word's last
    token is banned where what precedes it matches the end of that history (vLLM's rule: a
    one-token word always, a longer one only after its prefix)."""
    banned = []
    for r in range(num_rows):
        history = output_tail + tuple(draft_token_ids[:r])
        for word in bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(history) and (
                not prefix or history[len(history) - len(prefix) :] == prefix
            ):
                banned.append((r, word[-1]))
    return banned


def bad_words_token_ids(words: list[str], encode) -> tuple[tuple[int, ...], ...]:  # noqa: ANN001
    """vLLM's tokenization of ``bad_words``: each word as is and, where that gives a different
    first token of the same length, after a space (a word in the middle of text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if plain:
            out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)
