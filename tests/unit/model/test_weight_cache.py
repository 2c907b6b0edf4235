"""The weight cache (specdec/model/weight_cache.py): the first load writes the packed weights,
later loads read them (big weights) or map them, and the model computes exactly what a load
without the cache computes."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import ConfigError
from specdec.kernels import amx16_available
from tests.fixtures.kquants import write_kquant_gguf

PROMPTS = ["a b c a b c a b", "def f(x):\n    return"]
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "weights"
    monkeypatch.setenv("SPECDEC_WEIGHT_CACHE", str(d))
    return d


def _load(path, **kw):
    llm = LLM(str(path), max_model_len=128, **kw)
    return llm, llm.engine.model


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]


def _same_weights(a, b) -> None:
    for la, lb in zip(a.linears(), b.linears(), strict=True):
        wa, wb = la.weight, lb.weight
        assert (wa.qtype, wa.parts, wa.holds_blocks) == (wb.qtype, wb.parts, wb.holds_blocks)
        assert (wa.a8 is None) == (wb.a8 is None) and wa.x2 == wb.x2
        if wa.a8 is not None:
            assert torch.equal(wa.a8, wb.a8)
        if wa.x2:
            assert torch.equal(wa.x2_tiles, wb.x2_tiles)
        if wa.holds_blocks:
            assert torch.equal(wa.data, wb.data)


def _record_populated(monkeypatch) -> list[tuple[int, int]]:
    """From now on, the address ranges the cache maps up front (MADV_POPULATE_READ)."""
    from specdec.model import loader

    populated: list[tuple[int, int]] = []
    real = loader.advise_pages

    def record(a, advice):
        if advice == loader._MADV_POPULATE_READ:
            populated.append((a.ctypes.data, a.ctypes.data + a.nbytes))
        real(a, advice)

    monkeypatch.setattr(loader, "advise_pages", record)
    return populated


def _load_twice(path, monkeypatch, setting: str, value: int, before_second=lambda: None):
    """``path`` loaded (writing the cache), then again with ``weight_cache.<setting>`` set to
    ``value``: the first model, its tokens, and the second LLM and model."""
    from specdec.model import weight_cache

    first_llm, first = _load(path)
    want = _tokens(first_llm)
    monkeypatch.setattr(weight_cache, setting, value)
    before_second()
    second_llm, second = _load(path)
    return first, want, second_llm, second


@pytest.mark.parametrize("kind", ["Q4_0", "F16", "kquant", "BF16-bf16x2"])
def test_second_load_maps_the_cache_and_computes_the_same(
    kind, tmp_path, cache_dir, mk, monkeypatch
):
    kind, _, act = kind.partition("-")
    kw = {"activation_dtype": act} if act else {}
    if kind == "kquant":
        path = write_kquant_gguf(mk, tmp_path / "tiny-kq.gguf", "Q4_K_M")
    else:
        path = mk.write_gguf(tmp_path / f"tiny-{kind}.gguf", mk.SHAPES["tiny"], kind, seed=3)
    monkeypatch.setenv("SPECDEC_WEIGHT_CACHE", "off")
    if act == "bf16x2" and not amx16_available():  # refused, with the reason
        with pytest.raises(ConfigError, match="AMX-BF16"):
            _load(path, **kw)
        return
    ref_llm, ref = _load(path, **kw)
    assert ref._cache is None
    want = _tokens(ref_llm)
    monkeypatch.setenv("SPECDEC_WEIGHT_CACHE", str(cache_dir))
    first_llm, first = _load(path, **kw)
    assert first._cache.hits == 0
    files = list(cache_dir.glob("*.weights"))
    assert len(files) == 1 and files[0].name.startswith(path.name)
    assert _tokens(first_llm) == want
    second_llm, second = _load(path, **kw)
    assert second._cache.hits == len(second.linears())  # tied: lm_head is the embedding
    _same_weights(second, ref)
    w = second.layers[0].qkv.weight
    assert w.x2 == (act == "bf16x2")
    storage = w.a8 if w.a8 is not None else w.x2_tiles if w.x2 else w.data
    # the weights are views of the cache file's mapping, or of the buffer the small ones are read
    # into when they fill a huge page (the 16-bit files)
    mapped = second._cache._mapped
    in_arena = any(t.data_ptr() == storage.data_ptr() for t in second._cache._arena.values())
    assert in_arena == (kind in ("F16", "BF16"))
    assert in_arena or mapped.ctypes.data <= storage.data_ptr() < mapped.ctypes.data + mapped.nbytes
    assert _tokens(second_llm) == want
    ids = torch.tensor([3, 200, 3])
    assert torch.equal(second.embed(ids), ref.embed(ids))


def test_a_new_cache_file_removes_the_oldest_of_its_model(tmp_path, cache_dir, mk):
    # Stale files of the same model file name (other builds, other settings) beyond the newest
    # KEEP_PER_MODEL go; other models' files stay.
    from specdec.model.weight_cache import KEEP_PER_MODEL

    path = mk.write_gguf(tmp_path / "tiny.gguf", mk.SHAPES["tiny"], "Q4_1", seed=4)
    cache_dir.mkdir(parents=True)
    stale = []
    for i in range(4):
        p = cache_dir / f"tiny.gguf-{i:024x}.weights"
        p.write_bytes(b"old")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
        stale.append(p)
    other = cache_dir / f"other.gguf-{0:024x}.weights"
    other.write_bytes(b"other")
    _load(path)
    kept = sorted(p.name for p in cache_dir.glob("tiny.gguf-*.weights"))
    assert len(kept) == KEEP_PER_MODEL == 3
    assert [p.name for p in stale[-2:]] == [k for k in kept if k in {p.name for p in stale}]
    assert other.exists()


def test_cache_follows_the_file_and_the_settings(tmp_path, cache_dir, mk):
    path = mk.write_gguf(tmp_path / "tiny.gguf", mk.SHAPES["tiny"], "Q4_1", seed=4)
    _load(path)
    assert _load(path)[1]._cache.hits > 0
    # other settings: another file, made once
    assert _load(path, activation_dtype="float32")[1]._cache.hits == 0
    assert len(list(cache_dir.glob("*.weights"))) == 2
    assert _load(path, activation_dtype="float32")[1]._cache.hits > 0
    # the model file changes (here only its time): the old tiles are never read
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert _load(path)[1]._cache.hits == 0
    assert len(list(cache_dir.glob("*.weights"))) == 3


def test_damaged_cache_is_ignored_and_rewritten(tmp_path, cache_dir, mk, caplog):
    path = mk.write_gguf(tmp_path / "tiny.gguf", mk.SHAPES["tiny"], "Q8_0", seed=5)
    want = _tokens(_load(path)[0])
    (f,) = cache_dir.glob("*.weights")
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="specdec.model"):
        llm, model = _load(path)
    assert model._cache.hits == 0 and "unreadable" in caplog.text
    assert _tokens(llm) == want
    assert f.stat().st_size == size  # written again, whole
    assert _load(path)[1]._cache.hits > 0


def test_unwritable_cache_only_warns(tmp_path, monkeypatch, mk, caplog):
    path = mk.write_gguf(tmp_path / "tiny.gguf", mk.SHAPES["tiny"], "Q4_0", seed=6)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPECDEC_WEIGHT_CACHE", str(blocker / "weights"))
    with caplog.at_level(logging.WARNING, logger="specdec.model"):
        llm, model = _load(path)
    assert "not written" in caplog.text
    assert len(_tokens(llm)[0]) == SP.max_tokens


def test_hf_folder_is_cached(tiny_llama, cache_dir):
    want = _tokens(_load(tiny_llama, quantization="q8_0")[0])
    llm, model = _load(tiny_llama, quantization="q8_0")
    assert model._cache.hits == len(model.linears()) + (0 if model.cfg.tie_word_embeddings else 1)
    assert _tokens(llm) == want


def test_an_untied_embedding_is_left_unmapped_until_read(tmp_path, cache_dir, mk, monkeypatch):
    # The cache file is mapped up front (or, for weights of 2 MiB and more, read), all but an
    # untied embedding: a step reads a few of its rows, so only the rows of tokens seen need be
    # resident (a Qwen3-30B-A3B-shaped Q4_K_M file's embedding is 0.16 GiB). A tied embedding
    # is the output layer: mapped or read with the rest.
    import dataclasses

    shape = dataclasses.replace(mk.SHAPES["tiny"], tie_embeddings=False)
    path = mk.write_gguf(tmp_path / "untied.gguf", shape, "Q4_0", seed=5)
    first_llm, _ = _load(path)
    want = _tokens(first_llm)
    mapped = _record_populated(monkeypatch)
    second_llm, second = _load(path)
    assert second._cache.hits > 0 and mapped

    def span(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    def storage(w) -> torch.Tensor:
        return w.a8 if w.a8 is not None else w.data

    emb = span(storage(second._embed))
    assert not any(lo < emb[1] and emb[0] < hi for lo, hi in mapped)
    whole = second._cache._mapped
    for lin in second.linears():  # every weight a step reads whole was mapped, or read (big)
        lo, hi = span(storage(lin.weight))
        inside = whole.ctypes.data <= lo < whole.ctypes.data + whole.nbytes
        assert any(a <= lo and hi <= b for a, b in mapped) or not inside, lin.weight.qtype
    assert _tokens(second_llm) == want


def test_big_weights_are_read_into_memory_of_their_own(tmp_path, cache_dir, mk, monkeypatch):
    # Weights a step streams whole are read from the cache file into huge-page memory: mapped
    # in place, the file's 4 KiB pages made a 1.7B Q4_0 step 1.03-1.09x slower. The threshold is
    # lowered so that this tiny model's weights count as big; the bytes and tokens stay equal.
    from specdec.kernels import _C

    path = mk.write_gguf(tmp_path / "tiny-read.gguf", mk.SHAPES["tiny"], "Q4_0", seed=7)
    first, want, second_llm, second = _load_twice(path, monkeypatch, "READ_MIN_BYTES", 1)
    assert second._cache.hits == len(second.linears())
    _same_weights(second, first)
    mapped = second._cache._mapped
    for lin in second.linears():
        w = lin.weight
        ptr = (w.a8 if w.a8 is not None else w.data).data_ptr()
        assert not mapped.ctypes.data <= ptr < mapped.ctypes.data + mapped.nbytes
    assert _tokens(second_llm) == want
    e = next(iter(second._cache._index.values()))
    with pytest.raises(RuntimeError, match="ended before byte"):
        past_end = second._cache.path.stat().st_size - e["offset"] + 1
        _C.weight_from_file(str(second._cache.path), e["offset"], past_end)


def test_small_weights_are_read_into_one_huge_page_buffer(tmp_path, cache_dir, mk, monkeypatch):
    # Weights under READ_MIN_BYTES are read together into one buffer advised to huge pages (a
    # model of small layers had nearly all its weights in the file's 4 KiB pages); those ranges
    # of the file are not mapped as well. The bar is lowered so that this tiny model's weights
    # fill it; the bytes and tokens stay equal.
    from specdec.model import weight_cache

    path = mk.write_gguf(tmp_path / "tiny-arena.gguf", mk.SHAPES["tiny"], "Q4_0", seed=9)
    recorders: list[list[tuple[int, int]]] = []  # the second load's populated ranges
    first, want, second_llm, second = _load_twice(
        path,
        monkeypatch,
        "ARENA_MIN_BYTES",
        1,
        lambda: recorders.append(_record_populated(monkeypatch)),
    )
    populated = recorders[0]
    assert populated
    cache = second._cache
    assert cache.hits == len(second.linears()) and cache._arena
    _same_weights(second, first)
    mapped = cache._mapped
    starts = []
    for lin in second.linears():
        w = lin.weight
        ptr = (w.a8 if w.a8 is not None else w.data).data_ptr()
        assert not mapped.ctypes.data <= ptr < mapped.ctypes.data + mapped.nbytes
        starts.append(ptr)
    lo = min(starts)
    assert lo % weight_cache.HUGE_PAGE_SIZE == 0  # the buffer starts on a huge page
    assert all((p - lo) % 4096 == 0 for p in starts)  # each weight on a page of its own
    base = mapped.ctypes.data
    for name in cache._arena:  # their file ranges were not mapped too
        e = cache._index[name]
        a, b = base + e["offset"], base + e["offset"] + e["nbytes"]
        assert not any(p < b - 4096 and a + 4096 < q for p, q in populated), name
    assert _tokens(second_llm) == want


def test_routed_experts_stay_mapped(tmp_path, cache_dir, mk, monkeypatch):
    # A mixture of experts: the routed experts stay views of the mapped file (a step reads a few;
    # mapped pages can be given back under memory pressure), the rest go to the buffer.

    path = mk.write_gguf(tmp_path / "moe.gguf", mk.SHAPES["qwen3moe-tiny"], "Q4_0", seed=2)
    _, want, second_llm, second = _load_twice(path, monkeypatch, "ARENA_MIN_BYTES", 1)
    cache = second._cache
    mapped = cache._mapped
    routed = [n for n in cache._index if ".experts." in n]
    assert routed and cache._arena and not set(routed) & set(cache._arena)
    expert = second.layers[0].moe.experts[0].gate_up.weight
    ptr = (expert.a8 if expert.a8 is not None else expert.data).data_ptr()
    assert mapped.ctypes.data <= ptr < mapped.ctypes.data + mapped.nbytes
    assert _tokens(second_llm) == want
