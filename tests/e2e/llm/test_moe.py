"""Mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE): the GGUF path equals the Hugging Face
path of the same weights, a row's output never depends on the rows beside it, and every drafter
in the method table is exact on Qwen3-MoE, greedy and seeded (transformers' logits:
tests/unit/model/test_tiny_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from specdec.kernels import get_ops
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.model.loader import load_checkpoint
from specdec.spec_decode import METHODS
from tests.fixtures.engine import _generate
from tests.fixtures.heads import method_cases
from tests.fixtures.models import _LAYER_NAMES, make_tiny_model
from tests.fixtures.prompts import PROMPTS

QT = gguf.GGMLQuantizationType
_MOE_NAMES = {
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
}  # fmt: skip
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for the llama architecture (interleaved rotary)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _add(w: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: QT) -> None:
    arr = np.ascontiguousarray(arr.astype(np.float32))
    if qtype == QT.F32 or arr.ndim == 1 or "ffn_gate_inp" in name:
        w.add_tensor(name, arr)  # NOTE: norms and routers stay float32, as llama.cpp keeps them
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def write_moe_gguf(folder: Path, path: Path, qtype: QT = QT.F32) -> Path:
    """The folder's weights as llama.cpp names them: experts stacked [E, out, in]."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = _GGUF_ARCH[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, arr in load_file(str(folder / "model.safetensors")).items():
        top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
        if name in top or name == "lm_head.weight":
            _add(w, f"{top.get(name, 'output')}.weight", arr, qtype)
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        rest, suffix = rest.rsplit(".", 1)
        if ".experts." in rest:
            _, e, part = rest.rsplit(".", 2)
            experts.setdefault((i, _EXPERT_NAMES[part]), {})[int(e)] = arr
            continue
        if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            arr = _permute(arr, heads if rest.endswith("q_proj") else kv_heads)
        if rest == "mlp.shared_expert_gate":
            arr = arr.reshape(-1)  # NOTE: llama.cpp's shape: a vector
        out = _MOE_NAMES.get(rest) or _LAYER_NAMES[rest]
        _add(w, f"blk.{i}.{out}.{suffix}", arr, qtype)
    for (i, out), parts in experts.items():
        _add(w, f"blk.{i}.{out}.weight", np.stack([parts[e] for e in sorted(parts)]), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _model(path: Path, quantization: str = "fp32", activations: str = "float32") -> LlamaModel:
    return LlamaModel(
        load_checkpoint(path), get_ops("auto"), torch.device("cpu"), torch.float32, quantization,
        256, activations,
    )  # fmt: skip


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    kv = model.make_kv_cache(1, 256)
    n = len(ids)
    return model.compute_logits(
        model.forward(torch.tensor(ids), torch.arange(n), SeqBatch([0], [0], [n]), kv)
    )


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "tiny_mixtral", "tiny_qwen2_moe"])
def test_gguf_and_hugging_face_paths_agree(fixture, tmp_path, request) -> None:
    folder = request.getfixturevalue(fixture)
    gguf_path = write_moe_gguf(folder, tmp_path / "tiny-moe.gguf")
    hf, ours = load_checkpoint(folder).arch, load_checkpoint(gguf_path).arch
    assert ours.num_experts == hf.num_experts > 0
    assert ours.num_experts_per_tok == hf.num_experts_per_tok
    assert ours.moe_intermediate_size == hf.moe_intermediate_size
    assert ours.shared_expert_intermediate_size == hf.shared_expert_intermediate_size
    # NOTE: llama.cpp's convention per architecture equals each tiny config's
    assert ours.norm_topk_prob == hf.norm_topk_prob == (fixture != "tiny_qwen2_moe")
    ids = [(i * 29 + 7) % 250 for i in range(33)]
    assert torch.equal(_logits(_model(gguf_path), ids), _logits(_model(folder), ids))


def test_mlp_only_layers_stay_dense(tiny_qwen3_moe) -> None:
    model = _model(tiny_qwen3_moe)
    assert [lw.moe is not None for lw in model.layers] == [True, False, True]


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "tiny_qwen2_moe"])
@pytest.mark.parametrize(
    ("qtype", "activations"),
    [(q, a) for q in (QT.Q4_0, QT.Q4_1, QT.Q8_0) for a in ("float32", "int8")]
    + [(QT.BF16, "float32")],  # 16-bit weights take no 8-bit activations
)
def test_moe_rows_are_batch_invariant(fixture, qtype, activations, tmp_path, request) -> None:
    """A row's MoE output alone equals its output among rows routed to other experts, and the
    grouped step equals running each row's experts one by one."""
    path = write_moe_gguf(request.getfixturevalue(fixture), tmp_path / "q.gguf", qtype)
    model = _model(path, "auto", activations)
    moe = model.layers[0].moe
    assert moe is not None and moe.experts[0].gate_up.weight.qtype == qtype.name.lower()
    h = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    batch = moe(h)
    ids = moe.route(h)[1]
    assert len(torch.unique(ids)) == len(moe.experts)  # rows spread over every expert
    for row in range(0, len(h), 7):
        assert torch.equal(moe(h[row : row + 1])[0], batch[row])
    moe.grouped = False
    assert torch.equal(moe(h), batch)


@pytest.fixture(scope="module")
def moe_cases(tiny_qwen3_moe, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    tmp = tmp_path_factory.mktemp("moe_heads")
    draft = make_tiny_model(tmp / "draft", "qwen3", seed=5, num_layers=1)
    return method_cases(tiny_qwen3_moe, draft, tmp)


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_exact_on_qwen3_moe(method, moe_cases) -> None:
    """Greedy and seeded sampled output of each drafter equals plain decoding on Qwen3-MoE."""
    from specdec import SamplingParams

    assert method in moe_cases, f"method {method!r} has no Qwen3-MoE case"
    target, spec = moe_cases[method]
    greedy = [
        SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(3)
    ]
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=12, ignore_eos=True)
        for i in range(3)
    ]
    for params in (greedy, seeded):
        params = (params * len(PROMPTS))[: len(PROMPTS)]
        ids, num_drafts = _generate(target, spec | {"adaptive": False}, params)
        assert ids == _generate(target, None, params)[0]
        assert num_drafts > 0


@pytest.mark.parametrize("mix", ["Q4_0", "Q4_K_M"])
def test_synthetic_moe_gguf_decodes_batch_invariant(mix, mk, tmp_path) -> None:
    """benchmarks/make_synthetic_gguf.py's qwen3moe-tiny, Q4_0 or K-quants (Q6_K down, Q4_K
    rest): experts keep their formats (K-quants become Q8_0 where their 8-bit kernels are not
    native, as dense layers do); batched, alone and speculative greedy output agree."""
    from specdec import LLM, SamplingParams
    from specdec import kernels as K
    from tests.fixtures.kquants import quantize

    def types(name: str) -> QT:
        if mix == "Q4_0":
            return QT.Q8_0 if name.startswith(("token_embd", "output.")) else QT.Q4_0
        return QT.Q6_K if name.startswith(("token_embd", "output.")) or "down" in name else QT.Q4_K

    path = mk.write_gguf(
        tmp_path / f"moe-{mix}.gguf", mk.SHAPES["qwen3moe-tiny"], "F32", 3, types=types,
        quantize=None if mix == "Q4_0" else lambda rows, t: quantize(rows, t.name.lower()),
    )  # fmt: skip
    plain = LLM(str(path), max_model_len=256)
    expert = plain.engine.model.layers[1].moe.experts[7]
    if mix == "Q4_0":
        assert (expert.gate_up.weight.qtype, expert.down.weight.qtype) == ("q4_0", "q4_0")
    elif K.kquant_int8_fast():
        assert (expert.gate_up.weight.qtype, expert.down.weight.qtype) == ("q4_k", "q6_k")
    else:
        assert (expert.gate_up.weight.qtype, expert.down.weight.qtype) == ("q8_0", "q8_0")
    prompts = ["a b c a b c a b", "def f(x):\n    return", "Once upon a time"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    assert batched == [plain.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert len({tuple(t) for t in batched}) > 1  # not a degenerate model
    spec = LLM(str(path), max_model_len=256, speculative_config={"method": "ngram"})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == batched
