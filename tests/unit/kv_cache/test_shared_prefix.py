"""Shared prefixes (kv_cache/pool.py): a request reads the whole blocks of a prefix another slot
holds (a free slot's cached prefix or a running request's computed prompt) instead of copying
them; a slot others read is never lost under them; and outputs never change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.kernels import _C
from specdec.kv_cache.pool import KVCache
from tests.fixtures.engine import _record_prefixes

BLOCK = 256  # kernels.h kAttnBlock: shared prefixes come in whole blocks
LEN = 1024


def _pool(slots: int = 4, share: int = BLOCK, dtype=torch.float16) -> KVCache:
    return KVCache(
        2, slots, 1, LEN, 8, dtype, torch.device("cpu"), True, key_block=16, share_block=share
    )


def _fill(kv: KVCache, slot: int, start: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in range(kv.k.shape[0]):
        kv.store(
            layer,
            slot,
            start,
            torch.randn(n, 1, 8, generator=gen),
            torch.randn(n, 1, 8, generator=gen),
        )


def _seq(kv: KVCache, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention reads of ``slot``'s first ``n`` positions (its shared prefix included)."""
    ks, vs = [], []
    for layer in range(kv.k.shape[0]):
        k, v = kv.layer_slot(layer, slot, *kv.prefix_of(slot))
        ks.append(k.transpose(-1, -2).reshape(1, -1, 8)[:, :n])  # blocked keys -> [1, L, 8]
        vs.append(v[:, :n])
    return torch.stack(ks), torch.stack(vs)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()  # the tiny models' vocabulary


def _cached(kv: KVCache, tokens: list[int], seed: int) -> tuple[int, tuple]:
    """A slot that ran ``tokens`` and was freed with them cached; what it holds."""
    slot, _ = kv.allocate_for_prompt(tokens)
    _fill(kv, slot, 0, len(tokens), seed)
    held = _seq(kv, slot, len(tokens))
    kv.free(slot, tokens)
    return slot, held


def _same(a: tuple, b: tuple, n: int) -> bool:
    return all(torch.equal(x[..., :n, :], y[..., :n, :]) for x, y in zip(a, b))


def _reader(slots: int, doc_len: int, reused: int, seed: int):
    """A pool of ``slots`` where slot ``a`` cached a ``doc_len``-token document (``held``: its
    KV) and a running request in slot ``b`` reads its first ``reused`` tokens' whole blocks."""
    kv = _pool(slots=slots)
    doc = _prompt(doc_len, seed)
    a, held = _cached(kv, doc, seed=seed + 1)
    b, got = kv.allocate_for_prompt(doc[:reused] + [1])
    assert got == reused and kv.prefix_of(b) == (a, reused // BLOCK * BLOCK)
    return kv, doc, a, held, b


def test_a_cached_prefix_is_read_where_it_is() -> None:
    kv = _pool()
    doc = _prompt(700, 0)
    a, held = _cached(kv, doc, seed=1)
    b, reused = kv.allocate_for_prompt(doc[:600] + [1, 2])  # a's tail would be lost in place
    assert b != a and reused == 600
    assert kv.prefix_of(b) == (a, 2 * BLOCK)  # two whole blocks read from a, the rest copied
    assert _same(_seq(kv, b, 600), held, 600)
    # Below one block nothing is shared: the prefix is copied, as before.
    c, reused = kv.allocate_for_prompt(doc[:200] + [5])
    assert reused == 200 and kv.prefix_of(c) == (-1, 0)
    assert _same(_seq(kv, c, 200), held, 200)


def test_a_running_prompt_is_shared_once_computed() -> None:
    kv = _pool()
    doc = _prompt(700, 2)
    a, reused = kv.allocate_for_prompt(doc)
    assert reused == 0
    _fill(kv, a, 0, 700, seed=3)
    b, reused = kv.allocate_for_prompt(doc[:650] + [9])
    assert reused == 0  # nothing published yet: a's KV may still be computing
    kv.free(b, [])
    kv.publish(a, doc[:700])
    c, reused = kv.allocate_for_prompt(doc[:650] + [9])
    assert reused == 650 and kv.prefix_of(c) == (a, 2 * BLOCK)
    assert _same(_seq(kv, c, 650), _seq(kv, a, 650), 650)
    # A reader is never a prefix's holder: the next request reads a too.
    _fill(kv, c, 650, 100, seed=4)
    kv.publish(c, doc[:650] + [9] + _prompt(99, 5))
    d, reused = kv.allocate_for_prompt(doc[:650] + [9] + _prompt(99, 5) + [7])
    assert reused == 750 and kv.prefix_of(d) == (a, 2 * BLOCK)
    assert _same(_seq(kv, d, 750), _seq(kv, c, 750), 750)


def test_tenants_never_share() -> None:
    """``cache_salt``: a running request's prompt serves only requests of the same salt."""
    kv = _pool()
    doc = _prompt(700, 26)
    a, _ = kv.allocate_for_prompt(doc, cache_salt=1)
    _fill(kv, a, 0, 700, seed=27)
    kv.publish(a, doc, cache_salt=1)
    b, reused = kv.allocate_for_prompt(doc[:600] + [1], cache_salt=2)
    assert reused == 0 and kv.prefix_of(b) == (-1, 0)
    c, reused = kv.allocate_for_prompt(doc[:600] + [1], cache_salt=1)
    assert reused == 600 and kv.prefix_of(c) == (a, 2 * BLOCK)


def test_evicting_a_read_slot_gives_its_readers_copies() -> None:
    kv, _, a, held, b = _reader(slots=2, doc_len=700, reused=600, seed=6)
    other, reused = kv.allocate_for_prompt(_prompt(50, 8))  # only a is free: evicted
    assert other == a and reused == 0
    assert kv.prefix_of(b) == (-1, 0)
    assert _same(_seq(kv, b, 600), held, 600)
    _fill(kv, a, 0, 50, seed=9)  # the new owner writes from 0: b's copy is its own
    assert _same(_seq(kv, b, 600), held, 600)


def test_read_slots_are_evicted_last() -> None:
    kv, _, a, _, b = _reader(slots=4, doc_len=700, reused=600, seed=10)
    e, _ = _cached(kv, _prompt(300, 12), seed=13)  # used after a: a is the least recent
    empty = ({0, 1, 2, 3} - {a, b, e}).pop()
    f, _ = kv.allocate_for_prompt(_prompt(40, 14))  # the empty slot first
    g, _ = kv.allocate_for_prompt(_prompt(40, 15))  # then e, though a was used longer ago
    assert (f, g) == (empty, e)
    assert kv.prefix_of(b) == (a, 2 * BLOCK)


def test_taking_a_read_slot_in_place_keeps_what_its_readers_read() -> None:
    kv, doc, a, held, b = _reader(slots=3, doc_len=800, reused=600, seed=16)
    kv.allocate_for_prompt(_prompt(30, 18))  # the last empty slot: no victim left but a
    # A prompt reusing 700 of a's 800 in place keeps the 512 b reads.
    same, reused = kv.allocate_for_prompt(doc[:700] + [2])
    assert same == a and reused == 700 and kv.prefix_of(b) == (a, 2 * BLOCK)
    kv.free(same, [])  # a failed request: nothing cached, so b takes its own copy first
    assert kv.prefix_of(b) == (-1, 0)
    assert _same(_seq(kv, b, 600), held, 600)


def test_a_reader_keeping_less_than_its_prefix_is_rebased() -> None:
    kv, doc, a, held, b = _reader(slots=2, doc_len=900, reused=800, seed=19)
    kv.free(b, doc[:300])  # cached shorter than its prefix (a stop inside the prompt's blocks)
    assert kv.prefix_of(b) == (a, BLOCK)
    assert _same(_seq(kv, b, 300), held, 300)


def test_reset_prefix_cache_keeps_running_readers_whole() -> None:
    kv, doc, a, held, b = _reader(slots=3, doc_len=700, reused=600, seed=21)
    c, _ = _cached(kv, doc[:650] + [3], seed=23)  # a free reader
    assert kv.prefix_of(c)[0] == a
    kv.reset_prefix_cache()
    assert kv.prefix_of(b) == (-1, 0) and kv.prefix_of(c) == (-1, 0)
    assert _same(_seq(kv, b, 600), held, 600)
    assert not kv.v[:, a].any() and not kv.v[:, c].any()  # their pages given back


def test_mirror_replays_the_copies() -> None:
    """Tensor parallelism: every copy a share makes reaches the other ranks with its range."""
    kv, other = _pool(), _pool()
    calls = []
    kv.mirror = lambda method, args: calls.append((method, args))
    doc = _prompt(700, 24)
    a, _ = _cached(kv, doc, seed=25)
    _fill(other, a, 0, 700, seed=25)
    for method, args in calls:
        getattr(other, method)(*args)
    calls.clear()
    b, _ = kv.allocate_for_prompt(doc[:600] + [1])
    assert ("copy_prefix", (a, b, 600, 2 * BLOCK)) in calls
    for method, args in calls:
        getattr(other, method)(*args)
    assert torch.equal(other.k[:, b], kv.k[:, b]) and torch.equal(other.v[:, b], kv.v[:, b])


# ---- the engine -------------------------------------------------------------------------------
def _doc_prompts(n: int, doc_len: int) -> list[list[int]]:
    doc = _prompt(doc_len, 30)
    return [doc + _prompt(5 + 3 * i, 31 + i) for i in range(n)]


@pytest.mark.skipif(_C is None, reason="native kernels not built")
@pytest.mark.parametrize(
    "model,kv_dtype,spec",
    [
        ("tiny_llama", "auto", None),
        ("tiny_llama", "int8", {"method": "ngram", "num_speculative_tokens": 4}),
        ("tiny_gemma", "auto", {"method": "suffix", "num_speculative_tokens": 4}),  # windows
    ],
)
def test_engine_outputs_equal_copies(request, model, kv_dtype, spec) -> None:
    """Six requests on one 420-token document (one shared block): with shared prefixes, greedy
    and seeded outputs equal those of an engine without a prefix cache, cold (running prompts
    shared) and again with the document cached."""
    path = str(request.getfixturevalue(model))
    kw = {"max_model_len": 512, "max_num_seqs": 4, "max_num_batched_tokens": 128}
    kw |= {"kv_cache_dtype": kv_dtype}
    plain = LLM(path, enable_prefix_caching=False, **kw)
    llm = LLM(path, speculative_config=spec, **kw)
    assert llm.engine.kv.share_block == BLOCK
    seen = _record_prefixes(llm)
    prompts = [{"prompt_token_ids": p} for p in _doc_prompts(6, 420)]
    for sp in (
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
    ):
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
        for _ in range(2):  # cold, then cached
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            assert got == want
        llm.engine.reset_prefix_cache()
    assert len(seen) > 10 and all(n % BLOCK == 0 for _, n in seen)


@pytest.mark.skipif(_C is None, reason="native kernels not built")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_fused_and_op_by_op_layers_read_a_shared_prefix_alike(tiny_llama, kv_dtype) -> None:
    """Three sequences past one 256-position prefix held by slot 0: the fused native stack
    (shared reads) and the op-by-op layers (``KVCache.layer_slot``) give the bits that the
    sequences get with the prefix copied into their own slots."""
    from specdec.model.llama import SeqBatch

    llm = LLM(str(tiny_llama), max_model_len=512, kernels="native", kv_cache_dtype=kv_dtype)
    model = llm.engine.model
    kv = model.make_kv_cache(4, 512)
    doc = _prompt(256, 40)
    model.forward(torch.tensor(doc), torch.arange(256), SeqBatch([0], [0], [256]), kv)
    tails = [_prompt(n, 41 + n) for n in (1, 4, 9)]
    ids = torch.tensor([t for tail in tails for t in tail])
    pos = torch.tensor([256 + i for tail in tails for i in range(len(tail))])
    counts = [len(t) for t in tails]

    def run(fused: bool, shared: bool) -> torch.Tensor:
        model.use_fused_layers = fused
        try:
            if shared:
                batch = SeqBatch([1, 2, 3], [256] * 3, counts, [0] * 3, [256] * 3)
            else:
                for slot in (1, 2, 3):
                    kv.copy_prefix(0, slot, 256)
                batch = SeqBatch([1, 2, 3], [256] * 3, counts)
            return model.forward(ids, pos, batch, kv)
        finally:
            model.use_fused_layers = True

    want = run(True, False)
    kv.clear(1, 512), kv.clear(2, 512), kv.clear(3, 512)
    assert torch.equal(run(True, True), want)
    assert torch.equal(run(False, True), run(False, False))


@pytest.mark.skipif(_C is None, reason="native kernels not built")
def test_a_request_waits_for_the_blocks_a_running_one_is_prefilling(tiny_llama) -> None:
    """The second request could join while the first is halfway through the shared document
    (200 of its 300 tokens computed, no whole block beyond them): it waits a step and shares the
    whole document instead of computing its second half again. Outputs are unchanged."""
    kw = {"max_model_len": 512, "max_num_seqs": 4, "max_num_batched_tokens": 200}
    doc = _prompt(300, 50)
    prompts = [{"prompt_token_ids": doc + [10 + i] + _prompt(4, 51 + i)} for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(tiny_llama), enable_prefix_caching=False, **kw)
    llm = LLM(str(tiny_llama), **kw)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 300, 300]
    want = plain.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
