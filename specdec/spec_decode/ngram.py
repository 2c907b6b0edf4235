"""Prompt lookup decoding (n-gram drafting; Saxena 2023, as vLLM's ``ngram`` method)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Longest suffix of length in [min_n, max_n] that occurred earlier; the up-to-k tokens that
    followed its most recent earlier occurrence. Vectorised: O(len * n) numpy work per call."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start at 0 .. length-n-1 end before the suffix itself begins or overlap it,
        # but never are it; each must be followed by at least one token.
        windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    free_drafts = True

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, inp: DraftInput) -> DraftOutput:
        drafts = [
            ngram_propose(
                np.asarray(r.token_ids, dtype=np.int64), self.min_n, self.max_n, r.max_num_drafts
            )
            for r in inp.requests
        ]
        return DraftOutput(drafts, [None] * len(drafts))
