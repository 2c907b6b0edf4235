"""The suffix tree of suffix decoding in Python: occurrence counts of every substring up to a
depth, matched and followed to draft (the reference for, and the fallback of, the C++ trees in
``_suffix_native``; ``specdec.spec_decode.suffix`` runs either).

A substring seen once costs no node below its first unique token (it is read back from its
sequence), and in a tree of whole sequences (``add_sequence``) a run of tokens that all its
occurrences share is one node.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

# NOTE: fitted with tracemalloc on natural-text and random trees (within 7%, checked in
# tests/unit/spec_decode/test_suffix.py): a node with its ints ~135 bytes, its children dict ~230 more.
_BYTES_PER_NODE = 135
_BYTES_PER_CHILDREN_DICT = 230


class _Node:
    """A run of substrings with the same occurrences: the path from the root to ``depth``, and its
    prefixes longer than the parent's depth (an edge of one token, or more in compressed trees).
    ``count`` = occurrences. A node seen at least twice (and the root) has all its children
    materialized; ``cont`` is the sum of their counts and ``best`` the most frequent (ties: most
    recent), or None when unknown. A node seen once has no children: its continuation is read from
    its sequence. ``ref`` is the most recent occurrence: seqs[ref_seq][ref_end] is the token at
    ``depth``, so the token at any depth x of the path is seqs[ref_seq][ref_end + x - depth]."""

    __slots__ = ("token", "depth", "count", "cont", "children", "best", "ref_seq", "ref_end")

    def __init__(self, token: int, depth: int, ref_seq: int, ref_end: int) -> None:
        self.token = token  # the first token of the node's edge (its key in the parent)
        self.depth = depth
        self.count = 1
        self.cont = 0
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None
        self.ref_seq = ref_seq
        self.ref_end = ref_end


# A position in a tree while reading a sequence: [node, depth]. Either depth lies on node's edge
# (parent depth < depth <= node.depth), or node was seen once and the path goes on past node.depth
# in its reference sequence.
State = list


class SuffixTree:
    """Occurrence counts of every substring of length <= ``max_depth`` in a set of sequences.

    Two ways in, not mixed in one tree: ``extend`` appends tokens to open sequences (a request's
    tree: O(new tokens * max_depth), one node per token of a repeated substring) and
    ``add_sequence`` adds whole sequences, compressing runs that all occurrences share into one node
    (the global tree: O(length * max_depth)). ``remove`` drops the oldest sequence (FIFO).
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(-1, 0, -1, -1)
        self.root.count = 0
        self.root.children = {}
        self.seqs: dict[int, array] = {}
        self._states: dict[int, list[State]] = {}  # per open sequence: its suffixes, longest first
        self._compressed: bool | None = None  # set by the first update: add_sequence or extend
        self.num_nodes = 1
        self.num_dicts = 1  # nodes with a children dict
        self.num_tokens = 0
        self._last_seq_id = -1
        self.epoch = 0  # bumped on every change, so readers know their cached positions are stale

    def _new_seq(self, seq_id: int, compressed: bool) -> array:
        if self._compressed is None:
            self._compressed = compressed
        elif self._compressed != compressed:
            raise ValueError("a tree takes either extend() or add_sequence(), not both")
        if seq_id <= self._last_seq_id:
            raise ValueError("new sequence ids must increase (FIFO eviction relies on it)")
        self._last_seq_id = seq_id
        seq = self.seqs[seq_id] = array("i")
        return seq

    # ---- incremental updates (a request's own tree) ---------------------------------------------
    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append tokens to sequence ``seq_id`` (created if new); count every new substring."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self._new_seq(seq_id, compressed=False)
            self._states[seq_id] = []
        states = self._states[seq_id]
        for t in tokens:
            states = self._append(seq_id, seq, states, t)
        self._states[seq_id] = states
        self.epoch += 1

    def close(self, seq_id: int) -> None:
        """No more tokens for this sequence: drop its cursor (the counts stay)."""
        self._states.pop(seq_id, None)

    def _append(self, seq_id: int, seq: array, states: list[State], t: int) -> list[State]:
        """One token: each suffix of length < max_depth grows by ``t`` (one occurrence each)."""
        p = len(seq)
        seq.append(t)
        max_depth = self.max_depth
        kept: list[State] = []
        # NOTE: longest first. When a node reaches its second occurrence, the continuation of the
        # first one is materialized; if that continuation is this very token, its (longer) suffix
        # was handled just before, implicitly, and must not be counted twice.
        for st in states:
            node, d = st
            while node.depth < d and node.count >= 2:  # the tree grew under this path
                node = node.children[seq[p - d + node.depth]]  # type: ignore[index]
            if node.depth == d and node.count >= 2:
                node = self._add_occurrence(node, t, seq_id, p)
            d += 1
            if d < max_depth:
                st[0], st[1] = node, d
                kept.append(st)
        self.root.count += 1
        self.num_tokens += 1
        child = self._add_occurrence(self.root, t, seq_id, p)
        if max_depth > 1:
            kept.append([child, 1])
        return kept

    def _add_occurrence(self, parent: _Node, t: int, seq_id: int, end: int) -> _Node:
        """One more occurrence of parent's path + ``t``, ending at seqs[seq_id][end]."""
        children = parent.children
        if children is None:
            children = parent.children = {}
            self.num_dicts += 1
        child = children.get(t)
        parent.cont += 1
        if child is None:
            child = children[t] = _Node(t, parent.depth + 1, seq_id, end)
            self.num_nodes += 1
        else:
            if child.count == 1:
                self._materialize(child)
            child.count += 1
            child.ref_seq, child.ref_end = seq_id, end
        _update_best(parent, child)
        return child

    def _materialize(self, node: _Node) -> None:
        """``node`` gets its second occurrence: give the first one's continuation a node."""
        seq = self.seqs[node.ref_seq]
        nxt = node.ref_end + 1
        if node.depth < self.max_depth and nxt < len(seq):
            node.children = {}
            self.num_dicts += 1
            node.cont = 1
            node.best = node.children[seq[nxt]] = _Node(seq[nxt], node.depth + 1, node.ref_seq, nxt)
            self.num_nodes += 1

    # ---- whole sequences (the global tree) ------------------------------------------------------
    def add_sequence(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Add a complete sequence: every suffix, top-down, splitting shared runs where it leaves
        them. Runs all occurrences share stay one node, so repeats cost no node per token."""
        seq = self._new_seq(seq_id, compressed=True)
        seq.extend(tokens)
        n = len(seq)
        for start in range(n):
            self._insert_suffix(seq_id, seq, start, min(self.max_depth, n - start))
        self.num_tokens += n
        self.epoch += 1

    def _insert_suffix(self, seq_id: int, seq: array, start: int, limit: int) -> None:
        node = self.root
        node.count += 1
        d = 0
        while d < limit:
            t = seq[start + d]
            node.cont += 1
            children = node.children
            if children is None:  # every earlier occurrence ended here
                children = node.children = {}
                self.num_dicts += 1
            child = children.get(t)
            if child is None:
                child = children[t] = _Node(t, d + 1, seq_id, start + d)
                self.num_nodes += 1
                _update_best(node, child)
                return
            if child.count == 1:
                self._split_leaf(child, d, seq_id, seq, start, limit)
                _update_best(node, child)
                return
            # Follow the shared run while this suffix agrees with it; split where it leaves it.
            ref = self.seqs[child.ref_seq]
            offset = child.ref_end - child.depth - start + 1  # ref index - seq index, same depth
            stop = min(child.depth, limit)
            x = d + 1
            while x < stop and ref[start + x + offset] == seq[start + x]:
                x += 1
            if x < child.depth:
                child = self._split_edge(node, child, x)
            child.count += 1
            child.ref_seq, child.ref_end = seq_id, start + x - 1
            _update_best(node, child)
            node, d = child, x

    def _split_edge(self, parent: _Node, node: _Node, depth: int) -> _Node:
        """Cut ``node``'s run after ``depth``: a new node above takes the part up to ``depth``."""
        upper = _Node(node.token, depth, node.ref_seq, node.ref_end - node.depth + depth)
        upper.count = upper.cont = node.count
        node.token = self.seqs[node.ref_seq][upper.ref_end + 1]
        upper.children = {node.token: node}
        upper.best = node
        parent.children[upper.token] = upper  # type: ignore[index]
        if parent.best is node:
            parent.best = upper
        self.num_nodes += 1
        self.num_dicts += 1
        return upper

    def _split_leaf(
        self, leaf: _Node, d: int, seq_id: int, seq: array, start: int, limit: int
    ) -> None:
        """A node seen once meets a second occurrence, seq[start:start + limit], which entered it
        at depth d + 1: their common run becomes the node, and each one that goes on gets a leaf."""
        old_seq = leaf.ref_seq
        old = self.seqs[old_seq]
        offset = leaf.ref_end - leaf.depth - start + 1  # old index - seq index, same depth
        x = d + 1
        while (
            x < limit
            and start + x + offset < len(old)
            and old[start + x + offset] == seq[start + x]
        ):
            x += 1
        leaf.depth, leaf.count = x, 2
        leaf.ref_seq, leaf.ref_end = seq_id, start + x - 1
        leaves = []
        i = start + x + offset
        if x < self.max_depth and i < len(old):
            leaves.append(_Node(old[i], x + 1, old_seq, i))
        if x < limit:
            leaves.append(_Node(seq[start + x], x + 1, seq_id, start + x))
        if leaves:
            leaf.children = {n.token: n for n in leaves}
            leaf.cont = len(leaves)
            leaf.best = leaves[-1]  # ties: the most recent occurrence
            self.num_nodes += len(leaves)
            self.num_dicts += 1

    def remove(self, seq_id: int) -> None:
        """Remove the oldest sequence: every count it contributed goes away."""
        if not self.seqs or seq_id != next(iter(self.seqs)):
            raise ValueError(f"only the oldest sequence can be removed, not {seq_id}")
        seq = self.seqs[seq_id]
        n = len(seq)
        for start in range(n):
            self._remove_suffix(seq, start, min(n, start + self.max_depth))
        del self.seqs[seq_id]
        self.num_tokens -= n
        self._states.pop(seq_id, None)
        self.epoch += 1

    def _remove_suffix(self, seq: array, start: int, stop: int) -> None:
        node = self.root
        node.count -= 1
        i = start
        while i < stop:  # NOTE: every occurrence covers whole runs (they are split where one ends)
            t = seq[i]
            child = node.children[t]  # type: ignore[index]
            node.cont -= 1
            child.count -= 1
            if node.best is child:
                node.best = None  # may no longer be the most frequent: recomputed on demand
            if child.count == 0:
                del node.children[t]  # type: ignore[attr-defined]
                self.num_nodes -= 1
                return
            if child.count == 1:
                # NOTE: the survivor is the most recent occurrence (FIFO), so child.ref stays valid
                # and everything below can be read from its sequence again.
                num_nodes, num_dicts = _subtree_size(child)
                self.num_nodes -= num_nodes - 1
                self.num_dicts -= num_dicts
                child.children, child.cont, child.best = None, 0, None
                return
            node, i = child, start + child.depth

    # ---- reading ------------------------------------------------------------------------------
    def _token_at(self, node: _Node, depth: int) -> int | None:
        """The token at ``depth`` on node's path (past node.depth: only for nodes seen once)."""
        seq = self.seqs[node.ref_seq]
        i = node.ref_end + depth - node.depth
        return seq[i] if i < len(seq) else None

    def count(self, path: Sequence[int]) -> int:
        """Occurrences of ``path`` (0 if longer than max_depth); ``count([])`` = all tokens."""
        if len(path) > self.max_depth:
            return 0
        node, d = self.root, 0
        while d < len(path):
            if d < node.depth or (node is not self.root and node.count < 2):
                if self._token_at(node, d + 1) != path[d]:
                    return 0
            else:
                child = node.children.get(path[d]) if node.children else None
                if child is None:
                    return 0
                node = child
            d += 1
        return node.count

    def suffix_states(self, seq_id: int) -> list[State]:
        """The cursor of an open sequence: its suffixes shorter than max_depth, longest first."""
        seq = self.seqs[seq_id]
        states = self._states[seq_id]
        p = len(seq)
        for st in states:
            node, d = st
            while node.depth < d and node.count >= 2:
                node = node.children[seq[p - d + node.depth]]  # type: ignore[index]
            st[0] = node
        return states

    def follow(self, states: list[State], t: int) -> list[State]:
        """Read-only cursor: from the tree positions of a sequence's suffixes to those after ``t``.

        Only valid while the tree is unchanged (``epoch``); rebuild with ``match_states`` otherwise.
        """
        kept: list[State] = []
        max_depth = self.max_depth
        for node, d in states:
            if d < node.depth or node.count < 2:
                if self._token_at(node, d + 1) != t:
                    continue
            else:
                node = node.children.get(t) if node.children else None
                if node is None:
                    continue
            if d + 1 < max_depth:
                kept.append([node, d + 1])
        child = self.root.children.get(t)  # type: ignore[union-attr]
        if child is not None and max_depth > 1:
            kept.append([child, 1])
        return kept

    def match_states(self, tokens: Sequence[int]) -> list[State]:
        """Positions of every suffix (shorter than max_depth) of ``tokens`` found in the tree."""
        states: list[State] = []
        for t in tokens[max(0, len(tokens) - self.max_depth + 1) :]:
            states = self.follow(states, t)
        return states

    def draft(
        self, state: State, max_tokens: int, min_token_prob: float
    ) -> tuple[list[int], list[float]]:
        """Follow the most frequent continuation from a position while the running probability
        (product of count(child) / cont(node)) stays >= min_token_prob; at most ``max_tokens`` and
        never past max_depth. Returns the tokens and the running probability after each."""
        node, d = state
        limit = min(max_tokens, self.max_depth - d)
        tokens: list[int] = []
        probs: list[float] = []
        run = 1.0
        while len(tokens) < limit:
            if d < node.depth or node.count < 2:  # a run every occurrence shares, or just one
                seq = self.seqs[node.ref_seq]
                start = node.ref_end + d + 1 - node.depth
                want = limit - len(tokens)
                if node.count >= 2:
                    want = min(want, node.depth - d)
                more = seq[start : start + want].tolist()
                tokens.extend(more)
                probs.extend([run] * len(more))
                if node.count < 2 or len(more) < want:
                    break
                d += len(more)
                continue
            if node.cont == 0:
                break
            child = node.best or self._recompute_best(node)
            run *= child.count / node.cont
            if run < min_token_prob:
                break
            tokens.append(child.token)
            probs.append(run)
            node, d = child, d + 1
        return tokens, probs

    @staticmethod
    def _recompute_best(node: _Node) -> _Node:
        # ties: the most recent occurrence (latest start)
        children = node.children.values()  # type: ignore[union-attr]
        best = max(children, key=lambda c: (c.count, c.ref_seq, c.ref_end - c.depth))
        node.best = best
        return best

    # ---- memory -------------------------------------------------------------------------------
    @property
    def approx_bytes(self) -> int:
        """Estimated memory of the nodes and stored tokens (O(1))."""
        return (
            self.num_nodes * _BYTES_PER_NODE
            + self.num_dicts * _BYTES_PER_CHILDREN_DICT
            + 4 * self.num_tokens
        )

    def memory_stats(self) -> dict[str, int]:
        """Nodes, stored tokens and an estimate of the bytes they take."""
        return {
            "num_nodes": self.num_nodes,
            "num_tokens": self.num_tokens,
            "approx_bytes": self.approx_bytes,
        }


def _update_best(parent: _Node, child: _Node) -> None:
    """``child`` just gained an occurrence (the most recent): keep ``parent.best`` right."""
    best = parent.best
    if best is None:
        if len(parent.children) == 1:  # type: ignore[arg-type]
            parent.best = child
    elif child.count >= best.count:
        parent.best = child


def _subtree_size(node: _Node) -> tuple[int, int]:
    """Nodes and children dicts in the subtree of ``node`` (itself included)."""
    num_nodes, num_dicts, stack = 0, 0, [node]
    while stack:
        n = stack.pop()
        num_nodes += 1
        if n.children is not None:
            num_dicts += 1
            stack.extend(n.children.values())
    return num_nodes, num_dicts
