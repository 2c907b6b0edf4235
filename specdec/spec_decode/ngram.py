"""Prompt lookup decoding (n-gram drafting; Saxena 2023, as vLLM's ``ngram`` method)."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer


class NgramIndex:
    """The most recent start of every n-gram (min_n <= n <= max_n) of a growing sequence that is
    followed by at least one token.

    A step appends a few tokens: ``extend`` indexes only the n-grams that gained a follower, so a
    lookup costs O(max_n) dictionary probes instead of a scan of the whole sequence.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.num_tokens = 0  # tokens of the sequence indexed so far
        self.last_start: dict[tuple[int, ...], int] = {}

    def extend(self, seq: Sequence[int]) -> None:
        """``seq``: the whole sequence so far, an extension of what was indexed before."""
        table = self.last_start
        # An n-gram ending at `end` gains its follower when token end + 1 arrives.
        for end in range(max(self.num_tokens - 1, 0), len(seq) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                table[tuple(seq[end - n + 1 : end + 1])] = end - n + 1
        self.num_tokens = len(seq)

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        """Longest suffix of ``seq`` (the indexed sequence) of length in [min_n, max_n] that
        occurred earlier; the up-to-k tokens that followed its most recent earlier occurrence."""
        length = len(seq)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.last_start.get(tuple(seq[length - n :]))
            if start is not None:
                return list(seq[start + n : start + n + k])
        return []


def ngram_propose(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """One lookup over a whole sequence (``NgramIndex.propose`` on a fresh index)."""
    seq = [int(t) for t in tokens]
    index = NgramIndex(min_n, max_n)
    index.extend(seq)
    return index.propose(seq, k)


class NgramProposer(Proposer):
    free_drafts = True

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, inp: DraftInput) -> DraftOutput:
        drafts = []
        for r in inp.requests:
            index = self.indexes.get(r.req_id)
            if index is None or index.num_tokens > len(r.token_ids):
                index = self.indexes[r.req_id] = NgramIndex(self.min_n, self.max_n)
            index.extend(r.token_ids)
            drafts.append(index.propose(r.token_ids, r.max_num_drafts))
        return DraftOutput(drafts, [None] * len(drafts))

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        self.indexes.pop(req_id, None)


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
