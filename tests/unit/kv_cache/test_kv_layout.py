"""The blocked key layout of the KV pool (what the native kernels read) against the usual one."""

from __future__ import annotations

import pytest
import torch

from specdec.kv_cache.pool import KVCache, blocked_keys, standard_keys


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_blocked_keys_round_trip(length: int) -> None:
    k = torch.randn(2, 3, length, 8)
    b = blocked_keys(k, 16)
    assert b.shape == (2, 3, -(-length // 16), 8, 16)
    # element d of key j sits at block j // 16, row d, lane j % 16
    j, d = length - 1, 5
    assert b[1, 2, j // 16, d, j % 16] == k[1, 2, j, d]
    assert torch.equal(standard_keys(b, length, 16), k)
    assert torch.equal(standard_keys(k, length, 0), k)


def _pool(key_block: int, prefix_caching: bool = False) -> KVCache:
    return KVCache(2, 3, 2, 40, 8, torch.float32, torch.device("cpu"), prefix_caching, key_block)


def _fill(kv: KVCache, slot: int, start: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in range(2):
        k, v = torch.randn(2, n, 2, 8, generator=gen)
        kv.store(layer, slot, start, k, v)


def test_store_writes_the_same_keys_in_both_layouts() -> None:
    plain, blocked = _pool(0), _pool(16)
    assert blocked.k.shape == (2, 3, 2, 3, 8, 16)  # 40 positions -> 3 blocks of 16
    for kv in (plain, blocked):
        _fill(kv, 1, 0, 21, seed=0)
        _fill(kv, 1, 21, 3, seed=1)  # a write that starts mid-block
    for layer in range(2):
        assert torch.equal(plain.keys(layer, 1)[:, :24], blocked.keys(layer, 1)[:, :24])
        assert torch.equal(plain.v[layer, 1, :, :24], blocked.v[layer, 1, :, :24])


@pytest.mark.parametrize("key_block", [0, 16])
def test_prefix_copy_moves_the_shared_keys(key_block: int) -> None:
    kv = _pool(key_block, prefix_caching=True)
    slot = kv.allocate()
    _fill(kv, slot, 0, 30, seed=2)
    kv.free(slot, list(range(30)))
    # Sharing 20 tokens: taking that slot would overwrite 10 cached ones, so the 20 are copied
    # into an empty slot instead.
    new, reused = kv.allocate_for_prompt(list(range(20)) + [99, 98])
    assert reused == 20 and new != slot
    for layer in range(2):
        assert torch.equal(kv.keys(layer, new)[:, :20], kv.keys(layer, slot)[:, :20])
        assert torch.equal(kv.v[layer, new, :, :20], kv.v[layer, slot, :, :20])
