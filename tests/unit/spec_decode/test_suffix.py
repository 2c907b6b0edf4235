"""Suffix trees and the suffix-decoding proposer, against brute-force references."""

from __future__ import annotations

import itertools
import random
import time
import tracemalloc

import pytest

from specdec.config import ConfigError, SpeculativeConfig
from specdec.sampling_params import SamplingParams
from specdec.spec_decode import make_proposer
from specdec.spec_decode.base import DraftInput, DraftRequest
from specdec.spec_decode.suffix import SuffixProposer, SuffixTree, _Node, _subtree_size


# ---- references -------------------------------------------------------------------------------
def brute_count(seqs: list[list[int]], path: tuple[int, ...]) -> int:
    if not path:
        return sum(len(s) for s in seqs)
    n = len(path)
    return sum(tuple(s[i : i + n]) == path for s in seqs for i in range(len(s) - n + 1))


def check_structure(tree: SuffixTree) -> None:
    """Nodes seen twice (and the root) hold every child with cont = the children's total; nodes
    seen once hold none; node / dict counters match."""
    stack: list[_Node] = [tree.root]
    while stack:
        node = stack.pop()
        children = node.children or {}
        if node is not tree.root and node.count < 2:
            assert not children
        assert node.cont == sum(c.count for c in children.values())
        if node.best is not None:
            assert node.best.count == max(c.count for c in children.values())
        for t, child in children.items():
            assert node.depth < child.depth <= tree.max_depth
            assert t == child.token == tree._token_at(child, node.depth + 1)
            assert child.count <= node.count
        stack.extend(children.values())
    assert _subtree_size(tree.root) == (tree.num_nodes, tree.num_dicts)
    assert tree.num_tokens == sum(len(s) for s in tree.seqs.values()) == tree.root.count


def random_tree(
    rng: random.Random, depth: int, alphabet: int, num_seqs: int, compressed: bool = False
):
    tree, seqs = SuffixTree(depth), []
    for seq_id in range(num_seqs):
        seq = [rng.randrange(alphabet) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.3 and seqs:  # repeats: long shared runs
            seq = rng.choice(seqs)[rng.randint(0, 5) :] + seq[:5]
        if compressed:
            tree.add_sequence(seq_id, seq)
        i = 0
        while i < len(seq) and not compressed:  # random chunks: incremental appends
            step = rng.randint(1, 5)
            tree.extend(seq_id, seq[i : i + step])
            i += step
        seqs.append(seq)
    return tree, seqs


def assert_counts_match(tree: SuffixTree, seqs: list[list[int]], alphabet: int) -> None:
    for length in range(tree.max_depth + 2):
        for path in itertools.product(range(alphabet), repeat=length):
            want = brute_count(seqs, path) if length <= tree.max_depth else 0
            assert tree.count(path) == want, path


def dump(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Materialized nodes by path -> count."""
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        out[path] = node.count
        for t, c in (node.children or {}).items():
            stack.append((path + (t,), c))
    return out


# ---- the tree ---------------------------------------------------------------------------------
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_counts_match_brute_force(seed: int, compressed: bool) -> None:
    rng = random.Random(seed)
    depth, alphabet = rng.randint(1, 5), rng.randint(1, 3)
    tree, seqs = random_tree(rng, depth, alphabet, rng.randint(1, 4), compressed)
    check_structure(tree)
    assert_counts_match(tree, seqs, alphabet)


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_fifo_removal_matches_brute_force(seed: int, compressed: bool) -> None:
    rng = random.Random(1000 + seed)
    depth, alphabet = rng.randint(1, 5), rng.randint(1, 3)
    tree, seqs = random_tree(rng, depth, alphabet, rng.randint(2, 5), compressed)
    for seq_id in range(rng.randint(1, len(seqs))):
        tree.remove(seq_id)
        check_structure(tree)
        assert_counts_match(tree, seqs[seq_id + 1 :], alphabet)
        assert sum(len(s) for s in tree.seqs.values()) == sum(len(s) for s in seqs[seq_id + 1 :])
    with pytest.raises(ValueError, match="oldest"):
        tree.remove(10**6)


@pytest.mark.parametrize("seed", range(30))
def test_interleaved_adds_and_evictions(seed: int) -> None:
    """The global tree's life: whole sequences (often sharing runs) come and go, FIFO."""
    rng = random.Random(5000 + seed)
    depth, alphabet = rng.randint(1, 6), rng.randint(1, 3)
    tree, seqs, live = SuffixTree(depth), [], []
    for _ in range(rng.randint(3, 10)):
        if live and rng.random() < 0.35:
            tree.remove(live.pop(0))
        else:
            seq = [rng.randrange(alphabet) for _ in range(rng.randint(0, 20))]
            if seqs and rng.random() < 0.5:
                src = rng.choice(seqs)
                i = rng.randint(0, len(src))
                seq = src[i : i + rng.randint(0, 25)] + seq[: rng.randint(0, 3)]
            tree.add_sequence(len(seqs), seq)
            live.append(len(seqs))
            seqs.append(seq)
        check_structure(tree)
    assert_counts_match(tree, [seqs[i] for i in live], alphabet)


def test_runs_where_every_occurrence_ends_can_grow_later() -> None:
    tree = SuffixTree(4)
    for seq_id, seq in enumerate(([1, 2], [1, 2], [1, 2, 3], [5, 1, 2, 3])):
        tree.add_sequence(seq_id, seq)
        check_structure(tree)
    assert (tree.count([1, 2]), tree.count([1, 2, 3]), tree.count([2, 3])) == (4, 2, 2)
    # probabilities count the occurrences that go on (two of four ended after [1, 2])
    assert tree.draft(tree.match_states([9, 1, 2])[0], 4, 0.0) == ([3], [1.0])


@pytest.mark.parametrize("compressed", [False, True])
def test_removing_everything_leaves_an_empty_root(compressed: bool) -> None:
    rng = random.Random(7)
    tree, seqs = random_tree(rng, 4, 2, 4, compressed)
    for seq_id in range(len(seqs)):
        tree.remove(seq_id)
    assert tree.root.count == 0 and not tree.root.children
    assert (tree.num_nodes, tree.num_dicts) == (1, 1)


@pytest.mark.parametrize("seed", range(10))
def test_incremental_equals_from_scratch(seed: int) -> None:
    rng = random.Random(2000 + seed)
    seq = [rng.randrange(4) for _ in range(200)]
    one_by_one, at_once = SuffixTree(6), SuffixTree(6)
    for t in seq:
        one_by_one.extend(0, [t])
    at_once.extend(0, seq)
    assert dump(one_by_one) == dump(at_once)
    assert one_by_one.num_nodes == at_once.num_nodes


@pytest.mark.parametrize("seed", range(10))
def test_cursors_find_every_suffix(seed: int) -> None:
    """suffix_states (own tree) and match_states / follow (another tree) give every suffix."""
    rng = random.Random(3000 + seed)
    depth = 5
    tree, seqs = random_tree(rng, depth, 3, 3)
    query = [rng.randrange(3) for _ in range(12)]
    states: list = []
    for i, t in enumerate(query):
        states = tree.follow(states, t)
        found = [st[1] for st in states]
        prefix = query[: i + 1]
        want = [
            m
            for m in range(min(depth - 1, len(prefix)), 0, -1)
            if brute_count(seqs, tuple(prefix[-m:]))
        ]
        assert found == want
        assert [st[1] for st in tree.match_states(prefix)] == want
    own = tree.suffix_states(len(seqs) - 1)
    last = seqs[-1]
    assert [st[1] for st in own] == list(range(min(depth - 1, len(last)), 0, -1))


@pytest.mark.parametrize("seed", range(20))
def test_compressed_and_incremental_trees_draft_alike(seed: int) -> None:
    """Same sequences, both ways in: same positions, and the same drafts from each."""
    rng = random.Random(4000 + seed)
    depth = rng.randint(2, 8)
    compressed, seqs = random_tree(rng, depth, 3, 5, compressed=True)
    incremental = SuffixTree(depth)
    for seq_id, seq in enumerate(seqs):
        incremental.extend(seq_id, seq)
        incremental.close(seq_id)
    for _ in range(20):
        query = [rng.randrange(3) for _ in range(rng.randint(1, 10))]
        a, b = compressed.match_states(query), incremental.match_states(query)
        assert [st[1] for st in a] == [st[1] for st in b]
        for sa, sb in zip(a, b):
            for k, p in ((1, 0.0), (4, 0.0), (8, 0.3)):
                assert compressed.draft(sa, k, p) == incremental.draft(sb, k, p)


def test_compressed_tree_stores_repeats_in_runs() -> None:
    rng = random.Random(6)
    text = [rng.randrange(1000) for _ in range(1500)]
    incremental, compressed = SuffixTree(24), SuffixTree(24)
    for seq_id in range(3):
        incremental.extend(seq_id, text)
        compressed.add_sequence(seq_id, text)
    assert incremental.num_nodes > 10 * len(text)  # one node per repeated substring
    assert compressed.num_nodes < 3 * len(text)
    with pytest.raises(ValueError, match="not both"):
        compressed.extend(9, [1])


@pytest.mark.parametrize("compressed", [False, True])
def test_memory_is_bounded_and_measured(compressed: bool) -> None:
    rng = random.Random(5)
    text = [rng.randrange(1000) for _ in range(1500)]
    for seqs in ([text], [text + text], [text, text[100:], text]):
        tracemalloc.start()
        tree = SuffixTree(8)
        for seq_id, seq in enumerate(seqs):
            if compressed:
                tree.add_sequence(seq_id, seq)
            else:
                tree.extend(seq_id, seq)
                tree.close(seq_id)
        actual, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        stats = tree.memory_stats()
        num_tokens = sum(len(s) for s in seqs)
        # unique tails cost no nodes; a repeat costs up to one node per depth, or one per run
        assert stats["num_nodes"] <= (3 if compressed else 8) * num_tokens + 1
        assert 0.75 < stats["approx_bytes"] / actual < 1.33, (stats, actual)
    assert SuffixTree(8).memory_stats()["num_nodes"] == 1


# ---- drafting ---------------------------------------------------------------------------------
def propose(prop: SuffixProposer, req_id: str, tokens: list[int], cap: int = 8) -> list[int]:
    req = DraftRequest(req_id, list(tokens), cap, SamplingParams(temperature=0.0))
    out = prop.propose(DraftInput([req]))
    assert out.draft_probs == [None]
    return out.draft_token_ids[0]


def test_drafts_the_longest_match_continuation() -> None:
    # [1, 2, 3] occurred followed by 4 5 6; [2, 3] also occurred followed by 9.
    prop = SuffixProposer(4, max_tree_depth=16, min_token_prob=0.0)
    seq = [1, 2, 3, 4, 5, 6, 0, 2, 3, 9, 0, 1, 2, 3]
    assert propose(prop, "a", seq, cap=3) == [4, 5, 6]
    draft = prop.last_drafts["a"]
    assert (draft.match_len, draft.source, draft.score) == (3, "request", 3.0)
    assert prop.last_scores["a"] == 3.0


def test_most_frequent_continuation_and_probability() -> None:
    prop = SuffixProposer(4, max_tree_depth=16, min_token_prob=0.0, max_spec_offset=4)
    # after 7: 8 three times, 9 once; no longer suffix occurred before
    seq = [7, 8, 1, 7, 9, 2, 7, 8, 3, 7, 8, 4, 7]
    assert propose(prop, "a", seq, cap=1) == [8]
    draft = prop.last_drafts["a"]
    assert draft.probs == [pytest.approx(0.75)]


def test_min_token_prob_cuts_the_draft() -> None:
    # after 5: 6 twice; after 5 6: 1 once, 2 once -> running probability 1.0, then 0.5
    seq = [5, 6, 1, 8, 5, 6, 2, 9, 5]
    prop = SuffixProposer(4, max_tree_depth=16, min_token_prob=0.6, max_spec_offset=4)
    assert propose(prop, "a", seq) == [6]
    prop = SuffixProposer(4, max_tree_depth=16, min_token_prob=0.5, max_spec_offset=4)
    # ties go to the most recent continuation (2), then its single occurrence is copied (9 5)
    assert propose(prop, "a", seq) == [6, 2, 9, 5]
    assert prop.last_drafts["a"].probs == [1.0, 0.5, 0.5, 0.5]
    assert prop.last_scores["a"] == 2.5


def test_spec_factor_caps_draft_length() -> None:
    seq = list(range(10, 30)) + [0, 10, 11]  # suffix [10, 11] matches with 18 tokens after it
    prop = SuffixProposer(16, max_tree_depth=32, max_spec_factor=1.0)
    assert propose(prop, "a", seq, cap=16) == [12, 13]  # 1.0 * match length 2
    prop = SuffixProposer(16, max_tree_depth=32, max_spec_factor=2.5)
    assert propose(prop, "a", seq, cap=16) == [12, 13, 14, 15, 16]
    prop = SuffixProposer(16, max_tree_depth=32, max_spec_factor=1.0, max_spec_offset=3)
    assert propose(prop, "a", seq, cap=16) == [12, 13, 14, 15, 16]
    prop = SuffixProposer(3, max_tree_depth=32, max_spec_factor=4.0)
    assert propose(prop, "a", seq, cap=16) == [12, 13, 14]  # num_speculative_tokens
    assert propose(prop, "a", seq, cap=2) == [12, 13]  # the step's max_num_drafts
    assert propose(prop, "a", seq, cap=0) == []


def test_tree_depth_caps_match_plus_draft() -> None:
    # a long repeat: the longest matches leave no room under the depth cap; shorter ones win
    block = list(range(100, 130))
    prop = SuffixProposer(5, max_tree_depth=8, max_spec_factor=2.0)
    draft = propose(prop, "a", block + block[:20], cap=5)
    assert draft == block[20:25]
    assert prop.last_drafts["a"].match_len == 3  # 3 + 5 = 8: the longest that fits 5 tokens
    prop = SuffixProposer(5, max_tree_depth=8, max_spec_factor=1.0)
    assert propose(prop, "a", block + block[:20], cap=5) == block[20:24]  # min(m, 8 - m) <= 4


def test_global_tree_serves_later_requests() -> None:
    prop = SuffixProposer(5, max_tree_depth=16)
    prompt, answer = [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47]
    propose(prop, "a", prompt + answer[:1])  # first seen after prefill: prompt = all but one
    propose(prop, "a", prompt + answer)
    prop.remove_request("a")
    assert "a" not in prop.last_drafts and "a" not in prop.last_scores
    assert prop.memory_stats()["cached_requests"] == 1
    # another request with a different prompt reaches the same answer prefix
    assert propose(prop, "b", [9, 9, 40, 41, 42]) == [43, 44, 45]
    assert prop.last_drafts["b"].source == "global"
    # the prompt itself did not go into the global tree
    assert propose(prop, "c", [7, 1, 2]) == []


@pytest.mark.parametrize("native", [False, True])
def test_reset_cache_forgets_earlier_responses_only(native: bool) -> None:
    from specdec.spec_decode.suffix import native_available

    if native and not native_available():
        pytest.fail("the native suffix trees are not built")
    prop = SuffixProposer(5, max_tree_depth=16, native=native)
    prompt, answer = [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47]
    propose(prop, "a", prompt + answer[:1])
    propose(prop, "a", prompt + answer)
    prop.remove_request("a")
    own = [60, 61, 62, 63, 64, 60, 61]  # its own repeat: drafts 62 63 64 from its own tree
    assert propose(prop, "b", [9, 9, *own]) == [62, 63]
    assert propose(prop, "c", [9, 9, 40, 41, 42]) == [43, 44, 45]
    prop.reset_cache()
    assert prop.memory_stats()["cached_requests"] == 0
    assert propose(prop, "c", [9, 9, 40, 41, 42, 43]) == []  # the global tree is empty
    assert propose(prop, "b", [9, 9, *own, 62]) == [63, 64, 60]  # running requests keep theirs
    prop.remove_request("c")
    assert propose(prop, "d", [5, 40, 41, 42]) == [43]  # c's answer so far: new cache works


def test_own_tree_wins_ties_and_global_needs_a_better_score() -> None:
    prop = SuffixProposer(3, max_tree_depth=16)
    propose(prop, "a", [0, 5])  # prompt [0]
    propose(prop, "a", [0, 5, 6, 7, 8, 9, 10])
    prop.remove_request("a")  # global: 5 6 7 8 9 10
    # own history says 5 6 7 -> 1 2 3, the global tree 5 6 7 -> 8 9 10: same score, own wins
    assert propose(prop, "b", [5, 6, 7, 1, 2, 3, 5, 6, 7]) == [1, 2, 3]
    assert prop.last_drafts["b"].source == "request"


def test_max_cached_requests_evicts_fifo_and_zero_disables() -> None:
    prop = SuffixProposer(4, max_tree_depth=16, max_cached_requests=2)
    answers = {f"r{i}": [100 * (i + 1) + j for j in range(6)] for i in range(3)}
    for req_id, answer in answers.items():
        propose(prop, req_id, [1] + answer[:1])
        propose(prop, req_id, [1] + answer)
        prop.remove_request(req_id)
    assert prop.memory_stats()["cached_requests"] == 2
    assert propose(prop, "q0", [3, 100, 101]) == []  # r0 was evicted
    assert propose(prop, "q1", [3, 200, 201]) == [202, 203]
    assert propose(prop, "q2", [3, 300, 301]) == [302, 303]

    off = SuffixProposer(4, max_tree_depth=16, max_cached_requests=0)
    propose(off, "r", [1, 100])
    propose(off, "r", [1, 100, 101, 102, 103])
    off.remove_request("r")
    assert off.memory_stats()["cached_requests"] == 0
    assert off.memory_stats()["global_nodes"] == 1
    assert propose(off, "q", [3, 100, 101]) == []


def test_global_tree_byte_budget_evicts_oldest() -> None:
    prop = SuffixProposer(4, max_tree_depth=16, max_global_bytes=20_000)
    rng = random.Random(4)
    for i in range(20):
        answer = [rng.randrange(50_000) for _ in range(40)]
        propose(prop, f"r{i}", [1] + answer[:1])
        propose(prop, f"r{i}", [1] + answer)
        prop.remove_request(f"r{i}")
        assert prop.global_tree.approx_bytes <= 20_000
    cached = prop.memory_stats()["cached_requests"]
    assert 1 <= cached < 20
    assert propose(prop, "q", [3] + answer[10:13]) == answer[13:16]  # the newest is kept


# ---- cache_salt: one global tree per tenant ------------------------------------------------------
def salted(
    prop: SuffixProposer, req_id: str, tokens: list[int], salt: int, cap: int = 8
) -> list[int]:
    req = DraftRequest(req_id, list(tokens), cap, SamplingParams(temperature=0.0))
    req.cache_salt = salt
    return prop.propose(DraftInput([req])).draft_token_ids[0]


def finish(prop: SuffixProposer, req_id: str, prompt: list[int], answer: list[int], salt: int):
    salted(prop, req_id, prompt + answer[:1], salt)
    salted(prop, req_id, prompt + answer, salt)
    prop.remove_request(req_id, prompt + answer)


@pytest.mark.parametrize("native", [False, True])
def test_salts_keep_global_trees_apart(native: bool) -> None:
    prop = SuffixProposer(5, max_tree_depth=16, native=native)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    finish(prop, "a", [1, 2, 3], answer, salt=11)
    probe = [9, 9, 40, 41, 42]
    assert salted(prop, "other-tenant", probe, salt=22) == []
    assert salted(prop, "unsalted", probe, salt=0) == []
    assert salted(prop, "same-tenant", probe, salt=11) == [43, 44, 45]
    assert prop.last_drafts["same-tenant"].source == "global"
    # the other tenant's own response joins its own tree, and only that
    finish(prop, "b", [1, 2, 3], [40, 41, 42, 50, 51, 52], salt=22)
    assert salted(prop, "other-tenant-2", probe, salt=22) == [50, 51, 52]
    assert salted(prop, "same-tenant-2", probe, salt=11) == [43, 44, 45]
    # unsalted requests share one tree
    finish(prop, "c", [5], [40, 41, 42, 60, 61, 62], salt=0)
    assert salted(prop, "unsalted-2", probe, salt=0) == [60, 61, 62]
    assert prop.memory_stats()["global_partitions"] == 3


@pytest.mark.parametrize("native", [False, True])
def test_caps_hold_over_all_partitions_oldest_first(native: bool) -> None:
    prop = SuffixProposer(4, max_tree_depth=16, max_cached_requests=2, native=native)
    for i, salt in enumerate((7, 8, 0)):
        finish(prop, f"r{i}", [1], [100 * (i + 1) + j for j in range(6)], salt)
    stats = prop.memory_stats()
    assert stats["cached_requests"] == 2
    assert stats["global_partitions"] == 2  # salt 7's only response went: its tree is dropped
    assert salted(prop, "q7", [3, 100, 101], 7) == []
    assert salted(prop, "q8", [3, 200, 201], 8) == [202, 203]
    assert salted(prop, "q0", [3, 300, 301], 0) == [302, 303]


@pytest.mark.parametrize("native", [False, True])
def test_byte_budget_holds_over_all_partitions(native: bool) -> None:
    prop = SuffixProposer(4, max_tree_depth=16, max_global_bytes=20_000, native=native)
    rng = random.Random(4)
    for i in range(40):
        answer = [rng.randrange(50_000) for _ in range(40)]
        finish(prop, f"r{i}", [1], answer, salt=i % 5)
        stats = prop.memory_stats()
        assert stats["global_bytes"] <= 20_000
        assert stats["global_partitions"] <= stats["cached_requests"] + 1
    assert 1 <= prop.memory_stats()["cached_requests"] < 40
    assert salted(prop, "q", [3] + answer[10:13], 39 % 5) == answer[13:16]  # the newest is kept


@pytest.mark.parametrize("native", [False, True])
def test_cursor_of_a_dropped_and_remade_partition_is_rebuilt(native: bool) -> None:
    """A running request's partition is emptied (its tree dropped) and remade for the same salt:
    the new tree's epochs start over, so the request's cursor must be matched again in it."""
    prop = SuffixProposer(4, max_tree_depth=16, max_cached_requests=1, native=native)
    finish(prop, "old", [1], [50, 51, 52, 53, 54], salt=5)
    assert salted(prop, "q", [2, 60, 61], salt=5) == []  # its cursor is in salt 5's first tree
    finish(prop, "x", [1], [70, 71, 72], salt=6)  # evicts "old": salt 5's tree is dropped
    finish(prop, "y", [1], [61, 62, 63, 64, 65], salt=5)  # a new tree for salt 5 (evicts "x")
    assert salted(prop, "q", [2, 60, 61, 62], salt=5) == [63, 64]


def test_unknown_and_unseen_requests_are_harmless() -> None:
    prop = SuffixProposer(4)
    prop.add_request("x")
    prop.remove_request("x")  # never proposed for
    prop.remove_request("never-added")
    assert prop.memory_stats()["cached_requests"] == 0


def test_batch_and_incremental_updates() -> None:
    """Per-request state follows appends of any size; results equal a fresh proposer's."""
    rng = random.Random(11)
    seqs = {r: [rng.randrange(6) for _ in range(60)] for r in ("a", "b", "c")}
    prop = SuffixProposer(5, max_tree_depth=10, min_token_prob=0.2)
    lens = dict.fromkeys(seqs, 20)
    while any(n < 60 for n in lens.values()):
        reqs = [
            DraftRequest(r, seqs[r][: lens[r]], 5, SamplingParams(temperature=0.0)) for r in seqs
        ]
        out = prop.propose(DraftInput(reqs))
        for r, draft in zip(seqs, out.draft_token_ids):
            fresh = SuffixProposer(5, max_tree_depth=10, min_token_prob=0.2)
            assert draft == propose(fresh, r, seqs[r][: lens[r]], cap=5)
            lens[r] = min(60, lens[r] + rng.randint(1, 4))


def test_global_cursor_survives_inserts_and_evictions() -> None:
    """A running request's position in the global tree is rebuilt when the tree changes."""
    prop = SuffixProposer(4, max_tree_depth=16, max_cached_requests=1)
    for req_id, answer in (("a", [50, 51, 52, 53, 54]), ("b", [60, 61, 62, 63, 64])):
        propose(prop, req_id, [1] + answer[:1])
        propose(prop, req_id, [1] + answer)
    propose(prop, "q", [2, 50, 51])  # nothing cached yet
    prop.remove_request("a")
    assert propose(prop, "q", [2, 50, 51, 52]) == [53, 54]
    prop.remove_request("b")  # evicts a
    assert propose(prop, "q", [2, 50, 51, 52, 60, 61]) == [62, 63]


def test_per_step_cost_on_a_long_sequence() -> None:
    rng = random.Random(3)
    words = [rng.randrange(5000) for _ in range(300)]
    seq = [rng.choice(words) for _ in range(2000)]
    prop = SuffixProposer(5)
    propose(prop, "a", seq)
    start = time.perf_counter()
    for _ in range(100):
        seq = seq + [rng.choice(words) for _ in range(rng.randint(1, 3))]
        propose(prop, "a", seq, cap=5)
    per_step = (time.perf_counter() - start) / 100
    assert per_step < 5e-3, per_step  # ~0.05 ms measured; generous for shared CPUs


# ---- config -----------------------------------------------------------------------------------
def test_config_keys_defaults_and_errors() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "suffix"})
    assert (
        cfg.suffix_decoding_max_tree_depth,
        cfg.suffix_decoding_max_cached_requests,
        cfg.suffix_decoding_max_spec_factor,
        cfg.suffix_decoding_min_token_prob,
    ) == (24, 10000, 1.0, 0.1)
    prop = make_proposer(cfg, None, None, 4, 256)
    assert isinstance(prop, SuffixProposer) and prop.max_tree_depth == 24
    bad = {
        "suffix_decoding_max_tree_depth": 0,
        "suffix_decoding_max_cached_requests": -1,
        "suffix_decoding_max_spec_factor": -0.5,
        "suffix_decoding_min_token_prob": 1.5,
    }
    for key, value in bad.items():
        with pytest.raises(ConfigError, match=key):
            SpeculativeConfig.from_dict({"method": "suffix", key: value})
    with pytest.raises(ConfigError, match="suffix_decoding_max_tree_depth"):
        SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 2.5})
