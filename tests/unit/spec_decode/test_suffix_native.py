"""The native suffix trees (csrc/suffix_tree.cpp) against the Python reference, operation by
operation: same nodes, same counts, same cursors, same drafts, same proposer outputs."""

from __future__ import annotations

import functools
import random
import sys
from typing import Any

import pytest

from specdec.sampling_params import SamplingParams

# NOTE: no skip: the package's install builds the module, so a missing one is a failure.
from specdec.spec_decode import _suffix_native as native
from specdec.spec_decode import suffix as suffix_mod
from specdec.spec_decode.base import DraftInput, DraftRequest
from specdec.spec_decode.suffix import SuffixProposer, SuffixTree

DRAFT_SETTINGS = ((1, 0.0), (3, 0.0), (8, 0.0), (8, 0.3), (24, 0.1))


# ---- sequences --------------------------------------------------------------------------------
def random_seq(rng: random.Random, alphabet: int, n: int) -> list[int]:
    return [rng.randrange(alphabet) for _ in range(n)]


class Text:
    """Natural-ish token streams: phrases from a shared bank, with some noise between them."""

    def __init__(self, rng: random.Random, vocab: int = 300, num_phrases: int = 25) -> None:
        self.rng = rng
        self.vocab = vocab
        self.phrases = [random_seq(rng, vocab, rng.randint(2, 12)) for _ in range(num_phrases)]

    def __call__(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.rng.random() < 0.8:
                out += self.rng.choice(self.phrases)
            else:
                out += random_seq(self.rng, self.vocab, self.rng.randint(1, 4))
        return out[:n]


def make_seqs(rng: random.Random, kind: str, num: int, max_len: int) -> list[list[int]]:
    text = Text(rng)
    seqs: list[list[int]] = []
    for _ in range(num):
        n = rng.randint(0 if kind == "small" else 1, max_len)
        seq = random_seq(rng, rng.randint(1, 3), n) if kind == "small" else text(n)
        if seqs and rng.random() < 0.3:  # long shared runs, as when a response is repeated
            src = rng.choice(seqs)
            i = rng.randint(0, len(src))
            seq = src[i : i + rng.randint(0, max_len)] + seq[: rng.randint(0, 4)]
        seqs.append(seq)
    return seqs


# ---- comparing trees --------------------------------------------------------------------------
def py_dump(tree: SuffixTree) -> dict[tuple[int, ...], tuple[int, int, int]]:
    """Materialized nodes: path of edge keys -> (depth, count, cont)."""
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        out[path] = (node.depth, node.count, node.cont)
        for t, c in (node.children or {}).items():
            stack.append((path + (t,), c))
    return out


def native_dump(tree: Any) -> dict[tuple[int, ...], tuple[int, int, int]]:
    out = {tuple(path): (depth, count, cont) for path, depth, count, cont in tree.dump()}
    assert len(out) == tree.num_nodes
    return out


def assert_same_tree(py: SuffixTree, nat: Any, seqs: list[list[int]], rng: random.Random) -> int:
    """Same nodes and counters, and the same count for every substring of the live sequences
    (and a little longer, and random paths). Returns how many paths had a non-zero count."""
    assert native_dump(nat) == py_dump(py)
    assert (nat.num_nodes, nat.num_tokens, nat.epoch) == (py.num_nodes, py.num_tokens, py.epoch)
    paths: set[tuple[int, ...]] = {()}
    for seq in seqs:
        for i in range(len(seq)):
            for n in range(1, py.max_depth + 2):
                if i + n <= len(seq):
                    paths.add(tuple(seq[i : i + n]))
    alphabet = max((max(s) for s in seqs if s), default=0) + 2
    for _ in range(200):
        paths.add(tuple(rng.randrange(alphabet) for _ in range(rng.randint(1, py.max_depth + 1))))
    nonzero = 0
    for path in paths:
        want = py.count(path)
        assert nat.count(list(path)) == want, path
        nonzero += want > 0
    return nonzero


def compare_drafts(py: SuffixTree, states: list, nat_draft: Any) -> tuple[int, int]:
    """Drafts from each position in ``states`` (Python) / ``nat_draft(i, k, p)`` (native), with
    several (length, probability) settings, in the same order on both sides (drafting caches
    recomputed ``best`` children, as in Python). Returns (drafts compared, non-empty ones)."""
    compared = nonempty = 0
    for i, state in enumerate(states):
        for k, p in DRAFT_SETTINGS:
            want = py.draft(state, k, p)
            got = nat_draft(i, k, p)
            assert (list(got[0]), list(got[1])) == (list(want[0]), list(want[1])), (i, k, p)
            compared += 1
            nonempty += bool(want[0])
    return compared, nonempty


# ---- trees ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["small", "text"])
@pytest.mark.parametrize("depth", [1, 2, 4, 7, 24])
@pytest.mark.parametrize("seed", range(6))
def test_request_trees_extend_alike(seed: int, depth: int, kind: str) -> None:
    """Incremental appends in random chunks, several sequences (closed one after another)."""
    rng = random.Random(seed * 100 + depth)
    py, nat = SuffixTree(depth), native.SuffixTree(depth)
    seqs = make_seqs(rng, kind, rng.randint(1, 4), 60 if kind == "small" else 150)
    nonzero = nonempty = 0
    for seq_id, seq in enumerate(seqs):
        i = 0
        while i < len(seq):
            step = rng.randint(1, 9)
            py.extend(seq_id, seq[i : i + step])
            nat.extend(seq_id, seq[i : i + step])
            i += step
            if rng.random() < 0.3 or i >= len(seq):
                states = py.suffix_states(seq_id)
                assert nat.suffix_depths(seq_id) == [st[1] for st in states]
                _, n = compare_drafts(py, states, functools.partial(nat.suffix_draft, seq_id))
                nonempty += n
        if seq:
            assert nat.tokens(seq_id) == list(py.seqs[seq_id])
        py.close(seq_id)
        nat.close(seq_id)
        nonzero += assert_same_tree(py, nat, seqs[: seq_id + 1], rng)
    assert nonzero > 0
    assert nonempty > 3 or depth == 1  # the comparison saw real drafts (depth 1: no states)


@pytest.mark.parametrize("kind", ["small", "text"])
@pytest.mark.parametrize("depth", [1, 3, 5, 8, 24])
@pytest.mark.parametrize("seed", range(6))
def test_global_trees_add_remove_and_cursors_alike(seed: int, depth: int, kind: str) -> None:
    """Whole sequences come and go (FIFO); cursors follow queries and are rebuilt by match."""
    rng = random.Random(7000 + seed * 100 + depth)
    py, nat = SuffixTree(depth), native.SuffixTree(depth)
    pool = make_seqs(rng, kind, 14, 40 if kind == "small" else 120)
    live: list[int] = []
    nonempty = cursor_checks = 0
    for seq_id, seq in enumerate(pool):
        py.add_sequence(seq_id, seq)
        nat.add_sequence(seq_id, seq)
        live.append(seq_id)
        while live and rng.random() < 0.35:
            py.remove(live[0])
            nat.remove(live[0])
            live.pop(0)
        assert nat.seq_ids() == list(py.seqs)
        assert_same_tree(py, nat, [pool[i] for i in live], rng)
        # a query that often runs along a live sequence, then leaves it
        src = pool[rng.choice(live)] if live else []
        i = rng.randint(0, len(src))
        query = src[i : i + rng.randint(0, 30)] + make_seqs(rng, kind, 1, 6)[0]
        py_states: list = []
        cursor = native.Cursor()
        nat.cursor_match(cursor, [])
        for t in query:
            py_states = py.follow(py_states, t)
            nat.cursor_follow(cursor, [t])
            assert cursor.depths() == [st[1] for st in py_states]
            cursor_checks += 1
            _, n = compare_drafts(py, py_states, functools.partial(nat.cursor_draft, cursor))
            nonempty += n
        fresh = native.Cursor()
        nat.cursor_match(fresh, query)
        assert fresh.depths() == [st[1] for st in py.match_states(query)]
    with pytest.raises(ValueError, match="oldest"):
        nat.remove(10**6)
    for seq_id in list(live):
        py.remove(seq_id)
        nat.remove(seq_id)
        assert_same_tree(py, nat, [pool[i] for i in live if i > seq_id], rng)
    assert nat.num_nodes == py.num_nodes == 1 and nat.num_tokens == 0
    assert cursor_checks > 20
    assert nonempty > 20 or depth == 1


def test_stale_cursor_and_mixed_use_are_refused() -> None:
    tree = native.SuffixTree(4)
    tree.add_sequence(0, [1, 2, 3])
    cursor = native.Cursor()
    tree.cursor_match(cursor, [1, 2])
    assert cursor.depths() == [2, 1] and cursor.epoch == tree.epoch
    tree.add_sequence(1, [2, 3, 4])
    with pytest.raises(ValueError, match="stale"):
        tree.cursor_follow(cursor, [3])
    # a cursor of another tree at the same epoch is refused too (its node indices are foreign)
    other, third = native.SuffixTree(4), native.SuffixTree(4)
    other.add_sequence(0, [1, 2, 3])
    third.add_sequence(0, [1, 2, 3])
    foreign = native.Cursor()
    other.cursor_match(foreign, [1, 2])
    assert foreign.epoch == third.epoch == 1
    with pytest.raises(ValueError, match="stale"):
        third.cursor_draft(foreign, 0, 4, 0.0)
    own = native.SuffixTree(4)
    own.extend(0, [1, 2])
    with pytest.raises(ValueError, match="stale"):
        native.best_draft(own, 0, third, foreign, 4, 1.0, 0.0, 4, 0.1)
    assert native.best_draft(own, 0, other, foreign, 4, 1.0, 0.0, 4, 0.1)[0] == [3]
    with pytest.raises(ValueError, match="not both"):
        tree.extend(5, [1])
    with pytest.raises(ValueError, match="increase"):
        tree.add_sequence(1, [1])
    with pytest.raises(ValueError, match="max_depth"):
        native.SuffixTree(0)


# ---- the proposer -----------------------------------------------------------------------------
def run_generations(
    prop: SuffixProposer, rng: random.Random, kind: str, num_requests: int, num_salts: int = 1
) -> list[tuple]:
    """Requests arrive, generate in chunks (batched with others, random caps), finish into the
    global tree (of one of ``num_salts`` cache salts); sometimes one is aborted (no final
    tokens) or restarted with other tokens. Returns everything the proposer said."""
    text = Text(rng, vocab=40 if kind == "small" else 300)
    answers = [text(rng.randint(20, 120)) for _ in range(6)]  # responses that recur
    log: list[tuple] = []
    running: dict[str, list[int]] = {}
    targets: dict[str, list[int]] = {}
    salts: dict[str, int] = {}
    started = 0
    while started < num_requests or running:
        while started < num_requests and len(running) < 4 and rng.random() < 0.5:
            rid = f"r{started}"
            prompt = text(rng.randint(1, 60))
            answer = rng.choice(answers) if rng.random() < 0.6 else text(rng.randint(5, 100))
            if rng.random() < 0.5:  # a variation of a recurring answer
                j = rng.randint(0, len(answer))
                answer = answer[:j] + text(rng.randint(0, 8)) + answer[j:]
            targets[rid] = prompt + answer
            salts[rid] = rng.randrange(num_salts) if num_salts > 1 else 0
            running[rid] = prompt + answer[:1]
            prop.add_request(rid)
            started += 1
        if not running:
            continue
        reqs = []
        for rid, toks in running.items():
            cap = rng.choice([0, 1, 3, 5, 8])
            reqs.append(DraftRequest(rid, list(toks), cap, SamplingParams(temperature=0.0)))
            reqs[-1].cache_salt = salts[rid]
        out = prop.propose(DraftInput(reqs))
        for r, draft in zip(reqs, out.draft_token_ids):
            d = prop.last_drafts[r.req_id]
            log.append((r.req_id, draft, d.token_ids, d.probs, d.match_len, d.source))
            log.append((r.req_id, prop.last_scores[r.req_id]))
        for rid in list(running):
            toks, target = running[rid], targets[rid]
            if len(toks) >= len(target):
                final = toks if rng.random() < 0.9 else None  # aborted: no final tokens
                prop.remove_request(rid, final)
                del running[rid]
                stats = prop.memory_stats()
                log.append(("removed", rid, {k: v for k, v in stats.items() if "bytes" not in k}))
            elif rng.random() < 0.02:  # not an extension of what was seen: starts over
                running[rid] = toks[:-2] + [text.vocab + 1] + toks[-1:]
            else:
                running[rid] = target[: len(toks) + rng.randint(1, 8)]
    return log


@pytest.mark.parametrize("kind", ["small", "text"])
@pytest.mark.parametrize(
    "depth,factor,offset,min_prob,max_cached",
    [
        (24, 1.0, 0.0, 0.1, 10000),
        (24, 2.0, 1.0, 0.0, 3),
        (6, 1.0, 0.0, 0.1, 2),
        (12, 1.5, 2.0, 0.4, 0),
        (3, 4.0, 0.0, 0.2, 1),
        (24, 0.6, 0.2, 0.1, 5),  # 0.6 * 3 + 0.2 = 1.9999999999999998: the 1e-6 matters
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_proposers_propose_alike_over_whole_generations(
    seed: int, depth: int, factor: float, offset: float, min_prob: float, max_cached: int, kind: str
) -> None:
    logs = []
    for use_native in (False, True):
        prop = SuffixProposer(
            8,
            max_tree_depth=depth,
            max_cached_requests=max_cached,
            max_spec_factor=factor,
            min_token_prob=min_prob,
            max_spec_offset=offset,
            native=use_native,
        )
        assert prop.native is use_native
        rng = random.Random(9000 + seed)
        logs.append(run_generations(prop, rng, kind, num_requests=12))
    py_log, nat_log = logs
    assert len(nat_log) == len(py_log)
    for want, got in zip(py_log, nat_log):
        assert got == want
    drafts = [e for e in py_log if len(e) == 6]
    nonempty = [e for e in drafts if e[1]]
    assert len(nonempty) > 20, len(nonempty)  # the comparison saw real drafts
    assert any(p < 1.0 for e in nonempty for p in e[3])  # and real probabilities
    if max_cached:
        assert any(e[5] == "global" for e in nonempty)  # and drafts from the global tree
    evicted = [e for e in py_log if e[0] == "removed" and e[2]["cached_requests"] == max_cached]
    assert not max_cached or max_cached > 3 or evicted  # small caches did evict


@pytest.mark.parametrize("max_cached", [10000, 3])
@pytest.mark.parametrize("seed", range(3))
def test_proposers_propose_alike_with_cache_salts(seed: int, max_cached: int) -> None:
    """Requests of three tenants, each with its own global tree; small caches evict across."""
    logs = []
    for use_native in (False, True):
        prop = SuffixProposer(8, max_cached_requests=max_cached, native=use_native)
        rng = random.Random(9100 + seed)
        logs.append(run_generations(prop, rng, "small", num_requests=16, num_salts=3))
    assert logs[1] == logs[0]
    assert any(e[0] == "removed" and e[2]["global_partitions"] > 1 for e in logs[0])
    assert any(len(e) == 6 and e[1] and e[5] == "global" for e in logs[0])


def test_byte_budget_bounds_the_native_global_tree() -> None:
    """The native estimate is smaller per node, but the budget is kept the same way."""
    prop = SuffixProposer(4, max_tree_depth=16, max_global_bytes=20_000, native=True)
    rng = random.Random(4)
    for i in range(30):
        answer = [rng.randrange(50_000) for _ in range(40)]
        for toks in ([1] + answer[:1], [1] + answer):
            prop.propose(
                DraftInput([DraftRequest(f"r{i}", toks, 4, SamplingParams(temperature=0.0))])
            )
        prop.remove_request(f"r{i}")
        assert prop.global_tree.approx_bytes <= 20_000
    stats = prop.memory_stats()
    assert 1 <= stats["cached_requests"] < 30
    assert stats["global_bytes"] == prop.global_tree.approx_bytes
    assert stats["global_nodes"] == prop.global_tree.num_nodes > 1


def test_memory_stats_count_the_same_nodes() -> None:
    rng = random.Random(5)
    text = Text(rng)
    seqs = [text(400) for _ in range(3)]
    trees = {}
    for name, make in (("py", SuffixTree), ("native", native.SuffixTree)):
        request, global_ = make(24), make(24)
        for seq_id, seq in enumerate(seqs):
            request.extend(seq_id, seq)
            global_.add_sequence(seq_id, seq)
        trees[name] = (request.memory_stats(), global_.memory_stats())
    for py_stats, nat_stats in zip(trees["py"], trees["native"]):
        assert nat_stats["num_nodes"] == py_stats["num_nodes"] > 100
        assert nat_stats["num_tokens"] == py_stats["num_tokens"] == 1200
        # 72 bytes a node natively (measured with RSS), far less than the Python objects
        assert 0 < nat_stats["approx_bytes"] < py_stats["approx_bytes"] / 2


def test_env_var_forces_the_python_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDEC_SUFFIX_PYTHON", raising=False)
    assert suffix_mod.native_wanted() and SuffixProposer(4).native
    assert isinstance(SuffixProposer(4).global_tree, native.SuffixTree)
    monkeypatch.setenv("SPECDEC_SUFFIX_PYTHON", "1")
    assert not suffix_mod.native_wanted()
    prop = SuffixProposer(4)
    assert not prop.native and isinstance(prop.global_tree, SuffixTree)
    monkeypatch.setenv("SPECDEC_SUFFIX_PYTHON", "0")
    assert SuffixProposer(4).native


def test_scores_sum_like_this_python() -> None:
    """best_draft compares scores summed in C++: the same rounding as the builtin sum (left to
    right before 3.12, compensated since)."""
    rng = random.Random(8)
    differs = 0
    for _ in range(2000):
        run, probs = 1.0, []
        for _ in range(rng.randint(0, 32)):
            run *= rng.choice([1.0, 0.5, 2 / 3, 0.75, 0.9, 1 / 7, 0.999])
            probs.append(run)
        if rng.random() < 0.2:
            probs = [rng.choice([1e16, 1.0, -1e16, 0.1, 1e-9]) for _ in probs]
        assert native.python_sum(probs) == sum(probs)
        total = 0.0
        for p in probs:
            total += p
        differs += total != sum(probs)
    assert native.python_sum([]) == 0.0
    assert differs > 0 if sys.version_info >= (3, 12) else differs == 0
