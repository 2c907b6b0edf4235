"""Logical KV blocks of the prefix cache, and the records of their changes (KV events).

The pool is slot-based, not paged, so blocks are logical: the token ids a slot offers to later
requests (a free slot's cached prefix, a running slot's published prompt) cut into ``block_size``
tokens, whole blocks only. Each block is named by a chained hash that any router can compute from
token ids, on any machine and after any restart:

    h[-1] = 0
    h[i]  = first 8 bytes, big-endian, of
            sha256(h[i-1] as 8 bytes big-endian + tokens[i*B:(i+1)*B] as uint32 little-endian)

a number in [0, 2**64). The set of blocks the pool offers is tracked with a count per hash (two
slots may hold the same prefix): a hash is *stored* when its first holder appears and *removed*
when its last holder goes, so a subscriber's index is exactly the blocks a new prompt can reuse.

Salted requests (``cache_salt``): their blocks are never recorded. Their token ids never leave the
engine, and they only ever match prompts of their own tenant, which a router cannot tell from
token ids alone.

This module only collects plain records; ``specdec.engine.kv_events`` encodes and publishes them.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_BLOCK_SIZE = 16


def block_hash(parent: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """One block's hash from its parent's (0 for the first block) and its token ids."""
    data = parent.to_bytes(8, "big") + np.asarray(token_ids, dtype="<u4").tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """The chained hashes of the whole ``block_size``-token blocks of ``token_ids``."""
    tokens = np.asarray(token_ids, dtype=np.int64)  # [n]
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class BlockStored:
    """Blocks newly offered, a chain: the first one's parent is ``parent_block_hash``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # [len(block_hashes) * block_size]


@dataclass
class BlockRemoved:
    """Blocks no prompt can reuse any more (evicted, overwritten, forgotten)."""

    block_hashes: list[int]


@dataclass
class AllBlocksCleared:
    """Every block is gone (``reset_prefix_cache``); stores that follow it describe what is left."""


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockLog:
    """Which logical blocks each slot offers, and the records of what changed since ``drain``."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._slot_blocks: dict[int, list[int]] = {}  # slot -> its chain of block hashes
        self._holders: Counter[int] = Counter()  # hash -> slots offering it
        self._records: list[BlockEvent] = []

    def update(self, slot: int, token_ids: Sequence[int] | np.ndarray, salted: bool) -> None:
        """``slot`` now offers ``token_ids`` (nothing when ``salted``)."""
        old = self._slot_blocks.get(slot, [])
        new = [] if salted else block_hashes(token_ids, self.block_size)
        keep = 0
        while keep < min(len(old), len(new)) and old[keep] == new[keep]:
            keep += 1
        if keep == len(old) == len(new):
            return
        gone = []
        for h in old[keep:]:
            self._holders[h] -= 1
            if not self._holders[h]:
                del self._holders[h]
                gone.append(h)
        if gone:
            self._records.append(BlockRemoved(gone))
        # NOTE: chains are prefix-closed (a held block's parents are held by the same slot), so
        # the blocks held nowhere else yet are a tail of `new`, whose parent is held
        first = len(new)
        for i in range(keep, len(new)):
            if not self._holders[new[i]] and first == len(new):
                first = i
            self._holders[new[i]] += 1
        if first < len(new):
            b = self.block_size
            tokens = np.asarray(token_ids, dtype=np.int64)[first * b : len(new) * b]
            parent = new[first - 1] if first else None
            self._records.append(BlockStored(new[first:], parent, tokens.tolist()))
        if new:
            self._slot_blocks[slot] = new
        else:
            self._slot_blocks.pop(slot, None)

    def clear(self, kept: dict[int, tuple[Sequence[int] | np.ndarray, bool]]) -> None:
        """Everything is forgotten but ``kept`` (slot -> its tokens, salted): one
        ``AllBlocksCleared``, then what those slots still offer."""
        self._slot_blocks.clear()
        self._holders.clear()
        self._records.append(AllBlocksCleared())
        for slot, (token_ids, salted) in kept.items():
            self.update(slot, token_ids, salted)

    def drain(self) -> list[BlockEvent]:
        """The records since the last call, oldest first."""
        records, self._records = self._records, []
        return records

    @property
    def num_blocks(self) -> int:
        """Distinct blocks offered now."""
        return len(self._holders)
