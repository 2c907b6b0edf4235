"""Load checkpoints (GGUF or Hugging Face folders) into raw tensors with canonical names.

Canonical names: ``embed_tokens``, ``norm``, ``lm_head``, ``rope_freqs`` and per layer
``layers.{i}.{input_layernorm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm,
post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm,
gate_proj, up_proj, down_proj}`` plus ``.bias`` variants for q/k/v.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from specdec.model.arch import (
    ArchConfig,
    UnsupportedModelError,
    arch_from_gguf,
    arch_from_hf_config,
)
from specdec.model.gguf_file import gguf_metadata, read_gguf

QT = gguf.GGMLQuantizationType
# GGUF tensor types this runtime reads, and the name it uses for each.
GGUF_TYPES: dict[QT, str] = {
    QT.F32: "f32",
    QT.F16: "f16",
    QT.BF16: "bf16",
    QT.Q4_0: "q4_0",
    QT.Q4_1: "q4_1",
    QT.Q5_0: "q5_0",
    QT.Q5_1: "q5_1",
    QT.Q8_0: "q8_0",
    QT.Q4_K: "q4_k",
    QT.Q5_K: "q5_k",
    QT.Q6_K: "q6_k",
}
QTYPE_TO_GGML = {v: k for k, v in GGUF_TYPES.items()}

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
}


@dataclass
class RawTensor:
    """A tensor as stored: float data, or rows of quantized GGUF blocks.

    ``shape`` is the logical (torch-order) shape, e.g. ``[out_features, in_features]``.
    For quantized types ``data`` is uint8 ``[rows, row_bytes]``.
    """

    qtype: str
    data: np.ndarray
    shape: tuple[int, ...]

    @property
    def is_quantized(self) -> bool:
        return self.qtype not in ("f32", "f16", "bf16")

    def to_float(self) -> torch.Tensor:
        """Dequantize to a float32 torch tensor of ``shape``."""
        if self.qtype == "f32":
            arr = np.asarray(self.data, dtype=np.float32)
        elif self.qtype == "f16":
            arr = np.asarray(self.data, dtype=np.float16).astype(np.float32)
        elif self.qtype == "bf16" and self.data.dtype != np.uint8:
            arr = np.asarray(self.data, dtype=np.float32)
        else:
            arr = gguf.quants.dequantize(self.data, QTYPE_TO_GGML[self.qtype])
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(self.shape)
        if not arr.flags.writeable:
            arr = arr.copy()  # NOTE: GGUF data is a read-only memory map
        return torch.from_numpy(arr)


@dataclass
class LoadedCheckpoint:
    arch: ArchConfig
    tensors: dict[str, RawTensor]
    path: Path
    gguf_metadata: dict[str, Any] | None  # None for Hugging Face folders


def _undo_rope_permute(t: RawTensor, num_heads: int) -> RawTensor:
    """Undo the row permutation GGUF converters apply to Llama q/k projections.

    The converter reorders each head's rows from [2, head_dim/2] to [head_dim/2, 2] (interleaved
    rotary); we go back to Hugging Face's half-split layout. Rows move whole, so this works on
    quantized rows too, with no dequantization.
    """
    rows = t.shape[0]
    data = t.data.reshape(rows, -1)
    half = rows // num_heads // 2
    data = data.reshape(num_heads, half, 2, -1).swapaxes(1, 2).reshape(rows, -1)
    return RawTensor(t.qtype, np.ascontiguousarray(data), t.shape)


def _canonical_gguf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _GGUF_LAYER_NAMES.get(part)
        return (
            None
            if mapped is None
            else f"layers.{layer}.{mapped}" + (".bias" if suffix == "bias" else "")
        )
    mapped = _GGUF_TOP_NAMES.get(base)
    return None if mapped is None else mapped + (".bias" if suffix == "bias" else "")


def load_gguf(path: Path) -> LoadedCheckpoint:
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    tensors: dict[str, RawTensor] = {}
    for t in reader.tensors:
        qtype = GGUF_TYPES.get(t.tensor_type)
        if qtype is None:
            raise UnsupportedModelError(
                f"tensor {t.name} has GGUF type {t.tensor_type.name}; supported: "
                + ", ".join(q.name for q in GGUF_TYPES)
            )
        name = _canonical_gguf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[name] = RawTensor(qtype, t.data, shape)
    vocab = (
        int(meta.get(f"{meta.get('general.architecture')}.vocab_size", 0))
        or tensors["embed_tokens"].shape[0]
    )
    arch = arch_from_gguf(meta, vocab)
    arch.tie_word_embeddings = "lm_head" not in tensors
    if arch.arch == "llama" and meta.get("general.architecture") in ("llama", "mistral"):
        for i in range(arch.num_layers):
            for proj, heads in (("q_proj", arch.num_heads), ("k_proj", arch.num_kv_heads)):
                key = f"layers.{i}.{proj}"
                tensors[key] = _undo_rope_permute(tensors[key], heads)
    return LoadedCheckpoint(arch, tensors, path, meta)


_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def _canonical_hf_name(name: str) -> str | None:
    if name == "lm_head.weight":
        return "lm_head"
    for prefix in _HF_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    else:
        return None
    if name.endswith(".weight"):
        name = name[: -len(".weight")]
    name = name.replace(".self_attn.", ".").replace(".mlp.", ".")
    return name


def load_hf_folder(path: Path) -> LoadedCheckpoint:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    arch = arch_from_hf_config(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"no *.safetensors files in {path}")
    tensors: dict[str, RawTensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = _canonical_hf_name(key)
                if name is None:
                    continue
                t = f.get_tensor(key).to(torch.float32)
                if not arch.is_gemma and name.endswith("post_attention_layernorm"):
                    # NOTE: Llama's "post attention" norm is the MLP's input norm (GGUF: ffn_norm).
                    name = name.replace("post_attention_layernorm", "pre_feedforward_layernorm")
                if arch.is_gemma and name.endswith("norm"):
                    t = t + 1.0  # NOTE: Gemma scales by (1 + w); store it like GGUF does.
                tensors[name] = RawTensor("f32", t.numpy(), tuple(t.shape))
    if "lm_head" in tensors and arch.tie_word_embeddings:
        arch.tie_word_embeddings = False
    return LoadedCheckpoint(arch, tensors, path, None)


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    path = Path(path)
    if path.is_dir():
        return load_hf_folder(path)
    return load_gguf(path)
