"""What the drafters that read the target's hidden states share: reading a head's files, its
decoder layer, and chain drafting with a KV cache of the head's own.

A head drafts from pairs (target state at position t, token t + 1): at position t it reads the
embedding of token t + 1 and a feature (the target's state there, or for positions the target has
not reached, the head's own output one position earlier), runs its decoder layer over its KV
cache, and predicts token t + 2 (EAGLE, Li et al. 2024; EAGLE-3, Li et al. 2025; DeepSeek-V3's
multi-token prediction). Positions fed with the target's states are kept in the head's cache;
drafting writes past them and is overwritten next time (rollback is a length, as for the target).

Weights come from safetensors, or from ``.bin`` / ``.pt`` through ``torch.load(weights_only=True)``;
nothing else is unpickled.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.config import ConfigError
from specdec.kernels import KernelOps, quantize_weight
from specdec.kernels import _kernel_weight as kernel_weight  # (weight, qtype, parts) for _C
from specdec.kv_cache.pool import KVCache
from specdec.model.layers import Rotary, rope_inv_freq
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.spec_decode.base import DraftInput, DraftOutput, DraftRequest, Proposer
from specdec.spec_decode.draft_model import draw_rows

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
EAGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the files EAGLE heads ship


# ---- files -----------------------------------------------------------------------------------
def head_folder(path: str | None, method: str) -> Path:
    if not path:
        raise ConfigError(f"speculative_config.model: method '{method}' needs a head folder")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"speculative_config.model: {path!r} is not a folder (method '{method}' loads a "
            "head from a local folder with config.json and its weights)"
        )
    return folder


def read_head(path: str | None, method: str) -> tuple[Path, dict[str, Any]]:
    """The head folder ``speculative_config.model`` names for ``method``, and its config."""
    folder = head_folder(path, method)
    return folder, read_config(folder)


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"speculative_config.model: {path} is not valid JSON: {e}") from e


def read_weights(folder: Path, names: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors of ``folder``: the first of ``names`` that exists, else every weight file in
    it (sharded checkpoints), safetensors first. Values as stored (dtype unchanged)."""
    files = [folder / n for n in names if (folder / n).is_file()][:1]
    if not files:
        found = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        safe = [p for p in found if p.suffix == ".safetensors"]
        files = safe or found
    if not files:
        raise ConfigError(
            f"speculative_config.model: no weights in {folder} (looked for "
            f"{', '.join(names) or '*.safetensors / *.bin / *.pt'})"
        )
    out: dict[str, torch.Tensor] = {}
    for path in files:
        out.update(_read_file(path))
    return out


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a pickle that needs more than tensors
        raise ConfigError(
            f"speculative_config.model: {path.name} cannot be read as plain tensors "
            f"(weights_only=True): {type(e).__name__}: {e}".splitlines()[0]
        ) from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ConfigError(f"speculative_config.model: {path.name} holds no state dict")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def strip_prefix(weights: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict:
    out = {}
    for name, t in weights.items():
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p) :]
                break
        out[name] = t
    return out


def read_eagle_weights(folder: Path) -> dict[str, torch.Tensor]:
    """An EAGLE / EAGLE-3 head's tensors (``model.safetensors`` or ``pytorch_model.bin``), their
    ``model.`` prefix stripped."""
    return strip_prefix(read_weights(folder, EAGLE_WEIGHT_FILES), ("model.",))


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ConfigError(
            f"speculative_config.model: {name} has shape {tuple(t.shape)}, the target needs "
            f"{shape} ({what})"
        )


# ---- the decoder layer -----------------------------------------------------------------------
HEAD_QTYPES = ("q8_0", "q4_0")


class HeadLinear:
    """A head's linear layer: Q8_0 (or Q4_0) weights with 8-bit activations where the target
    runs those kernels (a head's numerics never change the output, only how often drafts are
    right), float32 elsewhere."""

    def __init__(
        self,
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None,  # [N]
        target: LlamaModel,
        qtype: str = "q8_0",
    ) -> None:
        dev = target.device
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.to(device=dev, dtype=torch.float32)
        self.ops: KernelOps = target.ops
        self.weight: torch.Tensor | None = weight.to(device=dev, dtype=torch.float32)
        self.packed = None
        if target.activation_dtype == "int8" and weight.shape[1] % 32 == 0:
            packed = quantize_weight(self.weight, qtype)
            if packed.a8_eligible():
                packed.enable_a8()
                self.packed, self.weight = packed, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.packed is not None:
            return self.ops.linear(x.contiguous(), self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def native(self) -> tuple[torch.Tensor, int]:
        """(weight, qtype code) as ``_C.linear`` takes them (no bias, no K-quant parts)."""
        if self.bias is not None:
            raise ValueError("the native head's linear layers have no bias")
        if self.packed is None:
            return self.weight, 0  # QT_F32
        data, code, parts = kernel_weight(self.packed)
        assert not parts
        return data, code


@dataclass
class HeadLayer:
    """A Llama decoder layer (q/k/v may read a wider input, as EAGLE-3's does)."""

    q: HeadLinear  # [Hq * D, in]
    k: HeadLinear  # [Hkv * D, in]
    v: HeadLinear  # [Hkv * D, in]
    o: HeadLinear  # [H, Hq * D]
    gate: HeadLinear  # [I, H]
    up: HeadLinear  # [I, H]
    down: HeadLinear  # [H, I]
    post_norm: torch.Tensor  # [H]
    input_norm: torch.Tensor | None  # [H]; None: attention reads the input as it is


def head_layer(
    w: dict[str, torch.Tensor], prefix: str, target: LlamaModel, qtype: str = "q8_0"
) -> HeadLayer:
    """The layer under ``prefix`` (``layers.0.``, ``midlayer.``...), Hugging Face key names."""

    def get(name: str) -> torch.Tensor:
        if prefix + name not in w:
            raise ConfigError(f"speculative_config.model: the head has no tensor {prefix}{name}")
        return w[prefix + name]

    def lin(name: str) -> HeadLinear:
        return HeadLinear(get(name + ".weight"), w.get(prefix + name + ".bias"), target, qtype)

    norm = w.get(prefix + "input_layernorm.weight")
    return HeadLayer(
        q=lin("self_attn.q_proj"), k=lin("self_attn.k_proj"), v=lin("self_attn.v_proj"),
        o=lin("self_attn.o_proj"), gate=lin("mlp.gate_proj"), up=lin("mlp.up_proj"),
        down=lin("mlp.down_proj"),
        post_norm=get("post_attention_layernorm.weight").to(target.device, torch.float32),
        input_norm=None if norm is None else norm.to(target.device, torch.float32),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# ---- chain drafting --------------------------------------------------------------------------
@dataclass
class _HeadState:
    slot: int
    base: int  # position held at index 0 of the head's KV slot
    end: int  # positions base .. end - 1 were fed with the target's states


class HiddenStateProposer(Proposer):
    """Chain drafting for heads that read the target's states (EAGLE, EAGLE-3, MTP).

    Subclasses name the states they read (``hidden_layers``) and implement ``_step``; tree
    drafting would add a branching ``propose`` here and reuse ``_step`` unchanged.
    """

    def __init__(
        self,
        target: LlamaModel,
        head_cfg: dict[str, Any],
        max_num_seqs: int,
        max_len: int,
        sample_method: str,
        num_layers: int = 1,
    ) -> None:
        self.target = target
        self.device = target.device
        self.sample_method = sample_method
        self.max_len = max_len
        cfg = target.cfg
        self.hidden_size = cfg.hidden_size
        self.num_heads = int(head_cfg.get("num_attention_heads", cfg.num_heads))
        self.num_kv_heads = int(head_cfg.get("num_key_value_heads", self.num_heads))
        self.head_dim = int(
            head_cfg.get("head_dim")
            or head_cfg.get("hidden_size", cfg.hidden_size) // self.num_heads
        )
        self.eps = float(head_cfg.get("rms_norm_eps", cfg.rms_norm_eps))
        theta = float(head_cfg.get("rope_theta", cfg.rope_theta))
        scaling = head_cfg.get("rope_scaling", cfg.rope_scaling)
        inv = rope_inv_freq(self.head_dim, theta, scaling, None)
        self.rotary = Rotary(inv, max_len, torch.float32, self.device)
        self.ops = target.ops
        self.kv = KVCache(
            num_layers, max_num_seqs, self.num_kv_heads, max_len, self.head_dim, torch.float32,
            self.device, key_block=self.ops.key_block,
        )  # fmt: skip
        self.states: dict[str, _HeadState] = {}

    def build_layer(
        self, w: dict[str, torch.Tensor], prefix: str, qtype: str = "q8_0"
    ) -> HeadLayer:
        """The decoder layer under ``prefix``, its attention's shapes checked first."""
        self.check_attention(w, prefix)
        return head_layer(w, prefix, self.target, qtype)

    def check_attention(self, w: dict[str, torch.Tensor], prefix: str) -> None:
        """The layer's q / k / v rows must be its heads x head_dim (else its attention would
        silently read the wrong columns): a one-line ConfigError naming the tensor."""
        names = [prefix + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")]
        if any(n not in w for n in names):
            return  # head_layer names the missing tensor
        in_dim = w[names[0]].shape[1]
        for name, heads in (("q_proj", self.num_heads), ("k_proj", self.num_kv_heads),
                            ("v_proj", self.num_kv_heads)):  # fmt: skip
            t = w[prefix + f"self_attn.{name}.weight"]
            want = (heads * self.head_dim, in_dim)
            check_shape(prefix + f"self_attn.{name}", t, want, f"{heads} heads x {self.head_dim}")

    # ---- what a head defines -----------------------------------------------------------------
    @abstractmethod
    def _step(
        self,
        token_ids: torch.Tensor,  # [T] the token after each position
        feats: torch.Tensor,  # [T, F] target states (from_target) or the head's own outputs
        from_target: bool,
        positions: torch.Tensor,  # [T]
        batch: SeqBatch,  # slots and KV indices in the head's cache
    ) -> torch.Tensor:
        """The head's output at each position [T, H]: its next position's feature."""

    @abstractmethod
    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """[R, H] outputs -> [R, V] logits over the target's vocabulary (float32)."""

    # ---- shared layer math -------------------------------------------------------------------
    def _layer(
        self,
        index: int,  # the layer's index in the head's KV cache
        lw: HeadLayer,
        x: torch.Tensor,  # [T, H] residual stream
        attn_in: torch.Tensor,  # [T, in] what q/k/v read
        positions: torch.Tensor,  # [T]
        batch: SeqBatch,
    ) -> torch.Tensor:  # [T, H]
        T, D = x.shape[0], self.head_dim
        q = lw.q(attn_in).view(T, self.num_heads, D)
        k = lw.k(attn_in).view(T, self.num_kv_heads, D)
        v = lw.v(attn_in).view(T, self.num_kv_heads, D)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        out = torch.empty_like(q)
        offset = 0
        for slot, start, n in zip(batch.slots, batch.start_pos, batch.num_tokens):
            self.kv.store(index, slot, start, k[offset : offset + n], v[offset : offset + n])
            out[offset : offset + n] = self.ops.attention(
                q[offset : offset + n].contiguous(), self.kv.k[index, slot], self.kv.v[index, slot],
                start, D**-0.5,
            )  # fmt: skip
            offset += n
        x = x + lw.o(out.view(T, -1))
        h = self._norm(x, lw.post_norm)
        return x + lw.down(F.silu(lw.gate(h)) * lw.up(h))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``rms_norm`` with the head's epsilon."""
        return rms_norm(x, weight, self.eps)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H] float32
        return self.target.embed(token_ids).to(torch.float32)

    # ---- lifecycle ---------------------------------------------------------------------------
    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.kv.free(state.slot)

    def propose(self, inp: DraftInput) -> DraftOutput:
        with torch.inference_mode():
            return self._propose(inp)

    def _propose(self, inp: DraftInput) -> DraftOutput:
        drafts: dict[str, list[int]] = {r.req_id: [] for r in inp.requests}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in inp.requests}
        feeds = {r.req_id: self._new_states(r) for r in inp.requests if r.max_num_drafts > 0}
        fed = [r for r in inp.requests if feeds.get(r.req_id) is not None]
        if fed:
            feats = self._catch_up(fed, feeds)
            keep = [i for i, r in enumerate(fed) if self._can_draft(r)]
            live = [fed[i] for i in keep]
            feats = feats[keep] if len(keep) < len(fed) else feats
            if live and self._greedy_chain(live, feats, drafts):
                live = []
            elif live:
                logits = self._logits(feats)
            while live:
                draw_rows(logits, live, drafts, probs, self.sample_method)
                keep = [i for i, r in enumerate(live) if len(drafts[r.req_id]) < r.max_num_drafts]
                live = [live[i] for i in keep]
                if live:
                    feats, logits = self._chain(live, feats[keep], drafts)
        out_probs = [torch.cat(probs[r.req_id]) if probs[r.req_id] else None for r in inp.requests]
        return DraftOutput([drafts[r.req_id] for r in inp.requests], out_probs)

    def _new_states(self, r: DraftRequest) -> torch.Tensor | None:
        """The request's target states the head has not fed yet (None: none)."""
        rows, start = r.hidden_states, r.hidden_start
        if rows is None or rows.shape[0] == 0:
            return None
        state = self.states.get(r.req_id)
        if state is None:
            state = self.states[r.req_id] = _HeadState(self.kv.allocate(), start, start)
        if start > state.end or start < state.base:
            state.base = state.end = start  # NOTE: a gap: the head keeps what is contiguous
        rows = rows[state.end - start :]
        return rows if rows.shape[0] else None

    def _can_draft(self, r: DraftRequest) -> bool:
        """The head has the target's states up to the last token, and room for the drafts."""
        state, n = self.states[r.req_id], len(r.token_ids)
        return state.end == n - 1 and n - 1 - state.base + r.max_num_drafts <= self.max_len

    def _greedy_chain(
        self, live: list[DraftRequest], feats: torch.Tensor, drafts: dict[str, list[int]]
    ) -> bool:
        """Draw every draft of ``live`` in one go when the head can (a native greedy chain);
        False leaves it to the step-by-step loop. ``feats``: the outputs at their last fed
        positions."""
        return False

    def _catch_up(self, fed: list[DraftRequest], feeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """Feed each request's new target states; the head's output at its last position."""
        ids, pos, batch = [], [], SeqBatch([], [], [])
        for r in fed:
            state, m = self.states[r.req_id], feeds[r.req_id].shape[0]
            ids.extend(r.token_ids[state.end + 1 : state.end + 1 + m])
            pos.extend(range(state.end, state.end + m))
            batch.slots.append(state.slot)
            batch.start_pos.append(state.end - state.base)
            batch.num_tokens.append(m)
            state.end += m
        feats = torch.cat([feeds[r.req_id] for r in fed]).to(torch.float32)
        out = self._run(ids, pos, feats, True, batch)
        if len(fed) == 1:
            return out[-1:]
        return out[torch.tensor(batch.num_tokens, device=self.device).cumsum(0) - 1]

    def _chain(
        self, live: list[DraftRequest], feats: torch.Tensor, drafts: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One more position per request: its last draft with the head's own feature."""
        ids, pos, batch = [], [], SeqBatch([], [], [])
        for r in live:
            state = self.states[r.req_id]
            p = len(r.token_ids) - 2 + len(drafts[r.req_id])  # the last draft is token p + 1
            ids.append(drafts[r.req_id][-1])
            pos.append(p)
            batch.slots.append(state.slot)
            batch.start_pos.append(p - state.base)
            batch.num_tokens.append(1)
        out = self._run(ids, pos, feats, False, batch)
        return out, self._logits(out)

    def _run(
        self,
        ids: list[int],
        pos: list[int],
        feats: torch.Tensor,
        from_target: bool,
        batch: SeqBatch,
    ) -> torch.Tensor:
        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return self._step(token_ids, feats, from_target, positions, batch)
