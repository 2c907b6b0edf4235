"""Architecture hyper-parameters, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "mixtral",
)  # fmt: skip


class UnsupportedModelError(ValueError):
    """Architecture, tensor type or model layout this runtime cannot run."""


@dataclass
class ArchConfig:
    arch: str  # "llama" (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    rope_scaling: dict[str, Any] | None = None  # llama3: factor, low/high_freq_factor, original_max
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral); a layer is sparse where its router is
    # in the checkpoint (mlp_only_layers / decoder_sparse_step leave it out there)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one shared expert, sigmoid-gated
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    # Gemma 3
    sliding_window: int = 0
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" | "full_attention"
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float = 0.0
    attn_logit_softcapping: float = 0.0

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gemma3"):
            raise UnsupportedModelError(
                f"unsupported architecture '{self.arch}': supported are {', '.join(SUPPORTED_ARCHS)}"
            )
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def is_gemma(self) -> bool:
        return self.arch == "gemma3"

    @property
    def attn_scale(self) -> float:
        if self.is_gemma and self.query_pre_attn_scalar:
            return self.query_pre_attn_scalar**-0.5
        return 1.0 / math.sqrt(self.head_dim)

    def layer_window(self, layer: int) -> int:
        """Sliding window of a layer (0 = full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0

    def layer_rope_theta(self, layer: int) -> float:
        if self.layer_types[layer] == "sliding_attention":
            return self.rope_local_theta
        return self.rope_theta


def _gemma_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def arch_from_gguf(meta: dict[str, Any], vocab_size: int) -> ArchConfig:
    arch = meta.get("general.architecture", "")
    family = {
        "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
        "qwen3moe": "llama", "qwen2moe": "llama", "gemma3": "gemma3",
    }.get(arch)  # fmt: skip
    if family is None:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture '{arch}': supported are {', '.join(SUPPORTED_ARCHS)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(
        get("attention.key_length", 0) or get("rope.dimension_count", 0) or hidden // heads
    )
    rope_scaling = None
    if get("rope.scaling.type") in ("llama3",) or meta.get(f"{arch}.rope.scaling.type") == "llama3":
        rope_scaling = {"rope_type": "llama3"}
    cfg = ArchConfig(
        arch=family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0) or get("expert_feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 1_000_000.0 if family == "gemma3" else 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        attention_bias=arch in ("qwen2", "qwen2moe"),
        qk_norm=arch in ("qwen3", "qwen3moe"),
        rope_scaling=rope_scaling,
    )
    if int(get("expert_count", 0) or 0):
        _moe_from_gguf(cfg, arch, get)
    if family == "gemma3":
        cfg.sliding_window = int(get("attention.sliding_window", 4096))
        cfg.layer_types = _gemma_layer_types(cfg.num_layers)
        cfg.query_pre_attn_scalar = float(head_dim)
        cfg.final_logit_softcapping = float(get("final_logit_softcapping", 0.0) or 0.0)
        cfg.attn_logit_softcapping = float(get("attn_logit_softcapping", 0.0) or 0.0)
    return cfg


def _moe_from_gguf(cfg: ArchConfig, arch: str, get: Any) -> None:
    cfg.num_experts = int(get("expert_count"))
    cfg.num_experts_per_tok = int(get("expert_used_count"))
    cfg.moe_intermediate_size = int(get("expert_feed_forward_length", 0) or cfg.intermediate_size)
    cfg.shared_expert_intermediate_size = int(get("expert_shared_feed_forward_length", 0) or 0)
    # NOTE: llama.cpp renormalises the top-k weights for llama (Mixtral) and qwen3moe, never for
    # qwen2moe (its build_moe_ffn calls); a GGUF file carries no flag of its own.
    cfg.norm_topk_prob = arch != "qwen2moe"


def _moe_from_hf(out: ArchConfig, cfg: dict[str, Any], model_type: str) -> None:
    out.num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    out.num_experts_per_tok = int(cfg.get("num_experts_per_tok") or 0)
    out.moe_intermediate_size = int(cfg.get("moe_intermediate_size") or out.intermediate_size)
    out.shared_expert_intermediate_size = int(cfg.get("shared_expert_intermediate_size") or 0)
    # NOTE: Mixtral always renormalises; Qwen's MoE configs say so in norm_topk_prob.
    out.norm_topk_prob = model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False))


def arch_from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
    model_type = cfg.get("model_type", "")
    if model_type == "gemma3" and "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    family = {
        "llama": "llama",
        "mistral": "llama",
        "qwen2": "llama",
        "qwen3": "llama",
        "qwen3_moe": "llama",
        "qwen2_moe": "llama",
        "mixtral": "llama",
        "gemma3_text": "gemma3",
    }.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported model_type '{model_type}' in config.json: supported are "
            "llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, gemma3_text"
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_params = cfg.get("rope_parameters") or {}
    rope_scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if family == "gemma3":
        full = rope_params.get("full_attention", {}) if rope_params else {}
        theta = theta or full.get("rope_theta") or 1_000_000.0
    else:
        if rope_params and "rope_type" in rope_params:
            theta = theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type") not in (None, "default"):
                rope_scaling = rope_params
        theta = theta or 10000.0
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
        "llama3",
        "default",
        None,
    ):
        raise UnsupportedModelError(f"unsupported rope_scaling {rope_scaling}")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "llama3":
        rope_scaling = None
    out = ArchConfig(
        arch=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
        attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
    )
    if model_type in ("qwen3_moe", "qwen2_moe", "mixtral"):
        _moe_from_hf(out, cfg, model_type)
    if family == "gemma3":
        out.sliding_window = int(cfg.get("sliding_window") or 4096)
        out.layer_types = list(cfg.get("layer_types") or []) or _gemma_layer_types(
            out.num_layers, int(cfg.get("sliding_window_pattern", 6))
        )
        local = rope_params.get("sliding_attention", {}) if rope_params else {}
        out.rope_local_theta = float(
            cfg.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0
        )
        out.query_pre_attn_scalar = float(cfg.get("query_pre_attn_scalar") or out.head_dim)
        out.final_logit_softcapping = float(cfg.get("final_logit_softcapping") or 0.0)
        out.attn_logit_softcapping = float(cfg.get("attn_logit_softcapping") or 0.0)
    return out
