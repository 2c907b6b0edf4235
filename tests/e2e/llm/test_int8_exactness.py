"""8-bit activations keep speculation exact: every drafter's greedy output equals plain decoding
with the same activation precision (the int8 kernels are batch-invariant like the float ones).

On a CPU without AVX-512 VNNI the scalar twin of the kernels runs (bit-identical, slower), so
this holds on every machine that builds the native kernels.
"""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from tests.fixtures.prompts import PROMPTS

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "suffix": {"method": "suffix", "num_speculative_tokens": 5},
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 1},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}


def _llm(tiny_llama, cfg: dict | None) -> LLM:
    if cfg is not None:
        cfg = {"adaptive": False, **cfg}
        if cfg["method"] == "draft_model":
            cfg["model"] = str(tiny_llama)  # the target as its own draft: every draft accepted
    return LLM(
        str(tiny_llama), speculative_config=cfg, quantization="q8_0", activation_dtype="int8",
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain(tiny_llama):
    llm = _llm(tiny_llama, None)
    assert llm.engine.model.activation_dtype == "int8"
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 7 * i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    return params, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_int8_greedy_identical(name: str, tiny_llama, plain) -> None:
    params, expected = plain
    llm = _llm(tiny_llama, CONFIGS[name])
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == expected
    stats = llm.spec_decode_stats
    assert stats.num_drafts > 0
    if name == "draft_model":  # the same weights and arithmetic: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_int8_differs_from_float32(tiny_llama) -> None:
    # The check above would pass vacuously if int8 silently ran the float kernels.
    llm = LLM(str(tiny_llama), quantization="q8_0", activation_dtype="float32", max_model_len=256)
    logits_int8 = _first_logits(_llm(tiny_llama, None))
    assert logits_int8 is not None
    assert not _same(logits_int8, _first_logits(llm))


def _first_logits(llm: LLM):
    import torch

    from specdec.model.llama import SeqBatch

    model = llm.engine.model
    ids = torch.tensor(llm.get_tokenizer().encode(PROMPTS[0]))
    kv = model.make_kv_cache(1, len(ids) + 1)
    h = model.forward(ids, torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv)
    return model.compute_logits(h)


def _same(a, b) -> bool:
    import torch

    return torch.equal(a, b)
