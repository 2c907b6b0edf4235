"""A 16-bit KV cache (kv_cache_dtype): exact kernels over rounded entries, the engine end to end."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import ConfigError
from specdec.kernels import _C, get_ops
from specdec.kv_cache.pool import KVCache, blocked_keys
from specdec.model.loader import load_checkpoint
from tests.fixtures.prompts import bench_prompts

SHAPES = [  # T, H, Hkv, D, cache length, start, sliding window, softcap
    (3, 9, 3, 64, 100, 37, 0, 0.0),
    (1, 4, 1, 256, 70, 50, 16, 30.0),
    (5, 6, 2, 72, 64, 20, 0, 0.0),  # D % 16 != 0: the masked value tail
    (33, 8, 2, 64, 40, 0, 0, 0.0),  # a prefill from position 0
]


def _isas() -> list[str]:
    isas = ["portable"]
    if _C.has_avx2_build() and _C.cpu_features()["avx2"]:
        isas.append("avx2")
    if _C.has_avx512_build() and _C.cpu_features()["avx512f"]:
        isas.append("avx512")
    return isas


@pytest.mark.parametrize("isa", _isas())
def test_native_attention_over_halves_equals_float_attention_over_the_rounded_values(isa) -> None:
    before = _C.isa()
    _C.set_isa(isa)
    try:
        gen = torch.Generator().manual_seed(0)
        for t, h, hkv, d, length, start, window, cap in SHAPES:
            q = torch.randn(t, h, d, generator=gen)
            k = (3 * torch.randn(hkv, length, d, generator=gen)).half()
            v = torch.randn(hkv, length, d, generator=gen).half()
            got = _C.attention(q, blocked_keys(k, 16), v, start, d**-0.5, window, cap)
            want = _C.attention(
                q, blocked_keys(k.float(), 16), v.float(), start, d**-0.5, window, cap
            )
            assert torch.equal(got, want), (isa, d)
    finally:
        _C.set_isa(before)


def test_native_attention_rejects_mixed_cache_dtypes() -> None:
    q = torch.randn(1, 2, 64)
    k = blocked_keys(torch.randn(1, 16, 64).half(), 16)
    with pytest.raises(RuntimeError, match="must both be float32, both float16 or both int8"):
        _C.attention(q, k, torch.randn(1, 16, 64), 0, 0.125, 0, 0.0)


def test_torch_attention_over_halves_equals_float_attention_over_the_rounded_values() -> None:
    ops = get_ops("torch")
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 6, 32, generator=gen)
    k = torch.randn(2, 20, 32, generator=gen).half()
    v = torch.randn(2, 20, 32, generator=gen).half()
    got = ops.attention(q, k, v, 16, 0.2, 0, 0.0)
    assert got.dtype == torch.float32
    assert torch.equal(got, ops.attention(q, k.float(), v.float(), 16, 0.2, 0, 0.0))


@pytest.mark.parametrize("key_block", [0, 16])
def test_store_rounds_to_the_nearest_half(key_block: int) -> None:
    kv = KVCache(1, 2, 2, 40, 8, torch.float16, torch.device("cpu"), key_block=key_block)
    k, v = torch.randn(2, 21, 2, 8, generator=torch.Generator().manual_seed(2))
    kv.store(0, 1, 3, k, v)
    assert kv.k.dtype == kv.v.dtype == torch.float16
    assert torch.equal(kv.keys(0, 1)[:, 3:24], k.half().transpose(0, 1))
    assert torch.equal(kv.v[0, 1, :, 3:24], v.half().transpose(0, 1))


def test_half_cache_halves_the_bytes_per_token() -> None:
    f32 = KVCache.bytes_per_token(30, 3, 64, torch.float32)
    assert KVCache.bytes_per_token(30, 3, 64, torch.float16) * 2 == f32


def test_engine_with_a_half_cache_speculates_exactly(tiny_llama, tiny_draft) -> None:
    prompts = [[5, 9, 12, 5, 9, 12, 5, 9], [3, 4, 5, 6, 7, 3, 4, 5, 6], [100, 7, 100, 7, 100]]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_llama), kv_cache_dtype="fp16")
    assert plain.engine.kv.k.dtype == plain.engine.kv.v.dtype == torch.float16
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "suffix", "num_speculative_tokens": 6},
        {"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 2},
        {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 3},
    ):
        spec["adaptive"] = False  # drafting must happen (the tiny models' drafts never pay)
        llm = LLM(str(tiny_llama), kv_cache_dtype="float16", speculative_config=spec)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        assert got == want, spec["method"]
        drafter_kv = getattr(
            llm.engine.speculator.proposer, "kv", None
        )  # a model drafter's own cache
        assert drafter_kv is None or drafter_kv.k.dtype == torch.float16
        assert llm.engine.spec_stats.num_drafts > 0


def test_a_kv_budget_holds_twice_the_sequences_in_half(tiny_llama) -> None:
    cfg = load_checkpoint(tiny_llama).arch
    per_slot = 64 * KVCache.bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32
    )
    budget = 3 * per_slot  # three float32 slots, six half ones
    f32 = LLM(str(tiny_llama), max_model_len=64, max_num_seqs=8, kv_cache_memory=budget,
              kv_cache_dtype="float32")  # fmt: skip
    f16 = LLM(str(tiny_llama), max_model_len=64, max_num_seqs=8, kv_cache_memory=budget,
              kv_cache_dtype="float16")  # fmt: skip
    assert f32.engine.scheduler.max_num_seqs == 3
    assert f16.engine.scheduler.max_num_seqs == 6


def test_auto_is_half_on_the_native_kernels_else_the_model_dtype(tiny_llama) -> None:
    assert LLM(str(tiny_llama), kernels="native").engine.kv.k.dtype == torch.float16
    assert LLM(str(tiny_llama), kernels="torch").engine.kv.k.dtype == torch.float32
    assert LLM(str(tiny_llama), kv_cache_dtype="f32").engine.kv.k.dtype == torch.float32


def test_kv_cache_dtype_errors_are_clear(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32, float16"):
        LLM(str(tiny_llama), kv_cache_dtype="int4")
    with pytest.raises(
        ConfigError, match="native kernels keep the KV cache in float32, float16 or int8"
    ):
        LLM(str(tiny_llama), kernels="native", kv_cache_dtype="bf16")
    llm = LLM(str(tiny_llama), kernels="torch", kv_cache_dtype="bfloat16")
    assert llm.engine.kv.k.dtype == torch.bfloat16
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_real_model_with_a_smaller_cache(kv_dtype: str) -> None:
    """SmolLM2-135M: next-token choices over a prefill agree with the float32 cache's almost
    everywhere (float16: 99.5% measured), and speculation stays exact over the smaller cache."""
    from specdec.engine.loading import load_model
    from specdec.model.llama import SeqBatch

    logits = {}
    for dtype in ("float32", kv_dtype):
        model, tok = load_model(
            "smollm2-135m", torch.device("cpu"), torch.float32, "auto", "auto", 512, "auto", dtype
        )
        ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 20)
        kv = model.make_kv_cache(1, 512)
        assert kv.k.dtype == getattr(torch, dtype)
        h = model.forward(
            torch.tensor(ids), torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv
        )
        logits[dtype] = model.compute_logits(h)
    same = logits[kv_dtype].argmax(-1) == logits["float32"].argmax(-1)
    assert same.float().mean() >= 0.97
    prompts = [p["turns"][0] for p in bench_prompts(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    plain = LLM("smollm2-135m", kv_cache_dtype=kv_dtype, max_model_len=1024)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    for method in ("ngram", "suffix"):
        spec = {"method": method, "num_speculative_tokens": 5, "adaptive": False}
        llm = LLM(
            "smollm2-135m", kv_cache_dtype=kv_dtype, max_model_len=1024, speculative_config=spec
        )
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want, method


def test_bench_takes_the_kv_cache_dtype(tiny_llama, capsys) -> None:
    from specdec.cli import main

    argv = ["bench", "forward-cost", "--model", str(tiny_llama), "--kv-cache-dtype", "f16"]
    assert main(argv + ["--context", "20", "--ns", "1,2", "--repeats", "1", "--warmup", "0"]) == 0
    assert "KV cache float16" in capsys.readouterr().out
