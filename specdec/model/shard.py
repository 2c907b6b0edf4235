"""One tensor-parallel rank's slices of a checkpoint, by the plan of
``specdec.distributed.shard``.

Quantized rows split on block boundaries; a split that would cut a block (K-quants' 256-wide
super-blocks on narrow shards) dequantizes that weight's shard to float32 instead (exact values,
float kernels).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np

from specdec.distributed.shard import plan_shard, vocab_range
from specdec.model.loader import QTYPE_TO_GGML, LoadedCheckpoint, RawTensor


def _rows(raw: RawTensor, rows: np.ndarray) -> RawTensor:
    data = raw.data
    data = data.reshape(raw.shape[0], -1) if len(raw.shape) == 2 else data.reshape(raw.shape[0])
    out = np.ascontiguousarray(data[rows])
    return RawTensor(raw.qtype, out, (len(rows), *raw.shape[1:]))


def _cols(raw: RawTensor, lo: int, hi: int) -> RawTensor:
    """Input columns [lo, hi) of a 2-D weight, on block boundaries (or dequantized)."""
    rows, cols = raw.shape
    data = raw.data.reshape(rows, -1)
    if data.dtype != np.uint8:  # float storage: one element per column
        return RawTensor(raw.qtype, np.ascontiguousarray(data[:, lo:hi]), (rows, hi - lo))
    block, type_size = gguf.GGML_QUANT_SIZES[QTYPE_TO_GGML[raw.qtype]]
    if lo % block or hi % block:
        full = raw.to_float()[:, lo:hi].contiguous().numpy()
        return RawTensor("f32", full, (rows, hi - lo))
    part = data[:, lo // block * type_size : hi // block * type_size]
    return RawTensor(raw.qtype, np.ascontiguousarray(part), (rows, hi - lo))


def _head_rows(heads: list[int], head_dim: int) -> np.ndarray:
    return np.concatenate([np.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def shard_checkpoint(ckpt: LoadedCheckpoint, rank: int, size: int) -> LoadedCheckpoint:
    """The rank's tensors (row and column slices of the checkpoint's), arch unchanged."""
    arch, plan = ckpt.arch, plan_shard(ckpt.arch, rank, size)
    d = arch.head_dim
    q_rows = _head_rows(list(range(plan.q_lo, plan.q_hi)), d)
    kv_rows = _head_rows(list(plan.kv_heads), d)
    f_rows = np.arange(plan.f_lo, plan.f_hi)
    rows_of = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
               "gate_proj": f_rows, "up_proj": f_rows}  # fmt: skip
    cols_of = {"o_proj": (plan.q_lo * d, plan.q_hi * d), "down_proj": (plan.f_lo, plan.f_hi)}
    tensors: dict[str, RawTensor] = {}
    for name, raw in ckpt.tensors.items():
        leaf = name.split(".")[2] if name.startswith("layers.") else ""
        if leaf in rows_of:
            tensors[name] = _rows(raw, rows_of[leaf])
        elif leaf in cols_of and name.endswith(".bias"):
            if rank == 0:  # NOTE: added once, by rank 0's partial sum, not once per rank
                tensors[name] = raw
        elif leaf in cols_of:
            tensors[name] = _cols(raw, *cols_of[leaf])
        else:
            tensors[name] = raw
    # NOTE: the output layer splits by vocabulary (each rank's logits gathered on rank 0); the
    # embedding stays whole, also where it is tied to the output layer
    head = ckpt.tensors.get("lm_head", ckpt.tensors["embed_tokens"])
    lo, hi = vocab_range(head.shape[0], rank, size)
    tensors["lm_head"] = _rows(head, np.arange(lo, hi))
    return dataclasses.replace(ckpt, tensors=tensors)
