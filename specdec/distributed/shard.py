"""Tensor-parallel sharding: which heads, intermediate columns and vocabulary rows each rank
holds (the checkpoint's slices themselves are cut by ``specdec.model.shard``).

q/k/v (and their biases) and gate/up split by output rows (heads, intermediate columns);
o_proj and down_proj split by input columns, so each rank's partial sums add up to the whole
(one all-reduce each per layer). Norms and embeddings stay replicated; the output layer splits
by vocabulary rows, each rank's logits gathered through the all-reduce (see
``TPGroup.gather_logits``).

Heads split by whole GQA groups while there are at least as many KV heads as ranks, unevenly
where they do not divide: SmolLM2-135M has 9 query heads over 3 KV heads, so TP 2 gives ranks 3
and 6 query heads (1 and 2 KV heads). With fewer KV heads than ranks the query heads split as
evenly as the ranks allow and a rank keeps the KV heads its query heads read; when its query
heads do not cover whole groups, each of its query heads gets its own copy of its KV head (same
result, more KV memory and k/v rows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, TypeVar

from specdec.errors import ConfigError


class ShardShape(Protocol):
    """The counts a split reads (``specdec.model.arch.ArchConfig`` has them)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    num_experts: int


Shape = TypeVar("Shape", bound=ShardShape)


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


def plan_shard(arch: ShardShape, rank: int, size: int) -> ShardPlan:
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


def shard_arch(arch: Shape, plan: ShardPlan) -> Shape:
    """The shapes one rank computes with (its heads, its intermediate columns): a copy of the
    dataclass ``arch`` with the rank's counts."""
    return dataclasses.replace(
        arch,
        num_heads=plan.q_hi - plan.q_lo,
        num_kv_heads=len(plan.kv_heads),
        intermediate_size=plan.f_hi - plan.f_lo,
    )
