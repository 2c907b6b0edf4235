"""benchmarks/make_synthetic_gguf.py: random-weight Llama GGUFs of a chosen shape with SmolLM2's
tokenizer load in our engine with its shape and tokenizer, and decode (speculation identical to
plain)."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from specdec.model.gguf_file import gguf_metadata, read_gguf
    from specdec.model.registry import resolve_model_path
    from specdec.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(
        gguf_metadata(read_gguf(resolve_model_path("smollm2-135m")))
    )


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_synthetic_gguf_loads_and_decodes(type_name: str, tmp_path, mk, smollm2_tokenizer) -> None:
    shape = mk.SHAPES["tiny"]
    path = mk.write_gguf(tmp_path / f"tiny-{type_name}.gguf", shape, type_name, seed=1)
    plain = LLM(str(path), max_model_len=256)
    cfg = plain.engine.model.cfg
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        shape.hidden, shape.layers, shape.heads, shape.kv_heads,
    )  # fmt: skip
    text = "def f(x):\n    return x + 1  # SmolLM2's tokenizer"
    assert plain.get_tokenizer().encode(text) == smollm2_tokenizer.encode(text)
    assert plain.get_tokenizer().chat_template == smollm2_tokenizer.chat_template
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = plain.generate(["a b c a b c a b"], sp)[0].outputs[0].token_ids
    assert len(want) == 12
    if type_name == "Q4_0":
        spec = LLM(str(path), max_model_len=256, speculative_config={"method": "ngram"})
        assert spec.generate(["a b c a b c a b"], sp)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_weights_are_stored_once(type_name: str, tmp_path, mk) -> None:
    # With 8-bit activations a q4_0/q4_1/q8_0 weight keeps only its repacked tiles (made straight
    # from the file's blocks, fused parts included); the blocks come back from them exactly,
    # so the float path and the embeddings are what a float-activation load gives.
    import torch

    from specdec.model.llama import SeqBatch

    path = mk.write_gguf(tmp_path / f"tiny-{type_name}.gguf", mk.SHAPES["tiny"], type_name, seed=2)
    a8 = LLM(str(path), max_model_len=64, activation_dtype="int8").engine.model
    f32 = LLM(str(path), max_model_len=64, activation_dtype="float32").engine.model
    assert a8.cfg.tie_word_embeddings  # the lm_head's tiles also serve the embedding rows
    for wa, wf in zip(a8.linears(), f32.linears(), strict=True):
        assert wa.weight.a8 is not None and not wa.weight.holds_blocks
        assert wf.weight.a8 is None and wf.weight.holds_blocks
        assert torch.equal(wa.weight.data, wf.weight.data)
        assert wa.weight.nbytes == wa.weight.a8.numel()
    ids = torch.tensor([5, 17, 5, 900, 3])
    assert torch.equal(a8.embed(ids), f32.embed(ids))

    def logits(model):
        kv = model.make_kv_cache(1, 64)
        h = model.forward(ids, torch.arange(5), SeqBatch([0], [0], [5]), kv)
        return model.compute_logits(h)

    with torch.inference_mode():
        before = logits(a8)
        a8.set_activation_dtype("float32")
        assert all(lin.weight.holds_blocks and lin.weight.a8 is None for lin in a8.linears())
        assert torch.equal(logits(a8), logits(f32))
        a8.set_activation_dtype("int8")
        assert not any(lin.weight.holds_blocks for lin in a8.linears())
        assert torch.equal(logits(a8), before)


def test_a_carried_tokenizer_makes_the_same_file(tmp_path, mk, monkeypatch) -> None:
    # Where the default model cannot be installed (the GPU machine), the files copy the tokenizer
    # from a GGUF of its fields alone (--tokenizer-only, then SPECDEC_SYNTH_TOKENIZER or
    # --tokenizer-from): the result must be the file made from the model itself, byte for byte.
    want = mk.write_gguf(tmp_path / "from-model.gguf", mk.SHAPES["tiny"], "Q4_0", seed=3)
    tok = mk.write_tokenizer_gguf(tmp_path / "tokenizer.gguf")
    assert tok.stat().st_size < want.stat().st_size
    monkeypatch.setenv("SPECDEC_SYNTH_TOKENIZER", str(tok))
    from specdec.model import registry

    def no_model(name: str) -> str:
        raise AssertionError(f"the model {name} was read, not the carried tokenizer")

    monkeypatch.setattr(registry, "resolve_model_path", no_model)
    got = mk.write_gguf(tmp_path / "from-tokenizer.gguf", mk.SHAPES["tiny"], "Q4_0", seed=3)
    assert got.read_bytes() == want.read_bytes()
