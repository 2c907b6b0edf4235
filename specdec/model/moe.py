"""Mixture-of-experts feed-forward layers (Qwen3-MoE, Qwen2-MoE, Mixtral): a softmax router
over N experts, the top k per token, and an expert-grouped step.

A step's rows are grouped by expert, so each chosen expert's weights are read once per step for
all the rows routed to it (a verify step of N tokens touches at most N x k experts, each once).
Every row is batch-invariant: the linear kernels give a row the same bits whatever the row
count, SiLU runs on the same lanes for every row (``_silu_mul``), and a row's expert outputs are
summed in the order of its top-k ranks, never in the order the experts ran.  Speculation on a
mixture of experts therefore stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.model.layers import Linear

# NOTE: torch runs an elementwise op serially below 32,768 elements (at::internal::GRAIN_SIZE);
# above it, thread chunks start mid-row and a chunk's tail lanes take the scalar exp, whose last
# bit can differ from the vector one.  Blocks of rows under that size keep every row's lanes
# fixed.
_SERIAL_ELEMENTS = 32768


@dataclass
class Expert:
    """One SwiGLU expert: down(silu(gate(x)) * up(x))."""

    gate_up: Linear  # [2 * I, H] (gate rows, then up rows)
    down: Linear  # [H, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, H]
        gate_up = self.gate_up(x)
        inter = gate_up.shape[-1] // 2
        return self.down(_silu_mul(gate_up[:, :inter], gate_up[:, inter:]))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [M, I] x2 -> [M, I]
    """silu(gate) * up, row-blocked so that a row's bits never depend on the row count."""
    rows = max(1, _SERIAL_ELEMENTS // max(1, gate.shape[-1]))
    if gate.shape[0] <= rows:
        return F.silu(gate) * up
    return torch.cat(
        [F.silu(gate[i : i + rows]) * up[i : i + rows] for i in range(0, gate.shape[0], rows)]
    )


def _sigmoid_rows(x: torch.Tensor) -> torch.Tensor:  # [M, 1] -> [M, 1]
    """sigmoid of one value per row, each on a full vector of its own (a [M, 1] column would put
    a row on vector or scalar lanes by its index)."""
    wide = x.expand(-1, _LANES).contiguous()
    rows = _SERIAL_ELEMENTS // _LANES
    return torch.cat([torch.sigmoid(wide[i : i + rows]) for i in range(0, x.shape[0], rows)])[:, :1]


_LANES = 64  # a multiple of two vectors of float32 for AVX2 and AVX-512


@dataclass
class MoeBlock:
    """The sparse feed-forward of one layer; ``grouped=False`` runs each row's experts one by
    one (the baseline the grouped step is measured against; same bits)."""

    router: Linear  # [E, H]
    experts: list[Expert]
    top_k: int
    norm_topk_prob: bool
    shared: Expert | None = None  # Qwen2-MoE
    shared_gate: Linear | None = None  # [1, H]
    grouped: bool = True

    def linears(self) -> list[Linear]:
        out = [lin for e in self.experts for lin in (e.gate_up, e.down)] + [self.router]
        if self.shared is not None and self.shared_gate is not None:
            out += [self.shared.gate_up, self.shared.down, self.shared_gate]
        return out

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [T, k] (h's dtype) and expert ids [T, k]: softmax in float32 over all
        experts, then top-k, renormalised to sum to 1 when ``norm_topk_prob``."""
        probs = torch.softmax(self.router(h).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.route(h)
        # NOTE: one row (decode) has nothing to group: its experts one by one, same bits
        grouped = self.grouped and h.shape[0] > 1
        per_rank = self._grouped(h, ids) if grouped else self._one_by_one(h, ids)
        out = per_rank[:, 0] * weights[:, :1]
        for rank in range(1, self.top_k):  # NOTE: a fixed order: the row's top-k rank
            out = out + per_rank[:, rank] * weights[:, rank : rank + 1]
        if self.shared is not None and self.shared_gate is not None:
            out = out + _sigmoid_rows(self.shared_gate(h)) * self.shared(h)
        return out

    def _grouped(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # -> [T, k, H]
        per_rank = h.new_empty(h.shape[0] * self.top_k, h.shape[1])
        order = torch.argsort(ids.flatten(), stable=True)  # (row, rank) slots, by expert
        chosen, counts = torch.unique_consecutive(ids.flatten()[order], return_counts=True)
        start = 0
        for e, n in zip(chosen.tolist(), counts.tolist()):  # each chosen expert once
            slots = order[start : start + n]
            per_rank[slots] = self.experts[e](h[slots // self.top_k])
            start += n
        return per_rank.view(h.shape[0], self.top_k, h.shape[1])

    def _one_by_one(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # -> [T, k, H]
        per_rank = h.new_empty(h.shape[0], self.top_k, h.shape[1])
        for row, chosen in enumerate(ids.tolist()):
            for rank, e in enumerate(chosen):
                per_rank[row, rank] = self.experts[e](h[row : row + 1])[0]
        return per_rank


def load_moe(
    names: set[str],
    prefix: str,
    num_experts: int,
    top_k: int,
    norm_topk_prob: bool,
    linear: Callable[[list[str]], Linear],
) -> MoeBlock:
    """The MoE block of layer ``prefix`` (``layers.{i}.``); ``linear(names)`` packs the named
    tensors of that layer fused along the output dimension, in their stored format."""

    def expert(name: str) -> Expert:
        return Expert(
            linear([f"{name}.gate_proj", f"{name}.up_proj"]), linear([f"{name}.down_proj"])
        )

    block = MoeBlock(
        router=linear(["router"]),
        experts=[expert(f"experts.{e}") for e in range(num_experts)],
        top_k=top_k,
        norm_topk_prob=norm_topk_prob,
    )
    if prefix + "shared_expert.gate_proj" in names:
        block.shared = expert("shared_expert")
        block.shared_gate = linear(["shared_expert_gate"])
    return block
