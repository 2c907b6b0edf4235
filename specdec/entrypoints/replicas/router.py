"""Which replica serves a request: session affinity, prefix affinity, least load.

Shared by ``specdec serve --data-parallel-size N`` and the Ray Serve deployment. As Ray Serve's
``PrefixCacheAffinityRouter``: while queues are balanced, a request goes to the replica whose
prefix tree holds the longest prefix of its text (when that match covers at least
``match_rate_threshold`` of the text), else to the least-loaded replica; when the busiest and
the idlest replica differ by more than ``imbalanced_threshold`` ongoing requests, load wins.
A request with an ``x-session-id`` goes to the session's replica by rendezvous hashing
(consistent: a replica joining or leaving moves only the sessions it gains or loses).
Affinity keeps a replica's prefix cache and its suffix-decoding tree warm for the
conversations it has seen: no engine shares drafter state across replicas.

Tenants stay apart here as in each engine's caches: a request's ``cache_salt`` keys its place in
the trees (text under one salt never matches text under another, nor unsalted text), so where a
request is routed says nothing of what other tenants sent.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field

CHUNK_CHARS = 16  # prefix tree edges hold this many characters (as KV blocks hold tokens)
MAX_TEXT_CHARS = 8192  # only the first characters of a request are routed on


@dataclass
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixTree:
    """The text prefixes one replica has served, in chunks of ``CHUNK_CHARS`` characters,
    bounded at ``max_nodes`` (least recently used leaves are evicted)."""

    def __init__(self, max_nodes: int = 50_000) -> None:
        self.root = _Node()
        self.num_nodes = 0
        self.max_nodes = max_nodes
        self._clock = 0

    @staticmethod
    def _chunks(text: str) -> list[str]:
        text = text[:MAX_TEXT_CHARS]
        return [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]

    def match(self, text: str) -> int:
        """How many leading characters of ``text`` this tree holds (whole chunks)."""
        node, matched = self.root, 0
        for chunk in self._chunks(text):
            node = node.children.get(chunk)
            if node is None:
                break
            matched += len(chunk)
        return matched

    def insert(self, text: str) -> None:
        self._clock += 1
        node = self.root
        for chunk in self._chunks(text):
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node()
                self.num_nodes += 1
            child.last_used = self._clock
            node = child
        if self.num_nodes > self.max_nodes:
            self._evict(self.num_nodes - self.max_nodes * 9 // 10)

    def _evict(self, count: int) -> None:
        """Drop the ``count`` least recently used nodes, leaves first (a parent whose last child
        went becomes a leaf in its turn)."""
        parents: dict[int, tuple[_Node, str]] = {}
        heap: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                parents[id(child)] = (node, key)
                stack.append(child)
                if not child.children:
                    heap.append((child.last_used, id(child), child))
        heapq.heapify(heap)
        while count > 0 and heap:
            _, _, node = heapq.heappop(heap)
            parent, key = parents[id(node)]
            del parent.children[key]
            self.num_nodes -= 1
            count -= 1
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))


@dataclass
class RouterConfig:
    """Ray Serve's PrefixCacheAffinityRouter knobs, with its defaults."""

    imbalanced_threshold: int = 10  # ongoing requests between the busiest and idlest replica
    match_rate_threshold: float = 0.1  # share of the text a tree must hold to attract it
    max_tree_nodes: int = 50_000
    policy: str = "affinity"  # or "round_robin" (no affinity: the baseline benchmarks compare)


@dataclass
class Choice:
    replica: int
    reason: str  # "session", "prefix", "least_loaded", "only"


class Router:
    """Picks a replica for a request. Replicas are named by any sortable id (an index here, a
    Ray Serve replica id there); their loads are counted by the caller."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.trees: dict[Hashable, PrefixTree] = {}
        self._turn = 0

    def tree(self, replica: Hashable) -> PrefixTree:
        if replica not in self.trees:
            self.trees[replica] = PrefixTree(self.config.max_tree_nodes)
        return self.trees[replica]

    def reset(self, replica: Hashable) -> None:
        """A restarted (or removed) replica has an empty prefix cache and drafter: forget it."""
        self.trees.pop(replica, None)

    def choose(
        self,
        text: str,
        session_id: str | None,
        loads: dict[Hashable, int],
        salt: str | None = None,
    ) -> Choice:
        """``loads``: ongoing requests of each replica that can take one (at least one);
        ``salt``: the request's cache_salt (None: unsalted)."""
        keyed = salt_chunk(salt) + text[:MAX_TEXT_CHARS]
        if not loads:
            raise ValueError("no replica is available")
        candidates = sorted(loads)
        if len(candidates) == 1:
            return self._commit(Choice(candidates[0], "only"), keyed)
        if self.config.policy == "round_robin":
            self._turn += 1
            return Choice(candidates[self._turn % len(candidates)], "round_robin")
        least = self._least_loaded(loads)
        if max(loads.values()) - loads[least] > self.config.imbalanced_threshold:
            return self._commit(Choice(least, "least_loaded"), keyed)
        if session_id:
            return self._commit(Choice(rendezvous(session_id, candidates), "session"), keyed)
        best, best_len = least, 0
        for r in candidates:
            # NOTE: the salt's chunk is no match of the text
            n = max(0, self.tree(r).match(keyed) - CHUNK_CHARS)
            if n > best_len or (n == best_len and n > 0 and loads[r] < loads[best]):
                best, best_len = r, n
        limited = min(len(text), MAX_TEXT_CHARS)
        if best_len > 0 and best_len >= self.config.match_rate_threshold * limited:
            return self._commit(Choice(best, "prefix"), keyed)
        return self._commit(Choice(least, "least_loaded"), keyed)

    def _least_loaded(self, loads: dict[Hashable, int]) -> Hashable:
        """The replica with the fewest ongoing requests; ties take turns (an idle pool spreads
        new conversations instead of piling them on the first replica)."""
        fewest = min(loads.values())
        ties = sorted(r for r, n in loads.items() if n == fewest)
        self._turn += 1
        return ties[self._turn % len(ties)]

    def _commit(self, choice: Choice, keyed: str) -> Choice:
        self.tree(choice.replica).insert(keyed)
        return choice


_UNSALTED = "\0" * CHUNK_CHARS


def salt_chunk(salt: str | None) -> str:
    """The first chunk of a request's place in the trees: its salt's hash (one chunk of hex
    digits), or a chunk no hash gives for unsalted requests."""
    if not salt:
        return _UNSALTED
    return hashlib.blake2b(
        salt.encode("utf-8", "surrogatepass"), digest_size=CHUNK_CHARS // 2
    ).hexdigest()


def rendezvous(key: str, replicas: list[Hashable]) -> Hashable:
    """Highest-random-weight hashing: the replica ``key`` belongs to among ``replicas``."""

    def weight(r: int) -> bytes:
        return hashlib.blake2b(f"{r}\0{key}".encode(), digest_size=8).digest()

    return max(replicas, key=weight)


def routing_salt(body: dict) -> str | None:
    """The request's ``cache_salt`` (None when absent or not a string: the replica refuses it)."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def routing_text(body: dict) -> str:
    """The text a request is routed on: a chat's messages (role and text parts) in order, or a
    completion's prompt (token ids as numbers)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role', '')}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and not isinstance(prompt[0], int) else prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""
