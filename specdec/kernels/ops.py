"""The ops behind :class:`KernelOps`: :class:`NativeOps` (the C++ kernels, batch-invariant) and
:class:`TorchOps` (plain PyTorch, any device), and :func:`get_ops` to pick one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from specdec.kernels.formats import _QT_CODE
from specdec.kernels.native import _C, native_unavailable_reason
from specdec.kernels.weights import PackedWeight
from specdec.kv_cache.pool import blocked_keys


class KernelOps:
    """Interface of the kernel implementations.  See :func:`get_ops`."""

    name: str = "abstract"
    # Whether decoder_layer() exists: one call per layer instead of the Python op sequence.
    supports_fused_layers: bool = False
    # Key cache layout these ops read: 0 = [Hkv, L, D]; B > 0 = blocked and transposed,
    # [Hkv, ceil(L / B), D, B] (see specdec.kv_cache.pool).  attention() takes either.
    key_block: int = 0
    # Positions per attention block of the fused layers (kAttnBlock): shared prefixes come in
    # whole blocks.  0: no fused layers.
    attn_block: int = 0

    def linear(
        self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [M, K]`` float32 -> ``x @ W.T (+ bias)``, ``[M, N]``."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x * rsqrt(mean(x^2, -1) + eps) * weight`` over the last dimension."""
        raise NotImplementedError

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start_pos: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Causal attention of one sequence's ``T`` new rows over its KV cache.

        ``q [T, H, D]`` holds positions ``start_pos .. start_pos + T - 1``; ``k_cache`` and
        ``v_cache`` are ``[Hkv, L, D]`` with entries ``0 .. start_pos + T - 1`` valid (the new
        tokens included); ``k_cache`` may instead be in the ops' ``key_block`` layout
        (``[Hkv, ceil(L / B), D, B]``), which the engine's caches use.  Row ``t`` attends keys
        ``j <= start_pos + t`` (and, with ``sliding_window > 0``, only
        ``start_pos + t - j < sliding_window``).  Query head ``h``
        uses kv head ``h // (H // Hkv)``.  ``softcap > 0`` maps scaled scores ``s`` to
        ``softcap * tanh(s / softcap)`` before the softmax.  Returns ``[T, H, D]``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# A decoder layer's norm weights, named alike in LayerWeights and _C.DecoderLayer (None: absent).
_LAYER_NORMS = (
    "input_norm", "post_attn_norm", "q_norm", "k_norm", "post_attn_out_norm", "post_ffw_norm",
)  # fmt: skip


def _kernel_weight(w: PackedWeight) -> tuple[torch.Tensor, int, list[int]]:
    """The tensor, qtype code and parts _C.linear takes for ``w`` (8-bit activations when
    enabled)."""
    code = w.qtype_code
    if w.x2_tiles is not None:  # flat tiles: the rows ride in parts, as K-quants' do
        return w.x2_tiles, code, [_QT_CODE[w.qtype], w.out_features]
    if w.a8 is not None:
        return w.a8, int(_C.QT_A8_BASE) + code, w.part_codes()
    return w.data, code, w.part_codes()


class NativeOps(KernelOps):
    """C++ kernels (CPU, float32).  Batch-invariant: rows never depend on the other rows."""

    name = "native"

    def __init__(self) -> None:
        if _C is None:
            raise RuntimeError(
                f"native kernels unavailable ({native_unavailable_reason()}); build them with "
                "`pip install --no-build-isolation -e .`"
            )
        self._C = _C
        self.key_block = int(_C.KEY_BLOCK)  # kKeyBlock of kernels.h
        self.attn_block = int(_C.ATTN_BLOCK)  # kAttnBlock

    @property
    def isa(self) -> str:
        return self._C.isa()

    def linear(
        self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        data, code, parts = _kernel_weight(w)
        if x.dim() == 2:
            return self._C.linear(x, data, code, w.out_features, w.in_features, bias, parts)
        lead = x.shape[:-1]
        y = self._C.linear(
            x.reshape(-1, x.shape[-1]), data, code, w.out_features, w.in_features, bias, parts
        )
        return y.reshape(*lead, w.out_features)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._C.rms_norm(x, weight, float(eps))

    supports_fused_layers = True

    def decoder_layer(self, cfg: Any, index: int, lw: Any) -> Any:
        """A whole decoder layer as one native call (``_C.DecoderLayer``).

        ``cfg`` is the model's ArchConfig and ``lw`` its LayerWeights for layer ``index``; the
        result's ``forward(x, cos, sin, k_cache, v_cache, slots, starts, counts)`` computes what
        ``LlamaModel._layer`` computes, bit for bit.
        """

        def lin(prefix: str, linear: Any) -> dict[str, Any]:
            if linear is None:  # a mixture-of-experts layer's dense feed-forward: none
                data, code, parts, bias = torch.empty(0, dtype=torch.uint8), 0, [], None
            else:
                (data, code, parts), bias = _kernel_weight(linear.weight), linear.bias
            return {
                f"{prefix}_w": data,
                f"{prefix}_qt": code,
                f"{prefix}_bias": bias,
                f"{prefix}_parts": parts,
            }

        layer = self._C.DecoderLayer(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            eps=float(cfg.rms_norm_eps),
            attn_scale=float(cfg.attn_scale),
            sliding_window=int(cfg.layer_window(index)),
            softcap=float(cfg.attn_logit_softcapping),
            activation="gelu_tanh" if cfg.is_gemma else "silu",
            **{name: getattr(lw, name) for name in _LAYER_NORMS},
            **lin("qkv", lw.qkv),
            **lin("o", lw.o_proj),
            **lin("gate_up", lw.gate_up),
            **lin("down", lw.down),
        )
        if lw.moe is not None:
            layer.set_moe(self.moe_ffn(lw.moe))
        return layer

    def linear_spec(self, linear: Any) -> Any:
        """``linear`` as the native layers take it (``_C.LinearSpec``)."""
        data, code, parts = _kernel_weight(linear.weight)
        return self._C.LinearSpec(data, code, linear.weight.in_features, linear.bias, parts)

    def moe_ffn(self, moe: Any) -> Any:
        """A ``MoeBlock`` (model/moe.py) as one native call (``_C.MoeFfn``): the same bits."""
        spec = self.linear_spec
        shared = moe.shared is not None and moe.shared_gate is not None
        return self._C.MoeFfn(
            router=spec(moe.router),
            gate_up=[spec(e.gate_up) for e in moe.experts],
            down=[spec(e.down) for e in moe.experts],
            top_k=moe.top_k,
            norm_topk_prob=moe.norm_topk_prob,
            shared_gate_up=spec(moe.shared.gate_up) if shared else None,
            shared_down=spec(moe.shared.down) if shared else None,
            shared_gate=spec(moe.shared_gate) if shared else None,
            grouped=moe.grouped,
        )

    def forward_layers(
        self,
        layers: list[Any],
        x: torch.Tensor,
        cos: list[torch.Tensor],
        sin: list[torch.Tensor],
        rope: list[int],
        k_caches: torch.Tensor,
        v_caches: torch.Tensor,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        capture: list[int],
        reducer: Any = None,
        prefix_slots: Sequence[int] = (),
        prefix_lens: Sequence[int] = (),
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``decoder_layer`` results run in order in one native call: the last one's output, and
        the input of each layer index in ``capture``. ``rope[i]`` picks layer i's (cos, sin):
        each token's rows ``[T, D]``, or with ``positions`` (int64 ``[T]``) whole tables
        ``[rows, D]`` the call reads each token's rows from. ``reducer`` (a ``_C.ShmReducer``,
        tensor parallelism) sums the ranks' o_proj and down_proj outputs inside each layer.
        ``prefix_slots`` / ``prefix_lens``: shared prefixes (``SeqBatch``), read once for every
        sequence on the same one."""
        return self._C.forward_layers(
            layers, x, cos, sin, rope, k_caches, v_caches, slots, starts, counts, capture, reducer,
            list(prefix_slots), list(prefix_lens), positions,
        )  # fmt: skip

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start_pos: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if k_cache.dim() == 3 and k_cache.dtype != torch.int8:  # [Hkv, L, D]: blocked (a copy)
            k_cache = blocked_keys(k_cache, self.key_block)
        return self._C.attention(
            q, k_cache, v_cache, int(start_pos), float(scale), int(sliding_window), float(softcap)
        )


class TorchOps(KernelOps):
    """Pure PyTorch ops; run on the device of their inputs (CPU or CUDA).

    Quantized weights are dequantized once, lazily, to a float copy cached on the PackedWeight
    (per device), then used with ``F.linear``: this path is for CUDA and for debugging, not for
    speed or memory on CPU.  Results are not batch-invariant.
    """

    name = "torch"

    def linear(
        self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = w.float_weight(x.device)
        if x.dtype != weight.dtype:  # bfloat16 / float16 activations: a cached cast of the weight
            key = f"{x.device}:{x.dtype}"
            cast = w._float_cache.get(key)
            if cast is None:
                cast = w._float_cache[key] = weight.to(x.dtype)
            weight = cast
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:  # half precision: normalise in float32, return the input dtype
            return self.rms_norm(x.float(), weight.float(), eps).to(x.dtype)
        x = x.to(torch.float32)
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start_pos: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        t, h, d = q.shape
        hkv = k_cache.shape[0]
        g = h // hkv
        n = start_pos + t
        device = q.device
        k = k_cache[:, :n].to(q.dtype)  # [Hkv, n, D]; a 16-bit cache (kv_cache_dtype) widens here
        v = v_cache[:, :n].to(q.dtype)
        qg = q.reshape(t, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, T, D]
        scores = torch.matmul(qg, k.transpose(1, 2).unsqueeze(1)) * scale  # [Hkv, g, T, n]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(start_pos, n, device=device).unsqueeze(1)  # [T, 1]
        j = torch.arange(n, device=device).unsqueeze(0)  # [1, n]
        allowed = j <= pos
        if sliding_window > 0:
            allowed = allowed & (pos - j < sliding_window)
        scores = scores.masked_fill(~allowed, -math.inf)
        p = torch.softmax(scores, dim=-1)
        out = torch.matmul(p, v.unsqueeze(1))  # [Hkv, g, T, D]
        return out.permute(2, 0, 1, 3).reshape(t, h, d)


_OPS: dict[str, KernelOps] = {}


def get_ops(name: str = "auto", device: torch.device | str = "cpu") -> KernelOps:
    """Pick kernels: "auto" (native on CPU when built, else torch), "torch" or "native"."""
    dev = torch.device(device)
    if name == "auto":
        name = "native" if dev.type == "cpu" and _C is not None else "torch"
    if name == "torch":
        if "torch" not in _OPS:
            _OPS["torch"] = TorchOps()
        return _OPS["torch"]
    if name == "native":
        if dev.type != "cpu":
            raise RuntimeError(f"native kernels run on the CPU only, not on {dev}; use 'torch'")
        if "native" not in _OPS:
            _OPS["native"] = NativeOps()
        return _OPS["native"]
    raise ValueError(f"unknown kernel ops {name!r}; expected 'auto', 'torch' or 'native'")
