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
