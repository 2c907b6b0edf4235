"""Fixed-shape forwards (the GPU path): each row's result is independent of the batch it runs in,
and a decode / verification step is one replayed CUDA graph.

GPU matrix and attention kernels pick their algorithm (tiles, split-K) by shape, so a row computed
alone and inside a batch of 8 can differ in its last bits, and greedy speculation would then drift
from plain decoding. Here every forward has one of two shapes:

- **a step** (plain decoding and verification alike): every KV slot is one batch row of exactly
  ``rows`` tokens, ``[num_slots * rows]`` in all. A slot outside the step, and the rows past a
  request's own tokens, are padding: they write their K/V to a scratch region past
  ``max_model_len`` and attend to position 0 only, so nothing they compute reaches a real row.
- **a prefill piece**: one request's prompt tokens, in pieces of exactly ``prefill_rows``.

Attention spans a slot's whole capacity with a mask, or on CUDA a power-of-two number of its
positions (at least ``MIN_SPAN``): a masked key adds an exact zero, so the span changes no bit of
a row's result as long as the kernel keeps its tiles (tests/unit/worker/test_static_runner.py checks it
on the GPU; torch's CPU attention does not keep them). A given position is always computed by the
same shape: prompt positions by prefill pieces, generated positions by steps, whatever else runs
beside them. That is the GPU's batch invariance, the property the native CPU kernels have by
construction (DESIGN.md), bought with padding: on a GPU the padded step costs what it costs
(on an H200, 3.81 ms for SmolLM2-135M with 1 or 8 real rows; BENCHMARKS.md, GPU, 2026-11-27).

The cache layout is the torch path's ``[layers, slots, Hkv, positions, D]``; a slot's keys are one
``[Hkv, span, D]`` view, so attention needs no gather (gpt-fast's static KV cache, with vLLM's
rule of one captured graph per padded shape).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdec.config import ConfigError, EngineConfig
from specdec.kv_cache.pool import KVCache
from specdec.model.llama import HIDDEN_FINAL, LayerWeights, LlamaModel
from specdec.worker.model_runner import ModelRunner
from specdec.worker.step import ScheduledRequest

logger = logging.getLogger("specdec.worker")

DEFAULT_STEP_ROWS = 8  # tokens per request in a step: 1 + up to 7 drafts
DEFAULT_PREFILL_ROWS = 128
MIN_SPAN = 256


def scratch_positions(step_rows: int, prefill_rows: int = DEFAULT_PREFILL_ROWS) -> int:
    """Positions past ``max_model_len`` that each slot keeps for padding rows' K/V."""
    return max(step_rows, prefill_rows)


def static_step_rows(config: EngineConfig, model: LlamaModel) -> int | None:
    """The rows a request gets in a fixed-shape step, or None where ``config`` runs without
    fixed shapes (``static_shapes``: default on for device cuda; refused where the model cannot
    run them). A request drafts at most ``rows - 1`` tokens a step then (Speculator's cap)."""
    wanted = config.static_shapes
    if wanted is None:
        wanted = config.device == "cuda"
    if not wanted:
        return None
    why = static_shapes_supported(model)
    if why is not None:
        if config.static_shapes:
            raise ConfigError(f"static_shapes: not supported with {why}")
        logger.warning("fixed-shape forwards are off (%s): GPU results may depend on batching", why)
        return None
    return DEFAULT_STEP_ROWS


def static_shapes_supported(model: LlamaModel) -> str | None:
    """Why ``model`` cannot run fixed-shape forwards (None: it can)."""
    if model.cfg.num_experts:
        return "mixture-of-experts layers group rows by expert (shapes follow the routing)"
    if model.tp is not None:
        return "tensor parallelism"
    if model.ops.name != "torch":
        return f"the {model.ops.name} kernels (fixed shapes are the torch kernels' path)"
    return None


@dataclass
class _Step:
    """The static input buffers of one step shape and its outputs (a captured graph's)."""

    inputs: torch.Tensor  # [3, S * R] int64: ids, rotary positions (0 for padding), and
    # where each row's K/V go (scratch for padding)
    out: tuple[torch.Tensor, ...] | None = None  # final [S*R, H], logits [S*R, V], captured
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def ids(self) -> torch.Tensor:  # [S * R]
        return self.inputs[0]

    @property
    def pos(self) -> torch.Tensor:  # [S * R]
        return self.inputs[1]

    @property
    def kv_pos(self) -> torch.Tensor:  # [S * R]
        return self.inputs[2]


class StaticForward:
    """The model at fixed shapes over ``kv``: :meth:`step` for decode / verification rows,
    :meth:`prefill` for prompt pieces. ``capture``: the hidden states drafters read (as
    ``LlamaModel.forward_capture``)."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        capture: tuple[int, ...] = (),
        step_rows: int = DEFAULT_STEP_ROWS,
        prefill_rows: int = DEFAULT_PREFILL_ROWS,
        use_graphs: bool = True,
    ) -> None:
        why = static_shapes_supported(model)
        if why is not None:
            raise ValueError(f"fixed-shape forwards do not support {why}")
        self.model, self.kv, self.capture = model, kv, capture
        self.rows, self.prefill_rows = step_rows, prefill_rows
        self.max_pos = model.max_len  # real positions are below it; past it: scratch
        if kv.max_len < self.max_pos + scratch_positions(step_rows, prefill_rows):
            raise ValueError("the KV cache has no scratch positions past max_model_len")
        self.device = model.device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        # NOTE: spans on CUDA only: torch's CPU attention sums a row differently over 256 and
        # 1,024 keys (test_the_attention_span_changes_no_bit); SPECDEC_ATTENTION_SPANS=0 turns
        # them off on CUDA too
        self.spans = self.device.type == "cuda" and os.environ.get("SPECDEC_ATTENTION_SPANS") != "0"
        cfg = model.shard_cfg
        self.group = cfg.num_heads // cfg.num_kv_heads
        # NOTE: padding rows read position 0 of their slot: never NaN, even in a fresh cache
        kv.k.zero_()
        kv.v.zero_()
        self._embed = model._embed.float_weight(self.device).to(model.dtype)  # [V, H]
        # the slot of each step row: row r belongs to slot r // rows  # [S * R]
        self._step_slots = torch.arange(kv.num_slots).repeat_interleave(step_rows).to(self.device)
        self._steps: dict[int, _Step] = {}  # by span
        self._pool = None  # the graphs' shared memory pool

    # ---- a step ----------------------------------------------------------------------------
    def span_for(self, max_position: int) -> int:
        """The attention span (positions of a slot) for rows at positions <= ``max_position``:
        the slot's whole capacity where spans are off."""
        if not self.spans:
            return self.kv.max_len
        span = MIN_SPAN
        while span <= max_position:
            span *= 2
        return min(span, self.kv.max_len)

    def step(
        self,
        requests: list[tuple[int, int, list[int]]],  # (slot, start position, token ids)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One step: final states [S * R, H], logits [S * R, V] and captured states (None
        without capture); request (slot, start, ids) owns rows slot * R .. slot * R + len - 1."""
        S, R = self.kv.num_slots, self.rows
        host = np.zeros((3, S * R), dtype=np.int64)
        ids, pos, kv_pos = host
        kv_pos[:] = np.tile(self.max_pos + np.arange(R, dtype=np.int64), S)
        top = 0
        for slot, start, tokens in requests:
            n = len(tokens)
            if n > R or start + n > self.max_pos:
                raise ValueError(f"a step takes 1..{R} tokens below max_model_len, got {n}")
            row = slot * R
            ids[row : row + n] = tokens
            pos[row : row + n] = np.arange(start, start + n)
            kv_pos[row : row + n] = pos[row : row + n]
            top = max(top, start + n - 1)
        span = self.span_for(top)
        st = self._step_buffers(span)
        st.inputs.copy_(torch.from_numpy(host))  # one copy to the device a step
        if not self.use_graphs:
            return self._step_forward(st, span)
        if st.graph is None:
            self._capture(st, span)
        st.graph.replay()
        return st.out

    def _step_buffers(self, span: int) -> _Step:
        st = self._steps.get(span)
        if st is None:
            S, R = self.kv.num_slots, self.rows
            inputs = torch.zeros(3, S * R, dtype=torch.long)
            inputs[2] = (self.max_pos + torch.arange(R)).repeat(S)  # all padding: scratch only
            st = self._steps[span] = _Step(inputs.to(self.device))
        return st

    def all_spans(self) -> list[int]:
        """Every span a step can take (one graph each)."""
        tops = [*range(0, self.max_pos, MIN_SPAN), self.max_pos - 1]
        return sorted({self.span_for(p) for p in tops})

    def capture_all(self) -> None:
        """Capture every span's graph now (steps then never capture while serving, where other
        threads may be using the device). Their padding inputs write scratch positions only."""
        if not self.use_graphs:
            return
        for span in self.all_spans():
            st = self._step_buffers(span)
            if st.graph is None:
                self._capture(st, span)

    def _capture(self, st: _Step, span: int) -> None:
        """Warm up on a side stream (lazy casts, kernel choices), then capture one step."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step_forward(st, span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        st.graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(st.graph, pool=self._pool):
            st.out = self._step_forward(st, span)
        logger.info(
            "captured a CUDA graph: %d slots x %d rows, span %d", self.kv.num_slots, self.rows, span
        )

    def _step_forward(self, st: _Step, span: int) -> tuple[torch.Tensor, ...]:
        S, R = self.kv.num_slots, self.rows
        masks = self._masks(st.pos.view(S, R), span)
        final, captured = self._layers(st.ids, st.pos, self._step_slots, st.kv_pos, masks, S, span)
        return final, self.model.compute_logits(final), captured

    # ---- prefill ---------------------------------------------------------------------------
    def prefill(
        self, slot: int, start: int, token_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [n, H], [n, H * len(capture)] or None
        """One request's prompt tokens at ``start ..`` in pieces of ``prefill_rows`` (eager)."""
        P, n = self.prefill_rows, len(token_ids)
        finals, captured = [], []
        for off in range(0, n, P):
            m = min(P, n - off)
            ids = np.zeros(P, dtype=np.int64)
            ids[:m] = token_ids[off : off + m]
            pos = np.zeros(P, dtype=np.int64)
            pos[:m] = np.arange(start + off, start + off + m)
            kv_pos = self.max_pos + np.arange(P, dtype=np.int64)
            kv_pos[:m] = pos[:m]
            ids_t, pos_t, kv_pos_t = (
                torch.from_numpy(a).to(self.device) for a in (ids, pos, kv_pos)
            )
            span = self.span_for(start + off + m - 1)
            rows_slot = torch.full((P,), slot, dtype=torch.long, device=self.device)
            masks = self._masks(pos_t.view(1, P), span)
            final, cap = self._layers(ids_t, pos_t, rows_slot, kv_pos_t, masks, 1, span, slot)
            finals.append(final[:m])
            if cap is not None:
                captured.append(cap[:m])
        return torch.cat(finals), (torch.cat(captured) if captured else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        """Logits of prefill rows, in blocks of ``rows`` (one shape for any count)."""
        R, n = self.rows, hidden.shape[0]
        padded = hidden.new_zeros(-(-n // R) * R, hidden.shape[1])
        padded[:n] = hidden
        return torch.cat([self.model.compute_logits(b) for b in padded.split(R)])[:n]

    # ---- the layers at a fixed shape -------------------------------------------------------
    def _masks(self, pos: torch.Tensor, span: int) -> dict[int, torch.Tensor]:
        """Per sliding window (0: none), ``[B, 1, group * rows, span]`` additive masks in the
        activations' dtype (0, or -inf where hidden): row r of batch b sees key j iff
        j <= pos[b, r] (and within the window); grouped query heads share it. NOTE: built once a
        step; a bool mask is converted so by attention in every layer."""
        B, rows = pos.shape
        j = torch.arange(span, device=self.device)
        out = {}
        for window in {self.model.shard_cfg.layer_window(i) for i in range(len(self.model.layers))}:
            allowed = j <= pos.unsqueeze(-1)  # [B, rows, span]
            if window > 0:
                allowed = allowed & (pos.unsqueeze(-1) - j < window)
            hidden = torch.zeros(allowed.shape, dtype=self.model.dtype, device=self.device)
            hidden.masked_fill_(~allowed, float("-inf"))
            grouped = hidden.unsqueeze(1).expand(B, self.group, rows, span)
            out[window] = grouped.reshape(B, 1, self.group * rows, span)
        return out

    def _layers(
        self,
        ids: torch.Tensor,  # [B * rows]
        pos: torch.Tensor,  # [B * rows]
        slots: torch.Tensor,  # [B * rows] the KV slot of each row
        kv_pos: torch.Tensor,  # [B * rows] where each row's K/V go
        masks: dict[int, torch.Tensor],
        batch: int,
        span: int,
        slot: int | None = None,  # a prefill piece's one slot (None: batch b is slot b)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        model, cfg = self.model, self.model.shard_cfg
        x = F.embedding(ids, self._embed)
        if cfg.is_gemma:
            x = x * torch.tensor(cfg.hidden_size**0.5, dtype=model.dtype)
        taken: dict[int, torch.Tensor] = {}

        def attend(i: int, layer: LayerWeights, h: torch.Tensor, *_: object) -> torch.Tensor:
            q, k, v = model.qkv(i, layer, h, pos)  # [T, Hq, D], [T, Hkv, D]
            kc, vc = self.kv.k[i], self.kv.v[i]  # [S, Hkv, cap, D]
            kc[slots, :, kv_pos] = k.to(kc.dtype)
            vc[slots, :, kv_pos] = v.to(vc.dtype)
            lo = 0 if slot is None else slot
            keys = kc[lo : lo + batch, :, :span]  # [B, Hkv, span, D]
            values = vc[lo : lo + batch, :, :span]
            return self._attention(q, keys, values, masks[cfg.layer_window(i)], batch)

        for i, layer in enumerate(model.layers):
            if i in self.capture:
                taken[i] = x
            x = model._layer(i, layer, x, pos, None, None, attend)
        taken[len(model.layers)] = x
        final = model.ops.rms_norm(x, model.norm, cfg.rms_norm_eps)
        if not self.capture:
            return final, None
        taken[HIDDEN_FINAL] = final
        return final, torch.cat([taken[i] for i in self.capture], dim=-1)

    def _attention(
        self,
        q: torch.Tensor,  # [B * rows, Hq, D]
        keys: torch.Tensor,  # [B, Hkv, span, D]
        values: torch.Tensor,
        mask: torch.Tensor,  # [B, 1, group * rows, span] additive
        batch: int,
    ) -> torch.Tensor:  # [B * rows, Hq * D]
        cfg = self.model.shard_cfg
        hkv, g, d = keys.shape[1], self.group, q.shape[-1]
        rows = q.shape[0] // batch
        # NOTE: the g query heads of one KV head become g * rows query rows of that head
        q4 = q.view(batch, rows, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(batch, hkv, g * rows, d)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if cfg.attn_logit_softcapping:
            scores = torch.matmul(q4, keys.transpose(-1, -2)) * cfg.attn_scale
            cap = cfg.attn_logit_softcapping
            scores = cap * torch.tanh(scores / cap) + mask
            out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)
        else:
            out = F.scaled_dot_product_attention(
                q4, keys, values, attn_mask=mask, scale=cfg.attn_scale
            )  # [B, Hkv, g * rows, D]
        out = out.view(batch, hkv, g, rows, d).permute(0, 3, 1, 2, 4)
        return out.reshape(batch * rows, hkv * g * d)


class StaticModelRunner(ModelRunner):
    """``ModelRunner`` over ``static`` (a :class:`StaticForward`: its model, KV cache and
    captured states): a request whose fed tokens are generated ones (``output_pos > 0``, at most
    ``rows``) runs in the step; any other (prompt chunks, prompt log-probabilities) in prefill
    pieces."""

    def __init__(self, static: StaticForward) -> None:
        super().__init__(static.model, static.kv, static.capture)
        self.static = static
        self.static.capture_all()

    def in_step(self, s: ScheduledRequest) -> bool:
        rows = self.static.rows
        return s.output_pos > 0 and not s.prompt_next_token_ids and len(s.token_ids) <= rows

    def _forward(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        stepped = [self.in_step(s) for s in scheduled]
        step_out = None
        if any(stepped):
            step_out = self.static.step(
                [(s.slot, s.start_pos, s.token_ids) for s, on in zip(scheduled, stepped) if on]
            )
        R = self.static.rows
        logits: list[torch.Tensor] = []
        hidden: list[torch.Tensor | None] = []
        for s, on in zip(scheduled, stepped):
            n = len(s.token_ids)
            if on:
                _, step_logits, step_captured = step_out
                first = s.slot * R
                if s.needs_logits:
                    logits.append(step_logits[first + n - 1 - s.num_drafts : first + n])
                # NOTE: a copy: the graph's next replay overwrites its outputs
                cap = None if step_captured is None else step_captured[first : first + n].clone()
                hidden.append(cap)
                continue
            final, captured = self.static.prefill(s.slot, s.start_pos, s.token_ids)
            rows = list(range(len(s.prompt_next_token_ids)))
            if s.needs_logits:
                rows += list(range(n - 1 - s.num_drafts, n))
            if rows:
                logits.append(self.static.logits(final[torch.tensor(rows, device=final.device)]))
            hidden.append(captured)
        return (torch.cat(logits) if logits else None), hidden
