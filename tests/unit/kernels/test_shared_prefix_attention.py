"""Shared prefixes in the native attention (ops.cpp attention_seqs ``prefix_slots`` /
``prefix_lens``): a sequence reading its first positions from another slot gets exactly the
rows it gets from its own copy of them, whichever sequences share the pass, on every ISA, in
every KV format, on 1 or 2 threads."""

from __future__ import annotations

import pytest
import torch

from specdec.kernels import _C
from specdec.kv_cache.pool import KVCache
from tests.fixtures.attention import BLOCK

pytestmark = pytest.mark.skipif(_C is None, reason="native kernels not built")

H, HKV, D = 9, 3, 64


def _pool(dtype: torch.dtype, slots: int, length: int) -> KVCache:
    return KVCache(1, slots, HKV, length, D, dtype, torch.device("cpu"), key_block=16)


def _fill(kv: KVCache, slot: int, start: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    k = 2 * torch.randn(n, HKV, D, generator=gen)
    v = torch.randn(n, HKV, D, generator=gen)
    kv.store(0, slot, start, k, v)


def _attend(kv: KVCache, q, seqs, prefixes=None) -> torch.Tensor:
    slots, starts, counts = map(list, zip(*seqs))
    extra = {}
    if prefixes is not None:
        extra = {"prefix_slots": [p for p, _ in prefixes], "prefix_lens": [n for _, n in prefixes]}
    return _C.attention_seqs(q, kv.k[0], kv.v[0], slots, starts, counts, 0.125, **extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_shared_prefix_equals_copied_prefix(isa, dtype) -> None:  # noqa: F811
    """Slot 0 holds a 2-block prefix (and more). Sequences in slots 1-4 read it from slot 0 and
    their own tails from their slots; the same sequences with the prefix copied into their own
    slots give bit-identical rows: decode rows, verification rows, a prefill, one alone."""
    length, shared = 4 * BLOCK, 2 * BLOCK
    kv = _pool(dtype, 6, length)
    _fill(kv, 0, 0, shared + 40, seed=1)  # the owner's prefix and its own tail
    tails = {1: 90, 2: 300, 3: 5, 4: 0}  # positions past the prefix each sequence holds
    for slot, n in tails.items():
        if n:
            _fill(kv, slot, shared, n, seed=10 + slot)
    copied = _pool(dtype, 6, length)
    copied.k.copy_(kv.k)
    copied.v.copy_(kv.v)
    for slot in tails:
        copied.copy_prefix(0, slot, shared)
    gen = torch.Generator().manual_seed(2)
    # (slot, start, rows): verification, decode, verification, a prefill chunk past the prefix
    seqs = [(1, shared + 90, 9), (2, shared + 300, 1), (3, shared + 5, 16), (4, shared, 20)]
    for slot, start, n in seqs:  # the rows' own keys (written before attention, as a layer does)
        _fill(kv, slot, start, n, seed=100 + slot)
        _fill(copied, slot, start, n, seed=100 + slot)
    q = torch.randn(sum(n for _, _, n in seqs), H, D, generator=gen)
    want = _attend(copied, q, seqs)
    got = _attend(kv, q, seqs, [(0, shared)] * len(seqs))
    assert torch.equal(got, want)
    # The owner itself in the same call (slot 0, no prefix of its own), and sequences without one.
    mixed = [(0, shared + 40, 3), *seqs, (5, 0, 4)]
    _fill(kv, 0, shared + 40, 3, seed=7)
    _fill(copied, 0, shared + 40, 3, seed=7)
    _fill(kv, 5, 0, 4, seed=8)
    _fill(copied, 5, 0, 4, seed=8)
    q2 = torch.randn(sum(n for _, _, n in mixed), H, D, generator=gen)
    prefixes = [(-1, 0), *[(0, shared)] * len(seqs), (-1, 0)]
    assert torch.equal(_attend(kv, q2, mixed, prefixes), _attend(copied, q2, mixed))
    # Each sequence alone, and a shorter shared prefix (one block) than the slots could take.
    offset = 0
    for slot, start, n in seqs:
        rows = q[offset : offset + n]
        assert torch.equal(
            _attend(kv, rows, [(slot, start, n)], [(0, shared)]), want[offset : offset + n]
        )
        offset += n


def test_many_sequences_and_threads() -> None:
    """Twenty sequences on one prefix (the passes hold at most 16 rows: several per block), on
    one and on two threads."""
    length, shared = 3 * BLOCK, 2 * BLOCK
    kv = _pool(torch.float16, 21, length)
    _fill(kv, 0, 0, shared, seed=1)
    copied = _pool(torch.float16, 21, length)
    seqs = [(s, shared + s, 1 + s % 3) for s in range(1, 21)]
    for slot, start, n in seqs:
        _fill(kv, slot, shared, start - shared + n, seed=slot)
    copied.k.copy_(kv.k)
    copied.v.copy_(kv.v)
    for slot, _, _ in seqs:
        copied.copy_prefix(0, slot, shared)
    q = torch.randn(sum(n for _, _, n in seqs), H, D, generator=torch.Generator().manual_seed(3))
    want = _attend(copied, q, seqs)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(_attend(kv, q, seqs, [(0, shared)] * len(seqs)), want), threads
    finally:
        torch.set_num_threads(before)


def test_bad_prefixes_are_refused() -> None:
    kv = _pool(torch.float16, 2, 2 * BLOCK)
    q = torch.zeros(1, H, D)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        _attend(kv, q, [(1, BLOCK + 5, 1)], [(0, 100)])
    with pytest.raises(RuntimeError, match="multiple of 256"):
        _attend(kv, q, [(1, 5, 1)], [(0, BLOCK)])  # longer than the sequence's start
    with pytest.raises(RuntimeError, match="prefix slot out of range"):
        _attend(kv, q, [(1, BLOCK, 1)], [(7, BLOCK)])
    with pytest.raises(RuntimeError, match="one per sequence"):
        _C.attention_seqs(
            q,
            kv.k[0],
            kv.v[0],
            [1],
            [BLOCK],
            [1],
            0.125,
            prefix_slots=[0, 0],
            prefix_lens=[BLOCK, 0],
        )


def test_sliding_windows_read_only_their_blocks_of_the_prefix(isa) -> None:  # noqa: F811
    """A window of 300 positions: rows past position 556 no longer see the prefix's first block
    (the shared pass skips it for them), earlier rows do; each equals its own-copy result."""
    length, shared = 4 * BLOCK, 2 * BLOCK
    kv = _pool(torch.float16, 4, length)
    _fill(kv, 0, 0, shared, seed=1)
    seqs = [(1, shared + 10, 4), (2, shared + 200, 9), (3, shared + 40, 1)]
    for slot, start, n in seqs:
        _fill(kv, slot, shared, start - shared + n, seed=slot)
    copied = _pool(torch.float16, 4, length)
    copied.k.copy_(kv.k)
    copied.v.copy_(kv.v)
    for slot, _, _ in seqs:
        copied.copy_prefix(0, slot, shared)
    q = torch.randn(14, H, D, generator=torch.Generator().manual_seed(5))
    slots, starts, counts = map(list, zip(*seqs))
    want = _C.attention_seqs(q, copied.k[0], copied.v[0], slots, starts, counts, 0.125, 300)
    got = _C.attention_seqs(
        q, kv.k[0], kv.v[0], slots, starts, counts, 0.125, 300,
        prefix_slots=[0] * 3, prefix_lens=[shared] * 3,
    )  # fmt: skip
    assert torch.equal(got, want)
