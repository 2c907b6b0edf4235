"""Shared prefixes against a model of what each sequence must see: random admissions (with
cached, running and no prefixes), computed prompts, decode steps, frees (cached or failed) and
cache resets; after every action, every running sequence reads exactly its own tokens' KV through
its slot and shared prefix, and every cached slot holds what it claims."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kv_cache.pool import KVCache

KEY_BLOCK, SHARE, LEN, SLOTS = 4, 8, 64, 5
DOCS = [np.random.default_rng(s).integers(1, 50, 48).tolist() for s in (1, 2)]


def _value(tokens: list[int]) -> float:
    """The KV a position holds: a function of every token up to it (as a real forward's is), an
    integer below 2,048 (exact in float16)."""
    return float(hash(tuple(tokens)) % 2039)


def _write(kv: KVCache, slot: int, tokens: list[int], start: int) -> None:
    n = len(tokens) - start
    if n <= 0:
        return
    vals = torch.tensor([_value(tokens[: i + 1]) for i in range(start, len(tokens))])
    x = vals.view(n, 1, 1).expand(n, 1, 2).contiguous()
    kv.store(0, slot, start, x, -x)


def _seen(kv: KVCache, slot: int, n: int) -> list[float]:
    k, v = kv.layer_slot(0, slot, *kv.prefix_of(slot))
    keys = k.transpose(-1, -2).reshape(1, -1, 2)[0, :n, 0]  # blocked keys, as the kernels read
    assert torch.equal(v[0, :n, 0], -keys)
    return keys.tolist()


def _check(kv: KVCache, running: dict[int, list[int]]) -> None:
    for slot, tokens in running.items():
        assert _seen(kv, slot, len(tokens)) == [_value(tokens[: i + 1]) for i in range(len(tokens))]
        base, n = kv.prefix_of(slot)
        assert (
            n % SHARE == 0 and (base < 0) == (n == 0) and kv.prefix_of(base)[1] == 0 if n else True
        )
    for slot in kv._free:  # what a cached slot claims it holds, it holds
        n = int(kv._num_cached[slot])
        tokens = kv._cached_token_ids[slot, :n].tolist()
        assert _seen(kv, slot, n) == [_value(tokens[: i + 1]) for i in range(n)]


actions = st.lists(
    st.tuples(st.sampled_from(["admit", "step", "finish", "fail", "reset"]), st.integers(0, 10**6)),
    min_size=5,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(actions)
def test_every_sequence_reads_its_own_kv(script) -> None:
    kv = KVCache(1, SLOTS, 1, LEN, 2, torch.float16, torch.device("cpu"), True, KEY_BLOCK, SHARE)
    running: dict[int, list[int]] = {}  # slot -> tokens whose KV it holds (computed)
    prompts: dict[int, int] = {}  # slot -> prompt length
    for action, r in script:
        rng = np.random.default_rng(r)
        if action == "admit" and kv.num_free_slots:
            doc = DOCS[r % 2]
            prompt = (
                doc[: int(rng.integers(1, 40))]
                + rng.integers(1, 50, int(rng.integers(1, 6))).tolist()
            )
            salt = int(r % 3 == 0)
            slot, reused = kv.allocate_for_prompt(prompt, salt)
            assert slot not in running and reused < len(prompt)
            running[slot] = prompt[:reused]
            _check(kv, running)
            _write(kv, slot, prompt, reused)  # the prefill
            running[slot] = prompt
            prompts[slot] = len(prompt)
            kv.publish(slot, prompt, salt)
        elif action == "step" and running:
            slot = sorted(running)[r % len(running)]
            tokens = running[slot]
            if len(tokens) + 3 <= LEN:
                grown = tokens + rng.integers(1, 50, 3).tolist()
                _write(kv, slot, grown, len(tokens))
                running[slot] = grown
        elif action in ("finish", "fail") and running:
            slot = sorted(running)[r % len(running)]
            tokens = running.pop(slot)
            kv.free(slot, tokens if action == "finish" else [], int(kv._salt[slot]))
        elif action == "reset":
            kv.reset_prefix_cache()
        _check(kv, running)
