"""n-gram prompt lookup against a brute-force reference."""

from __future__ import annotations

import random

import numpy as np

from specdec.sampling_params import SamplingParams
from specdec.spec_decode.base import DraftInput, DraftRequest
from specdec.spec_decode.ngram import NgramProposer, ngram_propose


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


def test_proposer_index_grows_with_the_sequence() -> None:
    """Tokens arrive a few at a time (accepted runs); every lookup equals a fresh full scan."""
    rng = random.Random(1)
    proposer = NgramProposer(2, 4)
    for trial in range(30):
        req_id = f"r{trial % 3}"  # ids come back after remove_request
        tokens = [rng.randint(0, 5) for _ in range(rng.randint(1, 20))]
        for _ in range(25):
            k = rng.randint(0, 6)
            inp = DraftInput([DraftRequest(req_id, list(tokens), k, SamplingParams())])
            got = proposer.propose(inp).draft_token_ids[0]
            assert got == _brute(tokens, 2, 4, k), (tokens, k)
            tokens += [rng.randint(0, 5) for _ in range(rng.randint(1, 4))]
        proposer.remove_request(req_id)
    assert proposer.indexes == {}


def test_proposer_rebuilds_for_a_shorter_sequence() -> None:
    proposer = NgramProposer(1, 3)
    long = [1, 2, 3, 1, 2, 3, 4, 1, 2]
    short = [7, 8, 7]
    for tokens in (long, short):
        inp = DraftInput([DraftRequest("a", tokens, 3, SamplingParams())])
        assert proposer.propose(inp).draft_token_ids[0] == _brute(tokens, 1, 3, 3)
