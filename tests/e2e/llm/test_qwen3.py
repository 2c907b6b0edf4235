"""Qwen3 (dense): the GGUF path equals the Hugging Face path of the same weights, and every
drafter in the method table is exact on it, greedy and seeded (transformers' logits:
tests/unit/model/test_tiny_model.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from specdec import LLM, SamplingParams
from specdec.kernels import get_ops
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.model.loader import load_checkpoint
from specdec.spec_decode import METHODS
from tests.fixtures.engine import _generate
from tests.fixtures.heads import method_cases, write_mtp_target
from tests.fixtures.models import _LAYER_NAMES, make_tiny_model
from tests.fixtures.prompts import PROMPTS


def write_qwen3_gguf(folder: Path, path: Path) -> Path:
    """The folder's float32 weights as a ``qwen3`` GGUF (llama.cpp's names and metadata; Qwen's
    q/k rows are not permuted, as llama.cpp's converter leaves them)."""
    import json

    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr.astype(np.float32))
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", arr)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", arr)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", arr)
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            w.add_tensor(f"blk.{i}.{_LAYER_NAMES[rest.removesuffix('.weight')]}.weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    model = LlamaModel(
        load_checkpoint(path), get_ops("auto"), torch.device("cpu"), torch.float32, "fp32", 256
    )
    kv = model.make_kv_cache(1, 256)
    n = len(ids)
    return model.compute_logits(
        model.forward(torch.tensor(ids), torch.arange(n), SeqBatch([0], [0], [n]), kv)
    )


def test_gguf_and_hugging_face_paths_agree(tiny_qwen3, tmp_path) -> None:
    gguf_path = write_qwen3_gguf(tiny_qwen3, tmp_path / "tiny-qwen3.gguf")
    ckpt = load_checkpoint(gguf_path)
    assert ckpt.arch.qk_norm and ckpt.arch.head_dim == 32 and ckpt.arch.hidden_size == 64
    ids = [(i * 29 + 7) % 250 for i in range(33)]
    assert torch.equal(_logits(gguf_path, ids), _logits(tiny_qwen3, ids))


@pytest.fixture(scope="module")
def qwen3_cases(tiny_qwen3, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    tmp = tmp_path_factory.mktemp("qwen3_heads")
    draft = make_tiny_model(tmp / "draft", "qwen3", seed=5, num_layers=1)
    return method_cases(tiny_qwen3, draft, tmp)


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_exact_on_qwen3(method, qwen3_cases) -> None:
    """Greedy and seeded sampled output of each drafter equals plain decoding on Qwen3."""
    assert method in qwen3_cases, f"method {method!r} has no Qwen3 case"
    target, spec = qwen3_cases[method]
    params = [
        SamplingParams(temperature=0, max_tokens=16 + 3 * i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ] + [
        SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=16, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    prompts_params = params[: len(PROMPTS)], params[len(PROMPTS) :]
    for p in prompts_params:
        ids, num_drafts = _generate(target, spec | {"adaptive": False}, p)
        assert ids == _generate(target, None, p)[0]
        assert num_drafts > 0


def test_a_head_with_the_wrong_head_size_is_refused(tiny_qwen3, tmp_path) -> None:
    """An MTP layer written for hidden / heads (16) on a target of head_dim 32: a one-line error
    naming the tensor, not a head that silently drafts nothing."""
    import json

    folder = write_mtp_target(tmp_path / "mtp", tiny_qwen3)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"head_dim": 16}))
    with pytest.raises(
        ValueError,
        match=r"self_attn\.q_proj has shape \(128, 64\).*8 heads|"
        r"self_attn\.q_proj has shape .* heads x 16",
    ):
        LLM(str(folder), speculative_config={"method": "mtp"}, max_model_len=128)
