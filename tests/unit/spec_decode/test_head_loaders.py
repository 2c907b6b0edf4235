"""Loading drafter heads: every official layout, and clear errors for heads that do not fit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams
from specdec.config import ConfigError, SpeculativeConfig
from specdec.spec_decode import METHODS, canonical_method
from tests.fixtures.heads import write_eagle, write_eagle3, write_medusa, write_mtp_target
from tests.fixtures.models import make_tiny_model


def _llm(target, spec: dict) -> LLM:
    return LLM(str(target), max_model_len=128, speculative_config=spec)


def test_mtp_aliases_and_vllm_only_keys() -> None:
    for alias in ("deepseek_mtp", "mimo_mtp", "qwen3_next_mtp", "ernie_mtp"):
        assert canonical_method(alias) == "mtp"
    cfg = SpeculativeConfig.from_any(
        {
            "method": "deepseek_mtp",
            "num_speculative_tokens": 1,
            "disable_padded_drafter_batch": True,
            "enforce_eager": True,
        }  # fmt: skip
    )
    assert cfg.method == "mtp" and cfg.num_speculative_tokens == 1
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        SpeculativeConfig.from_any({"method": "eagle", "model": "x", "tensor_parallel_size": 2})
    for method, info in METHODS.items():  # the table drives validation
        if info.needs_model:
            with pytest.raises(ConfigError, match="model is required"):
                SpeculativeConfig.from_any({"method": method})


def test_vllm_eagle_snippet_runs_as_written(tiny_llama, tmp_path) -> None:
    """vLLM's EAGLE example, the model names pointing at local folders."""
    head = write_eagle(tmp_path / "EAGLE-LLaMA3-Instruct-8B", tiny_llama, "safeailab")
    prompts = ["The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(
        model=str(tiny_llama),
        speculative_config={
            "model": str(head),
            "draft_tensor_parallel_size": 1,
            "num_speculative_tokens": 2,
            "method": "eagle",
        },
    )
    outputs = llm.generate(prompts, sampling_params)
    assert outputs[0].outputs[0].text and outputs[0].prompt == prompts[0]


def test_head_for_another_hidden_size_is_refused(tiny_llama, tmp_path) -> None:
    bigger = make_tiny_model(tmp_path / "bigger", "llama", seed=5, num_layers=4, hidden_size=96)
    cases = {
        "eagle": write_eagle(tmp_path / "e", bigger),
        "eagle3": write_eagle3(tmp_path / "e3", bigger),
        "medusa": write_medusa(tmp_path / "m", bigger),
    }
    for method, head in cases.items():
        with pytest.raises(ConfigError, match=r"hidden_size is 96, the target's is 64"):
            _llm(tiny_llama, {"method": method, "model": str(head)})


def test_wrong_shapes_name_the_tensor(tiny_llama, tmp_path) -> None:
    head = write_eagle(tmp_path / "e", tiny_llama, "vllm")
    (head / "config.json").write_text("{}")  # no hidden_size to compare: shapes must catch it
    w = load_file(head / "model.safetensors")
    w["model.fc.weight"] = torch.zeros(64, 100)
    save_file(w, head / "model.safetensors")
    with pytest.raises(ConfigError, match=r"fc.weight has shape \(64, 100\).*\(64, 128\)"):
        _llm(tiny_llama, {"method": "eagle", "model": str(head)})
    e3 = write_eagle3(tmp_path / "e3", tiny_llama, draft_vocab=50)
    w = load_file(e3 / "model.safetensors")
    w["t2d"] = torch.zeros(1000, dtype=torch.bool)
    save_file(w, e3 / "model.safetensors")
    with pytest.raises(ConfigError, match=r"t2d has shape \(1000,\)"):
        _llm(tiny_llama, {"method": "eagle3", "model": str(e3)})
    m = write_medusa(tmp_path / "m", tiny_llama, "vllm")
    w = load_file(m / "model.safetensors")
    w["medusa_heads.lm_heads.1.weight"] = torch.zeros(300, 64)
    save_file(w, m / "model.safetensors")
    with pytest.raises(ConfigError, match=r"head 1 projection has shape \(300, 64\)"):
        _llm(tiny_llama, {"method": "medusa", "model": str(m)})


def test_eagle3_aux_layers_from_config(tiny_llama, tmp_path) -> None:
    head = write_eagle3(tmp_path / "e3", tiny_llama, "speculators", aux_layers=(1, 3))
    llm = _llm(tiny_llama, {"method": "eagle3", "model": str(head)})
    assert llm.engine.speculator.hidden_layers == (1, 3)
    assert llm.engine.runner.hidden_layers == (1, 3)
    bad = write_eagle3(tmp_path / "bad", tiny_llama, "speculators", aux_layers=(1, 9))
    with pytest.raises(ConfigError, match=r"not all layers of the target \(it has 4\)"):
        _llm(tiny_llama, {"method": "eagle3", "model": str(bad)})


class _Payload:
    pass


def test_only_plain_tensors_are_unpickled(tiny_llama, tmp_path) -> None:
    head = write_eagle(tmp_path / "e", tiny_llama, "safeailab")
    w = torch.load(head / "pytorch_model.bin", weights_only=True)
    w["config"] = _Payload()  # an arbitrary class: weights_only refuses to unpickle it
    torch.save(w, head / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="weights_only"):
        _llm(tiny_llama, {"method": "eagle", "model": str(head)})


def test_missing_heads_and_mtp_layers(tiny_llama, tmp_path) -> None:
    with pytest.raises(ConfigError, match="is not a folder"):
        _llm(tiny_llama, {"method": "eagle", "model": str(tmp_path / "nowhere")})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no weights"):
        _llm(tiny_llama, {"method": "medusa", "model": str(empty)})
    with pytest.raises(ConfigError, match="has no MTP layers"):
        _llm(tiny_llama, {"method": "mtp"})
    mimo = write_mtp_target(tmp_path / "mimo", tiny_llama, "mimo")
    llm = _llm(mimo, {"method": "mimo_mtp", "num_speculative_tokens": 2})
    assert llm.engine.spec.method == "mtp"
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_eagle3_without_a_head_names_where_one_ships(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="a head ships only for smollm2-135m"):
        _llm(tiny_llama, {"method": "eagle3"})
