"""Tensor-parallel sharding of a checkpoint: which heads, columns and rows each rank holds.

q/k/v (and their biases) and gate/up split by output rows (heads, intermediate columns);
o_proj and down_proj split by input columns, so each rank's partial sums add up to the whole
(one all-reduce each per layer). Norms and embeddings stay replicated; the output layer splits
by vocabulary rows, each rank's logits gathered through the all-reduce (see
``LlamaModel.compute_logits``).

Heads split by whole GQA groups while there are at least as many KV heads as ranks, unevenly
where they do not divide: SmolLM2-135M has 9 query heads over 3 KV heads, so TP 2 gives ranks 3
and 6 query heads (1 and 2 KV heads). With fewer KV heads than ranks the query heads split as
evenly as the ranks allow and a rank keeps the KV heads its query heads read; when its query
heads do not cover whole groups, each of its query heads gets its own copy of its KV head (same
result, more KV memory and k/v rows). Quantized rows split on block
boundaries; a split that would cut a block (K-quants' 256-wide super-blocks on narrow shards)
dequantizes that weight's shard to float32 instead (exact values, float kernels).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import gguf
import numpy as np

from specdec.config import ConfigError
from specdec.model.arch import ArchConfig
from specdec.model.loader import QTYPE_TO_GGML, LoadedCheckpoint, RawTensor


@dataclass(frozen=True)
class ShardPlan:
    """One rank's share: query heads [q_lo, q_hi), the KV heads it keeps (indices into the
    checkpoint's, one per local KV head) and intermediate columns [f_lo, f_hi)."""

    q_lo: int
    q_hi: int
    kv_heads: tuple[int, ...]
    f_lo: int
    f_hi: int


def _even(n: int, rank: int, size: int, unit: int = 1) -> tuple[int, int]:
    """[lo, hi) of ``n`` items split into ``size`` near-equal runs of whole ``unit``s."""
    units = n // unit
    lo, hi = rank * units // size, (rank + 1) * units // size
    return lo * unit, (hi * unit if rank < size - 1 else n)


def plan_shard(arch: ArchConfig, rank: int, size: int) -> ShardPlan:
    """The rank's heads and intermediate columns; ``size`` above the head count is a
    ``ConfigError`` naming tensor_parallel_size."""
    if size > arch.num_heads:
        raise ConfigError(
            f"tensor_parallel_size {size} exceeds the model's {arch.num_heads} attention heads"
        )
    if arch.num_experts and size > 1:
        raise ConfigError(
            "tensor_parallel_size: mixture-of-experts layers are not sharded yet; use 1"
        )
    group = arch.num_heads // arch.num_kv_heads
    f_lo, f_hi = _even(arch.intermediate_size, rank, size, 32)
    if arch.num_kv_heads >= size:
        # NOTE: whole GQA groups, unevenly where they do not divide (SmolLM2 at TP 2: 1 and 2 of
        # its 3 groups). Splitting the query heads evenly instead would copy partial groups' KV
        # heads, and their k/v rows: the busier rank then computed as many q/k/v rows as one
        # rank alone (measured: TP 2 0.74x of TP 1 on SmolLM2)
        kv_lo, kv_hi = _even(arch.num_kv_heads, rank, size)
        return ShardPlan(kv_lo * group, kv_hi * group, tuple(range(kv_lo, kv_hi)), f_lo, f_hi)
    q_lo, q_hi = _even(arch.num_heads, rank, size)
    first, last = q_lo // group, (q_hi - 1) // group
    if q_lo % group == 0 and q_hi % group == 0:
        kv = tuple(range(first, last + 1))
    elif first == last:
        kv = (first,)
    else:  # NOTE: a partial group at either end: one KV copy per query head keeps GQA uniform
        kv = tuple(q // group for q in range(q_lo, q_hi))
    return ShardPlan(q_lo, q_hi, kv, f_lo, f_hi)


def vocab_range(rows: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of the output layer's ``rows`` (vocabulary entries) that the rank computes."""
    return _even(rows, rank, size, 64)


def shard_arch(arch: ArchConfig, plan: ShardPlan) -> ArchConfig:
    """The shapes one rank computes with (its heads, its intermediate columns)."""
    return dataclasses.replace(
        arch,
        num_heads=plan.q_hi - plan.q_lo,
        num_kv_heads=len(plan.kv_heads),
        intermediate_size=plan.f_hi - plan.f_lo,
    )


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
