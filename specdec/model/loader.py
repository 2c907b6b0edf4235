"""Load checkpoints (GGUF or Hugging Face folders) into raw tensors with canonical names.

Canonical names: ``embed_tokens``, ``norm``, ``lm_head``, ``rope_freqs`` and per layer
``layers.{i}.{input_layernorm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm,
post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm,
gate_proj, up_proj, down_proj}`` plus ``.bias`` variants for q/k/v; mixture-of-experts layers
have ``router``, ``experts.{e}.{gate_proj, up_proj, down_proj}`` and (Qwen2-MoE)
``shared_expert.{gate_proj, up_proj, down_proj}``, ``shared_expert_gate``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import struct
from collections.abc import Iterator
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
    "ffn_gate_inp": "router",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}
# stacked experts [num_experts, out, in], split into one tensor per expert
_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
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
    For quantized types ``data`` is uint8 ``[rows, row_bytes]``; ``f16`` is float16, ``bf16``
    uint16 bit patterns (Hugging Face) or uint8 bytes (GGUF).  Data read from a file is usually a
    read-only memory map of it (see :meth:`release_pages`).
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
        elif self.qtype == "bf16" and self.data.dtype == np.uint16:
            arr = (self.data.astype(np.uint32) << 16).view(np.float32)
        elif self.qtype == "bf16" and self.data.dtype != np.uint8:
            arr = np.asarray(self.data, dtype=np.float32)
        else:
            arr = gguf.quants.dequantize(self.data, QTYPE_TO_GGML[self.qtype])
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(self.shape)
        if not arr.flags.writeable:
            arr = arr.copy()  # NOTE: GGUF data is a read-only memory map
        return torch.from_numpy(arr)

    def populate_pages(self) -> None:
        """Map this tensor's pages of a read-only file mapping in one call before a copy reads
        them (one fault per 4 KiB page otherwise: 16 s for 3.4 GB on a loaded 2-core VM)."""
        self._advise(_MADV_POPULATE_READ)

    def release_pages(self) -> None:
        """Drop this tensor's pages of a read-only file mapping from the process (once it has been
        copied into kernel storage), so loading never holds a weight twice.  The data stays
        readable: the pages come back from the file on access.  No-op for data in memory."""
        self._advise(_MADV_DONTNEED)

    def _advise(self, advice: int) -> None:
        a = self.data
        if isinstance(a, np.memmap) and getattr(a, "_mmap", None) is not None and a.mode == "r":
            advise_pages(a, advice)


def advise_pages(a: np.ndarray, advice: int) -> None:
    """madvise the whole pages inside ``a``'s bytes (a file mapping's view); advice the kernel
    lacks (or no libc madvise) is a no-op."""
    page = mmap.PAGESIZE
    start = -(-a.ctypes.data // page) * page  # whole pages inside the array only
    end = (a.ctypes.data + a.nbytes) // page * page
    if end > start and _LIBC is not None:  # NOTE: advice the kernel lacks fails harmlessly
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


@contextlib.contextmanager
def mapped_pages(raws: list[RawTensor]) -> Iterator[None]:
    """Each tensor's file pages mapped in one call (populate_pages) around a copy that reads
    them, and dropped after it (release_pages)."""
    for r in raws:
        r.populate_pages()
    try:
        yield
    finally:
        for r in raws:
            r.release_pages()


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # no libc madvise (not Linux / macOS)
    _LIBC = None
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_MADV_POPULATE_READ = 22  # Linux 5.14+


def release_freed_heap() -> None:
    """Give the heap memory that loading freed back to the system (glibc's ``malloc_trim``; a
    no-op elsewhere).

    NOTE: a load's temporaries (dequantized rows, repacking buffers) are freed inside the heap,
    which glibc keeps: Gemma 3 270M Q4_K_M held ~230 MB more than its weights after loading
    (RSS 860 -> 631 MB with the trim, weight cache off, 2-core Xeon with AMX)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


@dataclass
class LoadedCheckpoint:
    arch: ArchConfig
    tensors: dict[str, RawTensor]
    path: Path
    gguf_metadata: dict[str, Any] | None  # None for Hugging Face folders


class _RopePermuted(RawTensor):
    """A Llama q/k projection of a GGUF file, its rows back in Hugging Face's order.

    The converter reorders each head's rows from [2, head_dim/2] to [head_dim/2, 2] (interleaved
    rotary); ``data`` undoes that on every read, from the file's mapping, so loading never holds
    a permuted copy of every q and k beside the packed weights.  Rows move whole, so this works on
    quantized rows too, with no dequantization.
    """

    def __init__(self, source: RawTensor, num_heads: int) -> None:  # not the dataclass __init__
        self.qtype, self.shape = source.qtype, source.shape
        self._source, self._num_heads = source, num_heads

    @property
    def data(self) -> np.ndarray:  # type: ignore[override]
        rows = self.shape[0]
        src = self._source.data.reshape(rows, -1)
        half = rows // self._num_heads // 2
        out = src.reshape(self._num_heads, half, 2, -1).swapaxes(1, 2).reshape(rows, -1)
        return np.ascontiguousarray(out)

    def populate_pages(self) -> None:
        self._source.populate_pages()

    def release_pages(self) -> None:
        self._source.release_pages()


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


def _split_experts(name: str, raw: RawTensor) -> dict[str, RawTensor]:
    """One stacked expert tensor ``blk.{i}.ffn_*_exps`` [E, out, in] as E tensors [out, in],
    each a view of the file's mapping (no copy)."""
    _, layer, part, _ = name.split(".")
    if part not in _GGUF_EXPERT_NAMES:
        raise UnsupportedModelError(f"tensor {name}: unexpected 3-dimensional tensor")
    num_experts, rows, cols = raw.shape
    data = raw.data.reshape(num_experts, rows, -1)  # blocks or bytes per row, as stored
    return {
        f"layers.{layer}.experts.{e}.{_GGUF_EXPERT_NAMES[part]}": RawTensor(
            raw.qtype, data[e], (rows, cols)
        )
        for e in range(num_experts)
    }


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
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if len(shape) == 3:
            tensors.update(_split_experts(t.name, RawTensor(qtype, t.data, shape)))
            continue
        name = _canonical_gguf_name(t.name)
        if name is None:
            continue
        if name.endswith("shared_expert_gate") and len(shape) == 1:
            shape = (1, shape[0])  # NOTE: llama.cpp stores the one-output gate as a vector
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
                tensors[key] = _RopePermuted(tensors[key], heads)
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
    name = name.replace(".block_sparse_moe.", ".")  # Mixtral
    base, _, last = name.rpartition(".")
    if ".experts." in name and last in _MIXTRAL_EXPERT_NAMES:
        name = f"{base}.{_MIXTRAL_EXPERT_NAMES[last]}"
    elif last == "gate" and base.startswith("layers."):
        name = f"{base}.router"
    return name


_MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


# safetensors dtypes read straight from a memory map of the file: (qtype, numpy dtype).
_SAFETENSORS_DTYPES = {
    "F32": ("f32", np.float32),
    "F16": ("f16", np.float16),
    "BF16": ("bf16", np.uint16),
}


def _safetensors_arrays(file: Path) -> dict[str, tuple[str, np.ndarray]]:
    """(qtype, array) of each float32 / float16 / bfloat16 tensor of a safetensors file, as
    read-only views of one memory map (bfloat16 as uint16 bit patterns); other dtypes are left
    out (read through ``safetensors`` instead)."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(file, dtype=np.uint8, mode="r")
    base = 8 + header_len
    out: dict[str, tuple[str, np.ndarray]] = {}
    for key, info in header.items():
        if key == "__metadata__" or info["dtype"] not in _SAFETENSORS_DTYPES:
            continue
        qtype, dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        lo, hi = info["data_offsets"]
        out[key] = (qtype, data[base + lo : base + hi].view(dtype).reshape(info["shape"]))
    return out


def load_hf_folder(path: Path) -> LoadedCheckpoint:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    arch = arch_from_hf_config(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"no *.safetensors files in {path}")
    tensors: dict[str, RawTensor] = {}
    for file in files:
        mapped = _safetensors_arrays(file)
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = _canonical_hf_name(key)
                if name is None:
                    continue
                if not arch.is_gemma and name.endswith("post_attention_layernorm"):
                    # NOTE: Llama's "post attention" norm is the MLP's input norm (GGUF: ffn_norm).
                    name = name.replace("post_attention_layernorm", "pre_feedforward_layernorm")
                if key in mapped and len(mapped[key][1].shape) == 2:
                    # NOTE: matrices stay as stored (16-bit stays 16-bit), mapped from the file.
                    qtype, arr = mapped[key]
                    tensors[name] = RawTensor(qtype, arr, tuple(arr.shape))
                    continue
                t = f.get_tensor(key).to(torch.float32)
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
