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

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
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
    last_ids: torch.Tensor | None = None  # [T, k] the experts of the latest call's rows

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
        self.last_ids = ids
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


# ---- speculation priced by the experts a step touches --------------------------------------------
SPREAD_WINDOW = 16  # a request's latest accepted rows, over which its expert spread is measured
SPREAD_ALPHA = 0.3  # weight of the newest measurement, per request
SPREAD_PRIOR_ALPHA = 0.05  # weight of a request's measurement in what new requests start from


def moe_blocks(model) -> list[MoeBlock]:
    """The model's mixture-of-experts blocks, in layer order (none for a dense model)."""
    layers = getattr(model, "layers", [])
    return [lw.moe for lw in layers if getattr(lw, "moe", None) is not None]


def latest_routes(blocks: list[MoeBlock]) -> np.ndarray | None:  # -> [T, L, k]
    """The experts each row of the blocks' latest call chose, per MoE layer.

    NOTE: numpy from here on: a step's bookkeeping is a few dozen ops on arrays of a few
    thousand entries, where torch's per-op overhead (~10 us) would dominate."""
    ids = [b.last_ids for b in blocks]
    if not ids or any(i is None for i in ids) or len({i.shape[0] for i in ids}) != 1:
        return None
    return np.stack([i.cpu().numpy() for i in ids], axis=1)


def expert_mask(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, L, k] expert ids -> [L, E] bool: the experts any of the rows touched, per layer."""
    mask = np.zeros((routes.shape[1], num_experts), dtype=bool)
    mask[np.arange(routes.shape[1])[None, :, None], routes] = True
    return mask


def distinct_experts(routes: np.ndarray, num_experts: int) -> float:
    """Mean over the MoE layers of the distinct experts the rows of ``routes`` touched."""
    return float(expert_mask(routes, num_experts).sum(axis=1).mean())


@dataclass
class _Routes:
    # per (MoE layer, expert): how many of the request's latest accepted rows came since it was
    # last chosen (SPREAD_WINDOW: not within the window); the last n rows touched ages < n
    ages: np.ndarray  # [L, E]
    spread: np.ndarray  # [n - 1]: distinct experts per layer of n consecutive rows (learnt)
    num_rows: int = 0  # accepted rows so far, up to SPREAD_WINDOW
    last_set: np.ndarray | None = None  # [L, E] the previous step's accepted rows' experts

    def measured(self) -> np.ndarray:  # [num_rows]
        """Distinct experts per layer of the last 1, 2, ... num_rows accepted rows."""
        counts = np.bincount(self.ages.ravel(), minlength=SPREAD_WINDOW + 1)
        return counts[: self.num_rows].cumsum() / self.ages.shape[0]


@dataclass
class ExpertSpread:
    """How many distinct experts per MoE layer a verify step of n rows of a request touches,
    predicted from the router choices of the request's accepted rows (its latest
    ``SPREAD_WINDOW``: the spread of its last n consecutive tokens, smoothed over steps).

    Also measures how well the previous step's accepted rows predict the next step's experts:
    ``hit_fraction`` (of the experts a decode step touched, the share the previous step's
    accepted rows had touched) and ``count_error`` (the predicted count's mean relative error).
    """

    num_experts: int
    top_k: int
    prior: np.ndarray | None = None  # [SPREAD_WINDOW] what a new request starts from
    requests: dict[str, _Routes] = field(default_factory=dict)
    num_hit: int = 0
    num_touched: int = 0
    abs_error: float = 0.0
    num_predicted: float = 0.0

    def __post_init__(self) -> None:
        # NOTE: before any measurement, independent uniform routing: the widest spread
        if self.prior is None:
            n = np.arange(1, SPREAD_WINDOW + 1)
            self.prior = self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** n)

    def predict(self, req_id: str, max_rows: int) -> list[float]:
        """Distinct experts per layer for 1 .. max_rows rows (extrapolated beyond the window)."""
        state = self.requests.get(req_id)
        spread = state.spread if state is not None else self.prior
        out = spread[:max_rows].tolist()
        step = float(spread[-1] - spread[-2])  # NOTE: the window's last growth per row, onwards
        while len(out) < max_rows:
            out.append(out[-1] + step)
        return [min(float(self.num_experts), d) for d in out]

    def observe(
        self, req_id: str, routes: np.ndarray, num_valid: int, decode: bool
    ) -> np.ndarray:  # -> [L, E]
        """A step ran the request's rows ``routes`` [n, L, k]; the first ``num_valid`` stay.
        Returns the experts the rows touched."""
        touched = expert_mask(routes, self.num_experts)
        state = self.requests.get(req_id)
        if decode and state is not None:
            self._score(state, touched, len(routes))
        if state is None:
            ages = np.full((routes.shape[1], self.num_experts), SPREAD_WINDOW, dtype=np.int64)
            state = self.requests[req_id] = _Routes(ages, self.prior.copy())
        kept = routes[:num_valid][-SPREAD_WINDOW:]
        m = len(kept)
        state.ages += m
        np.minimum(state.ages, SPREAD_WINDOW, out=state.ages)
        layers = np.arange(routes.shape[1])[:, None]
        for i in range(m):  # oldest first: a newer row's age overwrites
            state.ages[layers, kept[i]] = m - 1 - i
        state.last_set = state.ages < m if m else None
        state.num_rows = min(SPREAD_WINDOW, state.num_rows + m)
        measured, n = state.measured(), state.num_rows
        state.spread[:n] += SPREAD_ALPHA * (measured - state.spread[:n])
        self.prior[:n] += SPREAD_PRIOR_ALPHA * (measured - self.prior[:n])
        return touched

    def _score(self, state: _Routes, touched: np.ndarray, n: int) -> None:
        if state.last_set is not None:
            self.num_hit += int(np.count_nonzero(touched & state.last_set))
            self.num_touched += int(np.count_nonzero(touched))
        spread = state.spread
        predicted = spread[min(n, len(spread)) - 1]
        predicted = min(
            self.num_experts, predicted + (spread[-1] - spread[-2]) * max(0, n - len(spread))
        )
        self.abs_error += abs(predicted - np.count_nonzero(touched) / touched.shape[0])
        self.num_predicted += predicted

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    @property
    def hit_fraction(self) -> float:
        return self.num_hit / max(1, self.num_touched)

    @property
    def count_error(self) -> float:
        return self.abs_error / max(1e-9, self.num_predicted)


def measure_expert_cost(
    blocks: list[MoeBlock], num_rows: int, hidden_size: int, dtype: torch.dtype, repeats: int = 3
) -> float:
    """Milliseconds one more distinct expert per MoE layer adds to a step (all layers together):
    the blocks' grouped experts timed over ``num_rows`` rows routed to top_k experts (all rows
    alike) and to as many as they can reach, interleaved, the fastest of the repeats."""
    if not blocks:
        return 0.0
    e, k = len(blocks[0].experts), blocks[0].top_k
    narrow = torch.arange(k).repeat(num_rows, 1)  # [n, k]
    wide = (torch.arange(num_rows)[:, None] * k + torch.arange(k)[None, :]) % e  # [n, k]
    d_narrow, d_wide = k, min(e, num_rows * k)
    if d_wide <= d_narrow:
        return 0.0
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(num_rows, hidden_size, generator=gen).to(dtype)
    fastest = {d_narrow: float("inf"), d_wide: float("inf")}
    with torch.inference_mode():
        for _ in range(repeats):
            for d, ids in ((d_narrow, narrow), (d_wide, wide)):
                start = time.perf_counter()
                for b in blocks:
                    b._grouped(h, ids)
                fastest[d] = min(fastest[d], 1000.0 * (time.perf_counter() - start))
    return max(0.0, fastest[d_wide] - fastest[d_narrow]) / (d_wide - d_narrow)
