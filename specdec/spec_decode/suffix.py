"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975; vLLM's ``suffix`` method).

Two kinds of suffix tree count every substring of at most ``max_tree_depth`` tokens: one per running
request over its prompt and output so far, and one global tree over the outputs of finished
requests (a FIFO cache of ``max_cached_requests`` responses). Each step the proposer matches the
suffixes of a request's sequence in both trees, follows the most frequent continuation while its
estimated probability stays at or above ``min_token_prob``, and keeps the draft with the highest
score (the expected number of accepted tokens). Drafts are point masses: no ``q``.

A request's tree is updated incrementally (only the tokens appended since the last step); finished
responses join the global tree whole. A substring seen once costs no node below its first unique
token (it is read back from its sequence), and in the global tree a run of tokens that all its
occurrences share is one node, so cached repeats of a response cost almost nothing.

The global tree is partitioned by ``cache_salt`` (one tree per salt; unsalted requests share one):
a request reads and feeds only its own tenant's responses, so a tenant cannot learn from its
drafts' acceptance that someone else already received a completion.

The proposer runs the trees in C++ (``_suffix_native``, built from csrc/suffix_tree.cpp: the same
algorithm, the same drafts) when that module is built; ``SuffixTree`` (suffix_tree.py) is the reference
and the fallback. ``SPECDEC_SUFFIX_PYTHON=1`` forces the Python trees.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.config.speculative import (
    SUFFIX_MAX_CACHED_REQUESTS,
    SUFFIX_MAX_SPEC_FACTOR,
    SUFFIX_MAX_TREE_DEPTH,
    SUFFIX_MIN_TOKEN_PROB,
)
from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer
from specdec.spec_decode.edits import EditRules
from specdec.spec_decode.suffix_tree import State, SuffixTree, _Node, _subtree_size

__all__ = [
    "State",
    "SuffixDraft",
    "SuffixProposer",
    "SuffixTree",
    "_Node",
    "_subtree_size",
    "make",
    "native_available",
    "native_wanted",
]

try:
    from specdec.spec_decode import _suffix_native
except ImportError:  # not built (the extension is optional): the Python trees serve
    _suffix_native = None


def native_available() -> bool:
    """Whether the C++ trees are built."""
    return _suffix_native is not None


def native_wanted() -> bool:
    """The C++ trees when built, unless ``SPECDEC_SUFFIX_PYTHON`` is set (to anything but 0)."""
    return native_available() and os.environ.get("SPECDEC_SUFFIX_PYTHON", "") in ("", "0")


@dataclass
class SuffixDraft:
    """One request's draft, with where it came from and how sure the trees are of it."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # running probability after each token
    match_len: int = 0
    source: str = ""  # "request" | "global"

    @property
    def score(self) -> float:
        """Expected number of accepted tokens if each probability estimate were right."""
        return sum(self.probs)


@dataclass
class _RequestState:
    # sequence 0 = prompt + output so far; a SuffixTree or a native one
    tree: Any
    num_prompt_tokens: int
    # the request's position in its partition's global tree: list[State] (Python) or a native
    # Cursor, which keeps its own epoch
    global_states: Any = field(default_factory=list)
    global_epoch: int = -1
    cache_salt: int = 0  # whose partition of the global tree the request reads and feeds
    # the tree global_states were matched in (None: none yet). NOTE: a partition emptied by
    # eviction is dropped and a new one may take its salt, with epochs that start over.
    global_tree: Any = None
    # the replacements the response makes to its prompt (edits.py; None: not made yet)
    edits: EditRules | None = None


@dataclass
class _Partition:
    """One salt's share of the global tree."""

    tree: Any
    num_cached: int = 0  # responses in it


class SuffixProposer(Proposer):
    """Drafts from a per-request suffix tree and a global tree of earlier responses.

    Draft length <= ``max_spec_factor * match_len + max_spec_offset`` (offset 0 by default, as in
    vLLM and Arctic Inference), <= ``max_tree_depth - match_len`` and <= the step's cap. Every
    match length is tried (longest first) and the draft with the highest score wins (ties: the
    longer match, then the request's own tree), as in Arctic Inference. ``last_drafts`` /
    ``last_scores`` keep each running request's latest draft and its score (expected accepted
    tokens) for whoever chooses how many drafts to verify.

    The global tree is one tree per ``cache_salt`` (``DraftRequest.cache_salt``; 0, unsalted,
    is one shared partition): a request drafts from, and on finishing joins, its salt's tree only.
    It evicts whole responses, oldest first, beyond ``max_cached_requests`` or an estimated
    ``max_global_bytes`` (~2 nodes, ~250-500 bytes per distinct cached token: the request count
    alone does not bound memory when responses are long). NOTE: both caps are over all partitions
    together, and eviction takes the oldest response whoever it belongs to, so memory is bounded
    whatever the number of tenants (caps per partition would multiply it by the number of salts);
    a partition left empty is dropped. A busy tenant thus pushes others' responses out sooner:
    that reveals how much others generate, never what.

    ``edit_rules``: each draft also carries the replacements the response has been making to the
    prompt it copies (edits.py): a renamed identifier is drafted renamed at its next occurrence,
    and a draft rejected partway through a replacement resumes from the prompt after it.

    ``native`` chooses the trees: the C++ ones (identical drafts, ~10x cheaper per step: ~5-15 us
    instead of ~35-120 us per request, bench_out/s4/suffix_native_bench.py) or the Python
    reference; None = ``native_wanted()``. Native byte estimates are smaller (72 bytes a node,
    measured with RSS, instead of 135-365), so the same ``max_global_bytes`` caches more.
    """

    free_drafts = True
    confident_drafts = True

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = SUFFIX_MAX_TREE_DEPTH,
        max_cached_requests: int = SUFFIX_MAX_CACHED_REQUESTS,
        max_spec_factor: float = SUFFIX_MAX_SPEC_FACTOR,
        min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
        max_spec_offset: float = 0.0,
        max_global_bytes: int = 256 * 2**20,
        native: bool | None = None,
        edit_rules: bool = True,
    ) -> None:
        if native is None:
            native = native_wanted()
        elif native and not native_available():
            raise RuntimeError("the native suffix trees are not built (specdec._suffix_native)")
        self.native = native
        self.edit_rules = edit_rules
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.max_global_bytes = max_global_bytes
        self._partitions: dict[int, _Partition] = {0: _Partition(self._new_tree())}
        self._cached: deque[tuple[int, int]] = deque()  # (salt, sequence id), oldest first
        self._global_bytes = self._partitions[0].tree.approx_bytes  # over every partition
        self._next_seq_id = 0
        self._requests: dict[str, _RequestState] = {}
        self.last_drafts: dict[str, SuffixDraft] = {}
        self.last_scores: dict[str, float] = {}

    def _new_tree(self) -> Any:
        if self.native:
            return _suffix_native.SuffixTree(self.max_tree_depth)
        return SuffixTree(self.max_tree_depth)

    @property
    def global_tree(self) -> Any:
        """The unsalted requests' global tree (salt 0)."""
        return self._partitions[0].tree

    def _global_for(self, state: _RequestState) -> Any:
        """The global tree the request drafts from: its salt's, or None while that is empty."""
        p = self._partitions.get(state.cache_salt) if self.max_cached_requests else None
        return p.tree if p is not None and p.num_cached else None

    # ---- lifecycle ------------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Empty the global trees of earlier responses; running requests keep their own trees and
        get fresh global cursors at their next step."""
        self._partitions = {0: _Partition(self._new_tree())}
        self._global_bytes = self._partitions[0].tree.approx_bytes
        self._cached.clear()
        for state in self._requests.values():
            state.global_tree = None
            if self.native:
                state.global_states = _suffix_native.Cursor()
            else:
                state.global_states, state.global_epoch = [], -1

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        """The request's output joins its salt's global tree (with its final tokens, if given)."""
        self.last_drafts.pop(req_id, None)
        self.last_scores.pop(req_id, None)
        state = self._requests.get(req_id)
        if token_ids is not None and state is not None:
            self._sync(req_id, token_ids, cache_salt=state.cache_salt)
        state = self._requests.pop(req_id, None)
        if state is None or self.max_cached_requests == 0:
            return
        if self.native:
            output = state.tree.tokens(0, state.num_prompt_tokens)
        else:
            output = state.tree.seqs[0][state.num_prompt_tokens :]
        if output:
            self._add_response(state.cache_salt, output)

    def _add_response(self, salt: int, output: Sequence[int]) -> None:
        """Add a response to its salt's tree, then evict the oldest responses over the caps."""
        p = self._partitions.get(salt)
        if p is None:
            p = self._partitions[salt] = _Partition(self._new_tree())
            self._global_bytes += p.tree.approx_bytes
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        before = p.tree.approx_bytes
        p.tree.add_sequence(seq_id, output)
        self._global_bytes += p.tree.approx_bytes - before
        p.num_cached += 1
        self._cached.append((salt, seq_id))
        while self._cached and (
            len(self._cached) > self.max_cached_requests
            or self._global_bytes > self.max_global_bytes
        ):
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        salt, seq_id = self._cached.popleft()
        p = self._partitions[salt]
        before = p.tree.approx_bytes
        p.tree.remove(seq_id)  # NOTE: the oldest overall is the oldest of its partition too
        self._global_bytes += p.tree.approx_bytes - before
        p.num_cached -= 1
        if salt != 0 and p.num_cached == 0:
            del self._partitions[salt]
            self._global_bytes -= p.tree.approx_bytes

    def _sync(
        self, req_id: str, token_ids: list[int], num_prompt_tokens: int = 0, cache_salt: int = 0
    ) -> _RequestState:
        """Bring the request's tree and its global-tree cursor up to ``token_ids``."""
        if self.native:
            return self._sync_native(req_id, token_ids, num_prompt_tokens, cache_salt)
        state = self._requests.get(req_id)
        if state is not None:
            seq = state.tree.seqs[0]
            n = len(seq)
            if n > len(token_ids) or (n and token_ids[n - 1] != seq[n - 1]):
                state = None  # NOTE: not an extension of what we saw (never expected): start over
        if state is None:
            # NOTE: without a prompt length, assume the request is first seen right after its
            # prefill, with one output token.
            prompt_len = num_prompt_tokens or max(0, len(token_ids) - 1)
            state = _RequestState(SuffixTree(self.max_tree_depth), prompt_len)
            state.cache_salt = cache_salt
            self._requests[req_id] = state
        seq = state.tree.seqs.get(0)
        new = token_ids[len(seq) if seq is not None else 0 :]
        if new:
            state.tree.extend(0, new)
        g = self._global_for(state)
        if g is not None:
            if state.global_tree is not g or state.global_epoch != g.epoch:
                state.global_states = g.match_states(token_ids)
                state.global_epoch, state.global_tree = g.epoch, g
            else:
                for t in new:
                    state.global_states = g.follow(state.global_states, t)
        return state

    def _sync_native(
        self, req_id: str, token_ids: list[int], num_prompt_tokens: int = 0, cache_salt: int = 0
    ) -> _RequestState:
        """``_sync`` over the native trees: the cursors stay in C++ (the request's in its tree,
        its global one in an opaque Cursor that records the global tree's epoch)."""
        state = self._requests.get(req_id)
        if state is not None:
            n = state.tree.seq_len(0)
            if n > len(token_ids) or (n and token_ids[n - 1] != state.tree.token(0, n - 1)):
                state = None  # NOTE: as in _sync
        if state is None:
            prompt_len = num_prompt_tokens or max(0, len(token_ids) - 1)
            state = _RequestState(self._new_tree(), prompt_len, _suffix_native.Cursor())
            state.cache_salt = cache_salt
            self._requests[req_id] = state
        new = token_ids[state.tree.seq_len(0) :]
        if new:
            state.tree.extend(0, new)
        g = self._global_for(state)
        if g is not None:
            cursor = state.global_states
            if state.global_tree is not g or cursor.epoch != g.epoch:
                g.cursor_match(
                    cursor, token_ids[max(0, len(token_ids) - self.max_tree_depth + 1) :]
                )
                state.global_tree = g
            else:
                g.cursor_follow(cursor, new)
        return state

    # ---- drafting -------------------------------------------------------------------------------
    def propose(self, inp: DraftInput) -> DraftOutput:
        drafts: list[list[int]] = []
        for r in inp.requests:
            state = self._sync(r.req_id, r.token_ids, r.num_prompt_tokens, r.cache_salt)
            cap = min(r.max_num_drafts, self.num_speculative_tokens)
            draft = self._best_draft(state, cap) if cap > 0 else SuffixDraft()
            if self.edit_rules:
                draft = self._with_edits(state, r.token_ids, draft, cap)
            self.last_drafts[r.req_id] = draft
            self.last_scores[r.req_id] = draft.score
            drafts.append(draft.token_ids)
        return DraftOutput(drafts, [None] * len(drafts))

    def _with_edits(
        self, state: _RequestState, token_ids: list[int], draft: SuffixDraft, cap: int
    ) -> SuffixDraft:
        """The draft with the replacements the response has been making to its prompt (each
        new token's probability estimate: the one of the token it replaces), or where the
        response is partway through one, its rest and the prompt after it (every token's
        estimate: the rule's confidence, EditRules.pending)."""
        if state.edits is None:
            state.edits = EditRules(token_ids[: state.num_prompt_tokens])
        state.edits.update(token_ids, state.num_prompt_tokens)
        pending = state.edits.pending(cap, guess=len(draft.token_ids) < 2)
        if pending is not None and pending[0]:
            tokens, sure = pending
            return SuffixDraft(tokens, [sure] * len(tokens), 0, "edits")
        if not draft.token_ids or not state.edits.num_rules:
            return draft
        tokens, src = state.edits.rewrite(draft.token_ids, cap)
        if tokens == draft.token_ids:
            return draft
        return SuffixDraft(tokens, [draft.probs[k] for k in src], draft.match_len, draft.source)

    def _best_draft(self, state: _RequestState, cap: int) -> SuffixDraft:
        g = self._global_for(state)
        if self.native:
            tokens, probs, match_len, source = _suffix_native.best_draft(
                state.tree,
                0,
                g,
                state.global_states if g is not None else None,
                cap,
                self.max_spec_factor,
                self.max_spec_offset,
                self.max_tree_depth,
                self.min_token_prob,
            )
            return SuffixDraft(tokens, probs, match_len, source)
        best = SuffixDraft()
        own = state.tree.suffix_states(0)
        # In its own tree a request's suffix always occurs once (itself): only nodes seen at least
        # twice have an earlier occurrence to continue from.
        candidates = [(st, "request") for st in own if st[0].depth == st[1] and st[0].count >= 2]
        best = self._best_of(state.tree, candidates, cap, best)
        if g is not None:
            global_candidates = [(st, "global") for st in state.global_states]
            best = self._best_of(g, global_candidates, cap, best)
        return best

    def _best_of(
        self, tree: SuffixTree, candidates: list[tuple[State, str]], cap: int, best: SuffixDraft
    ) -> SuffixDraft:
        """Candidates come longest match first; a later one must score strictly higher."""
        score = best.score
        for st, source in candidates:
            match_len = st[1]
            limit = min(
                cap,
                int(self.max_spec_factor * match_len + self.max_spec_offset + 1e-6),
                self.max_tree_depth - match_len,
            )
            if limit <= score:  # cannot beat the best so far (score <= number of tokens)
                continue
            tokens, probs = tree.draft(st, limit, self.min_token_prob)
            if tokens and sum(probs) > score:
                best = SuffixDraft(tokens, probs, match_len, source)
                score = best.score
        return best

    # ---- memory ---------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        """Nodes / tokens / approximate bytes of the global trees (every partition) and all
        per-request trees."""
        g = [p.tree.memory_stats() for p in self._partitions.values()]
        per_request = [s.tree.memory_stats() for s in self._requests.values()]
        return {
            "global_nodes": sum(m["num_nodes"] for m in g),
            "global_tokens": sum(m["num_tokens"] for m in g),
            "global_bytes": sum(m["approx_bytes"] for m in g),
            "global_partitions": len(g),
            "cached_requests": len(self._cached),
            "request_nodes": sum(m["num_nodes"] for m in per_request),
            "request_bytes": sum(m["approx_bytes"] for m in per_request),
        }


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    return SuffixProposer(
        cfg.num_speculative_tokens,
        max_tree_depth=cfg.suffix_decoding_max_tree_depth,
        max_cached_requests=cfg.suffix_decoding_max_cached_requests,
        max_spec_factor=cfg.suffix_decoding_max_spec_factor,
        min_token_prob=cfg.suffix_decoding_min_token_prob,
        edit_rules=cfg.suffix_decoding_edit_rules,
    )
