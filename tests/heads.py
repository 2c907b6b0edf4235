"""Random drafter heads for a tiny target, written in the official layouts users download."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def _target_config(target: Path) -> dict:
    return json.loads((target / "config.json").read_text())


def _layer(
    prefix: str, H: int, inter: int, heads: int, kv_heads: int, in_dim: int, g, D: int = 0
) -> dict:
    D = D or H // heads

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    return {
        prefix + "self_attn.q_proj.weight": r(heads * D, in_dim),
        prefix + "self_attn.k_proj.weight": r(kv_heads * D, in_dim),
        prefix + "self_attn.v_proj.weight": r(kv_heads * D, in_dim),
        prefix + "self_attn.o_proj.weight": r(H, heads * D),
        prefix + "mlp.gate_proj.weight": r(inter, H),
        prefix + "mlp.up_proj.weight": r(inter, H),
        prefix + "mlp.down_proj.weight": r(H, inter),
        prefix + "input_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        prefix + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
    }


def _head_config(c: dict, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings")  # fmt: skip
    out = {k: c[k] for k in keys if k in c}
    return out | {"num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]} | extra


def write_eagle(folder: Path, target: Path, layout: str = "safeailab", seed: int = 0) -> Path:
    """EAGLE-1: SafeAILab (pytorch_model.bin, fc with bias, layer 0 without input norm) or
    vLLM-style (model.safetensors, keys under ``model.``, fc without bias)."""
    folder.mkdir(parents=True, exist_ok=True)
    c = _target_config(target)
    H, g = c["hidden_size"], torch.Generator().manual_seed(seed)
    w = _layer("layers.0.", H, c["intermediate_size"], c["num_attention_heads"],
               c["num_key_value_heads"], H, g)  # fmt: skip
    del w["layers.0.input_layernorm.weight"]
    w["fc.weight"] = torch.randn(H, 2 * H, generator=g) * 0.2
    if layout == "safeailab":
        w["fc.bias"] = torch.randn(H, generator=g) * 0.1
        torch.save(w, folder / "pytorch_model.bin")
    else:
        save_file(
            {"model." + k: v.contiguous() for k, v in w.items()}, folder / "model.safetensors"
        )
    (folder / "config.json").write_text(json.dumps(_head_config(c, bias=layout == "safeailab")))
    return folder


def write_eagle3(
    folder: Path, target: Path, layout: str = "safeailab", draft_vocab: int = 0, seed: int = 0,
    aux_layers: tuple[int, ...] | None = None,
) -> Path:  # fmt: skip
    """EAGLE-3: SafeAILab (midlayer.*, draft_vocab_size) or vLLM's speculators format."""
    folder.mkdir(parents=True, exist_ok=True)
    c = _target_config(target)
    H, V, g = c["hidden_size"], c["vocab_size"], torch.Generator().manual_seed(seed)
    prefix = "midlayer." if layout == "safeailab" else "layers.0."
    w = _layer(prefix, H, c["intermediate_size"], c["num_attention_heads"],
               c["num_key_value_heads"], 2 * H, g)  # fmt: skip
    w[prefix + "hidden_norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    n_aux = len(aux_layers) if aux_layers else 3
    w["fc.weight"] = torch.randn(H, n_aux * H, generator=g) * 0.2
    w["norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    draft_vocab = draft_vocab or V
    used = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    w["lm_head.weight"] = torch.randn(draft_vocab, H, generator=g) * 0.3
    w["d2t"] = used - torch.arange(draft_vocab)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    w["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in w.items()}, folder / "model.safetensors")
    layer_cfg = _head_config(c, draft_vocab_size=draft_vocab)
    if layout == "safeailab":
        cfg = layer_cfg | {"architectures": ["LlamaForCausalLMEagle3"]}
    else:
        cfg = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer_cfg,
            "draft_vocab_size": draft_vocab,
            "norm_before_residual": True,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]},
            },
        }
        if aux_layers:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def write_medusa(
    folder: Path, target: Path, layout: str = "fasterdecoding", num_heads: int = 3, seed: int = 0
) -> Path:
    """Medusa: FasterDecoding's medusa_lm_head.pt or vLLM's blocks / lm_heads safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    c = _target_config(target)
    H, V, g = c["hidden_size"], c["vocab_size"], torch.Generator().manual_seed(seed)
    w = {}
    for i in range(num_heads):
        block_w, block_b = torch.randn(H, H, generator=g) * 0.2, torch.randn(H, generator=g) * 0.1
        proj = torch.randn(V, H, generator=g) * 0.3
        if layout == "fasterdecoding":
            w[f"{i}.0.linear.weight"], w[f"{i}.0.linear.bias"], w[f"{i}.1.weight"] = (
                block_w, block_b, proj,
            )  # fmt: skip
        else:
            w[f"blocks.{i}.layers.0.weight"], w[f"blocks.{i}.layers.0.bias"] = block_w, block_b
            w[f"lm_heads.{i}.weight"] = proj
    if layout == "fasterdecoding":
        torch.save(w, folder / "medusa_lm_head.pt")
        cfg = {"medusa_num_heads": num_heads, "medusa_num_layers": 1, "hidden_size": H}
    else:
        save_file({"medusa_heads." + k: v for k, v in w.items()}, folder / "model.safetensors")
        cfg = {"num_heads": num_heads, "num_hidden_layers": 1, "hidden_size": H,
               "architectures": ["MedusaModel"]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def write_mtp_target(folder: Path, target: Path, layout: str = "deepseek", seed: int = 0) -> Path:
    """A copy of ``target`` with one MTP layer in DeepSeek-V3's or MiMo's layout."""
    shutil.copytree(target, folder, dirs_exist_ok=True)
    c = _target_config(target)
    H, V, g = c["hidden_size"], c["vocab_size"], torch.Generator().manual_seed(seed)
    N = c["num_hidden_layers"]
    if layout == "deepseek":
        p = f"model.layers.{N}."
        w = _layer(p, H, c["intermediate_size"], c["num_attention_heads"],
                   c["num_key_value_heads"], H, g, c.get("head_dim") or 0)  # fmt: skip
        w[p + "enorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[p + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 0.2
        w[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[p + "shared_head.head.weight"] = torch.randn(V, H, generator=g) * 0.3
    else:
        p = "model.mtp_layers.0."
        w = _layer(p, H, c["intermediate_size"], c["num_attention_heads"],
                   c["num_key_value_heads"], H, g, c.get("head_dim") or 0)  # fmt: skip
        w[p + "token_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[p + "hidden_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[p + "input_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 0.2
        w[p + "final_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    save_file({k: v.contiguous() for k, v in w.items()}, folder / "mtp.safetensors")
    (folder / "config.json").write_text(json.dumps(c | {"num_nextn_predict_layers": 1}))
    return folder


def method_cases(
    target: Path, draft: Path, tmp: Path, suffix_k: int | None = 8, skip_layers: int = 1,
    eagle3_layout: str = "speculators", draft_vocab: int = 0,
) -> dict:  # fmt: skip
    """One case per method of the table on ``target``: (target folder, speculative_config), with
    every head written for it under ``tmp`` and ``draft`` as the draft model (same tokenizer).
    ``suffix_k`` None leaves suffix decoding's own default (32); ``skip_layers``: layer_skip's
    draft layers; the EAGLE-3 head (also hybrid's) in ``eagle3_layout`` with ``draft_vocab``
    (0: the target's vocabulary)."""
    t = str(target)
    eagle3 = str(write_eagle3(tmp / "eagle3", target, eagle3_layout, draft_vocab=draft_vocab))
    suffix = {"method": "suffix"} | (
        {} if suffix_k is None else {"num_speculative_tokens": suffix_k}
    )
    return {
        "ngram": (t, {"method": "ngram", "num_speculative_tokens": 3}),
        "suffix": (t, suffix),
        "draft_model": (t, {"method": "draft_model", "model": str(draft)}),
        "layer_skip": (t, {"method": "layer_skip", "num_draft_layers": skip_layers}),
        "eagle": (t, {"method": "eagle", "model": str(write_eagle(tmp / "e", target))}),
        "eagle3": (t, {"method": "eagle3", "model": eagle3}),
        "medusa": (t, {"method": "medusa", "model": str(write_medusa(tmp / "m", target))}),
        "mtp": (str(write_mtp_target(tmp / "mtp", target)), {"method": "mtp"}),
        "hybrid": (t, {"method": "hybrid", "model": eagle3}),
    }
