"""n-gram prompt lookup against a brute-force reference."""

from __future__ import annotations

import random

import numpy as np

from specdec.spec_decode.ngram import ngram_propose


def _brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_matches_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(400):
        length = rng.randint(1, 60)
        tokens = [rng.randint(0, 4) for _ in range(length)]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        got = ngram_propose(np.array(tokens), min_n, max_n, k)
        assert got == _brute(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_prefers_longest_suffix_and_most_recent_occurrence() -> None:
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0 -> followed by 9; [2, 3] more recently -> 8, but longer wins.
    assert ngram_propose(np.array(tokens), 1, 3, 2) == [9, 7]
    assert ngram_propose(np.array(tokens), 1, 2, 2) == [8, 5]
    assert ngram_propose(np.array([4, 5, 6]), 1, 3, 3) == []
    assert ngram_propose(np.array(tokens), 1, 3, 0) == []
