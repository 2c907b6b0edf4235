"""Decoder-only transformer for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2).

Tokens of all sequences in a step are flattened into one ``[num_tokens, hidden]`` batch for the
linear layers; attention runs per sequence against that sequence's KV slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from specdec.distributed.shard import plan_shard, shard_arch, vocab_range
from specdec.errors import ConfigError
from specdec.kernels import (
    A8_QTYPES,
    HALF_QTYPES,
    KernelOps,
    PackedWeight,
    amx16_available,
    int8_activations_fast,
    int8_activations_pay,
    kquant_float_fast,
)
from specdec.kv_cache.pool import KVCache
from specdec.model.arch import ArchConfig
from specdec.model.layers import Linear, Rotary, make_linear, rope_inv_freq
from specdec.model.loader import LoadedCheckpoint, RawTensor
from specdec.model.moe import MoeBlock, load_moe

if TYPE_CHECKING:
    from specdec.distributed.comm import TPGroup
    from specdec.model.weight_cache import WeightCache

ACTIVATION_DTYPES = ("auto", "float32", "int8", "bf16x2")
HIDDEN_FINAL = -1  # in a capture list: the final normed hidden state (what the LM head reads)
# a layer's attention: (layer index, weights, h [T, H], positions [T], batch, kv) -> [T, Hq * D]
Attend = Callable[..., torch.Tensor]


@dataclass
class SeqBatch:
    """Where each sequence's tokens sit in the flattened batch and in the KV pool."""

    slots: list[int]  # KV slot per sequence
    start_pos: list[int]  # position of each sequence's first new token (= its cached length)
    num_tokens: list[int]  # new tokens per sequence, contiguous in that order
    # Shared prefixes (kv_cache/pool.py): sequence s reads its first prefix_lens[s] positions
    # from slot prefix_slots[s] (both empty, or one per sequence; 0: none)
    prefix_slots: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)

    def prefix(self, s: int) -> tuple[int, int]:
        """Sequence ``s``'s shared prefix: (slot, length), length 0 for none."""
        if not self.prefix_lens:
            return -1, 0
        return self.prefix_slots[s], self.prefix_lens[s]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear
    o_proj: Linear
    post_attn_norm: torch.Tensor  # [H]
    gate_up: Linear | None  # None in a mixture-of-experts layer
    down: Linear | None
    moe: MoeBlock | None = None
    q_norm: torch.Tensor | None = None  # [D] (Gemma 3, Qwen3)
    k_norm: torch.Tensor | None = None  # [D] (Gemma 3, Qwen3)
    post_attn_out_norm: torch.Tensor | None = None  # [H] (Gemma 3)
    post_ffw_norm: torch.Tensor | None = None  # [H] (Gemma 3)


class LlamaModel:
    """``forward(input_ids, positions, batch, kv) -> hidden``; ``compute_logits(hidden) -> logits``."""

    def __init__(
        self,
        ckpt: LoadedCheckpoint,
        ops: KernelOps,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        quantization: str = "auto",
        max_len: int = 2048,
        activation_dtype: str = "float32",
        weight_cache: WeightCache | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        self.cfg: ArchConfig = ckpt.arch
        # NOTE: under tensor parallelism ``ckpt`` holds this rank's shard (model/shard.py) and
        # shard_cfg its head and intermediate counts; cfg stays the whole model's (drafters read it)
        self.tp = tp
        self.shard_cfg = self.cfg
        if tp is not None:
            self.shard_cfg = shard_arch(self.cfg, plan_shard(self.cfg, tp.rank, tp.size))
        self.source_path = ckpt.path  # the checkpoint it was loaded from (MTP layers live there)
        self.ops = ops
        self.device = device
        self.dtype = dtype
        self.kv_dtype = dtype  # the KV cache's element type (kv_cache_dtype; see set_kv_dtype)
        # How an 8-bit cache holds keys (measure_key_transform): [layers, Hkv, D] each, or None
        self.key_shift: torch.Tensor | None = None
        self.key_scale: torch.Tensor | None = None
        # measure_key_transform's records while it runs: per layer, its (queries, keys) before
        # rotation
        self._calibration: dict[int, list] | None = None
        self.max_len = max_len
        t = ckpt.tensors
        # NOTE: with 8-bit activations ahead, q8_0/q4_0/q4_1 weights are repacked for them as
        # they load, and their blocks are not kept (set_activation_dtype gives them back)
        self._a8_on_load = (
            ops.name == "native"
            and device.type == "cpu"
            and (
                activation_dtype == "int8"
                or (activation_dtype == "auto" and int8_activations_fast())
            )
        )
        self._cache = weight_cache
        self._load_linears(t, quantization, tp)
        self.norm = self._vec(t["norm"])
        self.vocab_range: tuple[int, int] | None = None  # tensor parallel: this rank's rows
        if tp is not None:
            self.vocab_rows = t["embed_tokens"].shape[0]
            self.vocab_range = vocab_range(self.vocab_rows, tp.rank, tp.size)
        freq_factors = t["rope_freqs"].to_float() if "rope_freqs" in t else None
        self._rotary: dict[float, Rotary] = {}
        for theta in {self.cfg.layer_rope_theta(i) for i in range(self.cfg.num_layers)}:
            inv = rope_inv_freq(self.cfg.head_dim, theta, self.cfg.rope_scaling, freq_factors)
            self._rotary[theta] = Rotary(inv, max_len, dtype, device)
        # The whole layer stack as one native call (kernels/csrc/layer.cpp: forward_layers) when
        # the native kernels run; the Python _layer below is the same computation, op by op
        # (CUDA, torch kernels, tests).
        # NOTE: tensor-parallel ranks run the fused stack when their all-reduce is the native
        # one; mixture-of-experts layers run theirs natively too (kernels/csrc/moe.cpp)
        self.use_fused_layers = ops.supports_fused_layers and (
            dtype == torch.float32
            and device.type == "cpu"
            and (tp is None or tp.native_reducer is not None)
        )
        self._fused: list | None = None
        self._rope_index: list[int] | None = None  # per layer: which rotary table it uses
        self.activation_dtype = "float32"
        self.set_activation_dtype(activation_dtype)
        if weight_cache is not None:
            weight_cache.save()  # NOTE: after the activation choice, which may repack weights

    def _load_linears(self, t: dict[str, RawTensor], quantization: str, tp: TPGroup | None) -> None:
        """The layers, the output layer and the embedding rows, from ``t`` (or the cache)."""
        self.layers = [self._load_layer(t, i, quantization) for i in range(self.cfg.num_layers)]
        # NOTE: under tensor parallelism the output layer is this rank's vocabulary rows
        # (model/shard.py), never the (whole) embedding
        tied = self.cfg.tie_word_embeddings and tp is None
        embed = self._linear("embed_tokens", [t["embed_tokens"]], [None], quantization, tied)
        # NOTE: tied models read their embeddings from the output layer's (quantized) rows.
        self._embed: PackedWeight = embed.weight
        if tied:
            self.lm_head = embed
        else:
            self.lm_head = self._linear("lm_head", [t["lm_head"]], [None], quantization)

    def slow_float_kquants(self) -> bool:
        """Whether some weight is a K-quant tile that float activations would run on the scalar
        twins (no vector kernels for them here: AVX2)."""
        return not kquant_float_fast() and any(lin.weight.is_kquant for lin in self.linears())

    def _linear(
        self,
        name: str,
        raws: list[RawTensor],
        biases: list[RawTensor | None],
        quantization: str,
        a8: bool = True,
    ) -> Linear:
        """A linear layer, its weight from the weight cache when it holds it."""
        packed = self._cache.get(name) if self._cache is not None else None
        lin = make_linear(
            raws, biases, quantization, self.ops, self.dtype, self.device,
            a8 and self._a8_on_load, packed,
        )  # fmt: skip
        if self._cache is not None and packed is None:
            self._cache.put(name, lin.weight)
        return lin

    # ---- activation precision ------------------------------------------------------------
    def linears(self) -> list[Linear]:
        out = []
        for lw in self.layers:
            out += [lw.qkv, lw.o_proj]
            out += lw.moe.linears() if lw.moe is not None else [lw.gate_up, lw.down]
        return out + [self.lm_head]

    def set_activation_dtype(self, activation_dtype: str) -> None:
        """``"float32"``: float activations (matches Hugging Face transformers on the same
        weights).  ``"int8"``: the 8-bit activation kernels for every quantized linear layer
        (llama.cpp's arithmetic for GGUF weights; ~2-4x faster verification rows on CPUs with
        AVX-512 VNNI).  ``"bf16x2"``: every f16 / bf16 linear layer on AMX-BF16 tiles, each
        activation split into two bfloat16s (~16 significant bits; ~2-3x faster prefill, flat
        verification, slower decode for float16 weights; other layers stay float32).
        ``"auto"``: int8 where those kernels run natively and the weights are quantized, else
        bf16x2 for the bfloat16 layers on CPUs with AMX-BF16, else float32.  All are batch-invariant, so speculation
        stays exact."""
        if activation_dtype not in ACTIVATION_DTYPES:
            raise ConfigError(
                f"activation_dtype must be one of {', '.join(ACTIVATION_DTYPES)}, "
                f"got {activation_dtype!r}"
            )
        native_cpu = self.ops.name == "native" and self.device.type == "cpu"
        eligible = [lin for lin in self.linears() if native_cpu and lin.weight.a8_eligible()]
        half = [lin for lin in self.linears() if lin.weight.qtype in HALF_QTYPES]
        if activation_dtype == "auto":
            # NOTE: bfloat16 weights only: bf16x2 decodes a 1.7B bf16 model at about float32's
            # speed and prefills it ~3x faster, but float16 weights decode at ~0.6x (their split
            # into two bfloat16s costs more than the memory stream); BENCHMARKS.md.
            bf16 = [lin for lin in half if lin.weight.qtype == "bf16"]
            # NOTE: K-quant tiles kept for 8-bit activations have no vector float kernels on
            # AVX2: float32 would run them on the scalar twins. gemma3-270m's Q4_K_M file is
            # mostly Q8_0 (which 8-bit activations do not speed up there): 109 ms a token that
            # way, 23 ms with its K-quants loaded as Q8_0 for float32, and int8 decoded 1.24x
            # faster than that (65.4 against 52.7 tok/s on held-out chat; BENCHMARKS.md)
            if eligible and (_int8_pays(eligible) or self.slow_float_kquants()):
                activation_dtype = "int8"
            elif bf16 and native_cpu and amx16_available():
                activation_dtype, half = "bf16x2", bf16
            else:
                activation_dtype = "float32"
        if activation_dtype == "int8" and not eligible:
            raise ConfigError(
                "activation_dtype int8 needs the native CPU kernels and quantized weights "
                f"({'/'.join(A8_QTYPES)}); this model has none (kernels {self.ops.name}, "
                f"device {self.device.type}); use a GGUF file or --quantization q8_0"
            )
        if activation_dtype == "bf16x2":
            if not half or not native_cpu or not amx16_available():
                raise ConfigError(
                    "activation_dtype bf16x2 needs f16/bf16 weights on the native CPU kernels "
                    f"and a CPU with AMX-BF16; this model has {len(half)} such layers (kernels "
                    f"{self.ops.name}, device {self.device.type}, AMX-BF16 "
                    f"{'yes' if amx16_available() else 'no'})"
                )
        for lin in self.linears():
            if activation_dtype == "int8" and lin in eligible:
                lin.weight.enable_a8()
            else:
                lin.weight.disable_a8()
            if activation_dtype == "bf16x2" and lin in half:
                lin.weight.enable_x2()
            else:
                lin.weight.disable_x2()
        self.activation_dtype = activation_dtype
        self._fused = None  # native layers hold the weight tensors they were built with

    # ---- loading -------------------------------------------------------------------------
    def _vec(self, raw: RawTensor) -> torch.Tensor:
        return raw.to_float().to(device=self.device, dtype=self.dtype)

    def _load_layer(self, t: dict[str, RawTensor], i: int, quantization: str) -> LayerWeights:
        p = f"layers.{i}."

        def lin(names: list[str]) -> Linear:
            raws = [t[p + n] for n in names]
            biases = [t.get(p + n + ".bias") for n in names]
            return self._linear(p + "|".join(names), raws, biases, quantization)

        post_attn = "post_attention_layernorm" if self.cfg.is_gemma else "pre_feedforward_layernorm"
        layer = LayerWeights(
            input_norm=self._vec(t[p + "input_layernorm"]),
            qkv=lin(["q_proj", "k_proj", "v_proj"]),
            o_proj=lin(["o_proj"]),
            post_attn_norm=self._vec(t[p + post_attn]),
            gate_up=None,
            down=None,
        )
        cfg = self.cfg
        if p + "router" in t:
            layer.moe = load_moe(
                set(t), p, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, lin
            )
        else:
            layer.gate_up, layer.down = lin(["gate_proj", "up_proj"]), lin(["down_proj"])
        if self.cfg.is_gemma or self.cfg.qk_norm:
            layer.q_norm = self._vec(t[p + "q_norm"])
            layer.k_norm = self._vec(t[p + "k_norm"])
        if self.cfg.is_gemma:
            layer.post_attn_out_norm = layer.post_attn_norm
            layer.post_attn_norm = self._vec(t[p + "pre_feedforward_layernorm"])
            layer.post_ffw_norm = self._vec(t[p + "post_feedforward_layernorm"])
        return layer

    # ---- forward -------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        x = self._embed.dequantize_rows(input_ids)
        if x.dtype != self.dtype or x.device != self.device:  # NOTE: no call when they match
            x = x.to(device=self.device, dtype=self.dtype)
        if self.cfg.is_gemma:
            x = x * torch.tensor(self.cfg.hidden_size**0.5, dtype=self.dtype)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        batch: SeqBatch,
        kv: KVCache,
        num_layers: int | None = None,
    ) -> torch.Tensor:  # [T, H] hidden states after the final norm
        return self.forward_capture(input_ids, positions, batch, kv, (), num_layers)[0]

    def forward_capture(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        batch: SeqBatch,
        kv: KVCache,
        capture: tuple[int, ...] = (),
        num_layers: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final normed states [T, H], and the states named in ``capture`` side by side
        [T, H * len(capture)] (None when it is empty): ``HIDDEN_FINAL`` is the final normed
        state, ``i`` the residual stream entering layer i (layer i - 1's output; vLLM's and
        EAGLE-3's convention for auxiliary hidden states). Under tensor parallelism rank 0
        first sends the inputs to the other ranks, which run the same forward on their shards."""
        if self.tp is not None and self._calibration is None:  # (measure_key_transform: no)
            self.tp.send_forward(input_ids, positions, batch, kv, capture, num_layers)
        end = 0  # one past the batch's last position
        for slot, start, n in zip(batch.slots, batch.start_pos, batch.num_tokens):
            kv.grow(slot, start + n)  # huge pages for long sequences (kv_cache/pool.py)
            end = max(end, start + n)
        x = self.embed(input_ids)
        positions = positions.to(self.device, torch.long)
        layers = self.layers[: num_layers or len(self.layers)]
        taken: dict[int, torch.Tensor] = {}
        if self.use_fused_layers:
            n = len(layers)
            thetas = list(self._rotary)
            if self._rope_index is None:  # per layer, which of thetas' tables it rotates with
                self._rope_index = [
                    thetas.index(self.cfg.layer_rope_theta(i)) for i in range(len(self.layers))
                ]
            want = [i for i in capture if 0 <= i < n]
            # (cos, sin) tables per theta; the native call reads each token's rows from them
            tables = [self._rotary[t].tables(end) for t in thetas]
            x, got = self._forward_fused(
                self._fused_layers()[:n],
                x,
                [cos for cos, _ in tables],
                [sin for _, sin in tables],
                self._rope_index[:n],
                kv.k,
                kv.v,
                batch.slots,
                batch.start_pos,
                batch.num_tokens,
                want,
                self.tp.native_reducer if self.tp is not None else None,
                batch.prefix_slots,
                batch.prefix_lens,
                positions,
            )
            taken.update(zip(want, got))
            if self.cfg.num_experts:  # the experts each MoE layer's rows chose (drafts' pricing)
                for lw, fused in zip(layers, self._fused_layers()):
                    if lw.moe is not None:
                        lw.moe.last_ids = fused.moe_last_ids()
        else:
            for i, layer in enumerate(layers):
                if i in capture:
                    taken[i] = x
                x = self._layer(i, layer, x, positions, batch, kv)
        taken[len(layers)] = x
        final = self.ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        if not capture:
            return final, None
        taken[HIDDEN_FINAL] = final
        return final, torch.cat([taken[i] for i in capture], dim=-1)

    def _forward_fused(self, *args: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``ops.forward_layers``; under tensor parallelism a failed all-reduce inside it is a
        ``TPError`` (an executor fault), not a bare RuntimeError."""
        if self.tp is None:
            return self.ops.forward_layers(*args)
        try:
            return self.ops.forward_layers(*args)
        except RuntimeError as e:
            raise self.tp.error(e) from None

    def _fused_layers(self) -> list:
        if self._fused is None:
            self._fused = [
                self.ops.decoder_layer(self.shard_cfg, i, lw) for i, lw in enumerate(self.layers)
            ]
            self._apply_key_transform()
        return self._fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V] float32
        """Logits of ``hidden``'s rows. Under tensor parallelism rank 0 first sends the rows to
        the workers; each rank computes its vocabulary rows, and the group gathers them
        (``TPGroup.gather_logits``)."""
        if self.vocab_range is None:
            logits = self.lm_head(hidden)
            if logits.dtype != torch.float32:
                logits = logits.float()
        else:
            self.tp.send_logits(hidden)
            part = self.lm_head(hidden).float()  # [R, hi - lo]
            logits = self.tp.gather_logits(part, self.vocab_range, self.vocab_rows)
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _layer(
        self,
        i: int,
        layer: LayerWeights,
        x: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        batch: SeqBatch,
        kv: KVCache,
        attend: Attend | None = None,
    ) -> torch.Tensor:  # [T, H]
        """One decoder layer; ``attend`` replaces its attention (q/k/v from :meth:`qkv` to the
        heads' outputs; worker/static_runner.py's fixed-shape attention)."""
        cfg = self.shard_cfg
        eps = cfg.rms_norm_eps
        h = self.ops.rms_norm(x, layer.input_norm, eps)
        attn = (attend or self._attention)(i, layer, h, positions, batch, kv)
        attn = layer.o_proj(attn)
        if self.tp is not None:
            attn = self.tp.all_reduce(attn)
        if layer.post_attn_out_norm is not None:
            attn = self.ops.rms_norm(attn, layer.post_attn_out_norm, eps)
        x = x + attn
        h = self.ops.rms_norm(x, layer.post_attn_norm, eps)
        if layer.moe is not None:
            return x + layer.moe(h)
        gate, up = layer.gate_up(h).split(cfg.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if cfg.is_gemma else F.silu(gate)
        mlp = layer.down(act * up)
        if self.tp is not None:
            mlp = self.tp.all_reduce(mlp)
        if layer.post_ffw_norm is not None:
            mlp = self.ops.rms_norm(mlp, layer.post_ffw_norm, eps)
        return x + mlp

    def _attention(
        self,
        i: int,
        layer: LayerWeights,
        h: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        batch: SeqBatch,
        kv: KVCache,
    ) -> torch.Tensor:  # [T, num_heads * D] (this rank's heads)
        cfg = self.shard_cfg
        T, D = h.shape[0], cfg.head_dim
        q, k, v = self.qkv(i, layer, h, positions)
        if kv.query_scale is not None:  # an 8-bit cache's key transform (measure_key_transform)
            g = cfg.num_heads // cfg.num_kv_heads
            q = (q.view(T, -1, g, D) * kv.query_scale[i][:, None]).view(T, -1, D)
        out = torch.empty_like(q)
        offset = 0
        window = cfg.layer_window(i)
        for s, (slot, start, n) in enumerate(zip(batch.slots, batch.start_pos, batch.num_tokens)):
            kv.store(i, slot, start, k[offset : offset + n], v[offset : offset + n])
            k_cache, v_cache = kv.layer_slot(i, slot, *batch.prefix(s))  # in the ops' layout
            out[offset : offset + n] = self.ops.attention(
                q[offset : offset + n].contiguous(),
                k_cache,
                v_cache,
                start,
                cfg.attn_scale,
                window,
                cfg.attn_logit_softcapping,
            )
            offset += n
        return out.reshape(T, cfg.num_heads * D)

    def qkv(
        self,
        i: int,
        layer: LayerWeights,
        h: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hkv, D] x 2
        """Layer ``i``'s queries, keys and values of ``h``: normed per head where the model does,
        keys and queries rotated to ``positions``."""
        cfg = self.shard_cfg
        T, D = h.shape[0], cfg.head_dim
        nq, nkv = cfg.num_heads * D, cfg.num_kv_heads * D
        qkv = layer.qkv(h)
        q = qkv[:, :nq].reshape(T, cfg.num_heads, D)
        k = qkv[:, nq : nq + nkv].reshape(T, cfg.num_kv_heads, D)
        v = qkv[:, nq + nkv :].reshape(T, cfg.num_kv_heads, D)
        if layer.q_norm is not None:
            q = self.ops.rms_norm(q.reshape(-1, D), layer.q_norm, cfg.rms_norm_eps).view(T, -1, D)
            k = self.ops.rms_norm(k.reshape(-1, D), layer.k_norm, cfg.rms_norm_eps).view(T, -1, D)
        rotary = self._rotary[cfg.layer_rope_theta(i)]
        qr, kr = rotary(q, positions), rotary(k, positions)
        if self._calibration is not None:  # measure_key_transform: before rotation
            self._calibration.setdefault(i, []).append((q, k))
        return qr, kr, v

    def set_kv_dtype(self, kv_cache_dtype: str) -> None:
        """``"auto"``, ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"int8"``: the element
        type of the KV caches ``make_kv_cache`` makes. ``"auto"``: float16 on the native kernels
        (llama.cpp's default f16 cache: half the memory, and attention reads half the bytes), else
        the model's dtype. Attention converts entries back to the activations' dtype on load; the
        native kernels take float32, float16 and int8 (8-bit entries with a scale per position
        and head: see specdec.kv_cache.pool)."""
        if kv_cache_dtype == "auto":
            dtype = torch.float16 if self.ops.name == "native" else self.dtype
        else:
            dtype = getattr(torch, kv_cache_dtype)
        if self.ops.name == "native" and dtype == torch.bfloat16:
            raise ConfigError(
                f"kv_cache_dtype {kv_cache_dtype}: the native kernels keep the KV cache in "
                "float32, float16 or int8; use --kernels torch for bfloat16"
            )
        if self.ops.name != "native" and dtype == torch.int8:
            raise ConfigError(
                "kv_cache_dtype int8: only the native CPU kernels read an 8-bit KV cache; "
                "use --kernels native, or float16"
            )
        self.kv_dtype = dtype
        self.key_shift = self.key_scale = None
        # NOTE: under tensor parallelism every rank measures its own heads' in lockstep; rank 0
        # starts the workers' (their own load leaves it to this command) as it starts its own
        if dtype == torch.int8 and not self.cfg.attn_logit_softcapping:
            if self.tp is None or self.tp.rank == 0:
                if self.tp is not None:
                    self.tp.send_key_transform()
                self.key_shift, self.key_scale = self.measure_key_transform()
        self._apply_key_transform()

    def set_key_transform(self, shift: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        """The 8-bit cache's key transform (``measure_key_transform``'s pair, or None twice): the
        native layers' writes from now on and the caches ``make_kv_cache`` makes."""
        self.key_shift, self.key_scale = shift, scale
        self._apply_key_transform()

    # measure_key_transform: seeded random tokens read (the first position left out: it is often
    # an outlier); positions the keys' mean is rotated to, and the queries and keys for their ranges
    KEY_TRANSFORM_TOKENS = 128
    KEY_TRANSFORM_MEAN_POSITIONS = 1024
    KEY_TRANSFORM_RANGE_POSITIONS = 32

    def measure_key_transform(self) -> tuple[torch.Tensor, torch.Tensor]:
        """How an 8-bit cache holds each layer's keys (kv_cache/pool.py): as (key - shift) *
        scale, with queries multiplied by 1 / scale; both [layers, Hkv, D] float32. Any such pair
        gives the same attention in exact arithmetic (each query's scores move by one constant,
        which the softmax cancels; q . k is the same product channel by channel), so this only
        chooses where the rounding falls. Measured once, deterministically, on
        ``KEY_TRANSFORM_TOKENS`` seeded random tokens:

        - shift: the mean key before rotation, rotated to ``KEY_TRANSFORM_MEAN_POSITIONS``
          positions spread over the model's ``max_len`` and averaged. Slow rotary channels keep
          the offset they carry at every position, which would otherwise set each key's 8-bit
          scale; faster ones average out.
        - scale: per channel, the square root of the largest query magnitude over the largest
          shifted-key magnitude (over the kv head's queries, each token rotated to
          ``KEY_TRANSFORM_RANGE_POSITIONS`` positions spread over ``max_len``): the two 8-bit
          operands of each channel's products get even ranges (SmoothQuant's balance), so a
          channel where queries are large and keys small (or the reverse) no longer costs the
          other channels their levels. NOTE: measured at the tokens' own first positions only,
          the ranges of channels that rotate within the context were wrong further on: from
          3,000 positions the 8-bit cache's KL was 1.7-1.9x that without the transform (SmolLM2,
          float32 activations); over every position it is 0.85x there, and 0.75-0.86x before.

        Not for logit soft-capping (the constant would not cancel). Under tensor parallelism each
        rank measures its own heads, every rank running this in lockstep (its forward sends no
        inputs: each rank has the same seeded tokens)."""
        n = min(self.KEY_TRANSFORM_TOKENS, self.max_len)
        cfg = self.shard_cfg
        kv_heads, d, layers = cfg.num_kv_heads, cfg.head_dim, len(self.layers)
        if n < 2:
            return torch.zeros(layers, kv_heads, d), torch.ones(layers, kv_heads, d)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.cfg.vocab_size, (n,), generator=gen)
        kv = KVCache(
            layers, 1, kv_heads, n, d, torch.float32, self.device, key_block=self.ops.key_block
        )
        fused, self.use_fused_layers = self.use_fused_layers, False
        try:
            with torch.inference_mode():
                self._calibration = {}
                self.forward(ids[:1], torch.arange(1), SeqBatch([0], [0], [1]), kv)
                self._calibration = {}  # the first position is not counted
                self.forward(ids[1:], torch.arange(1, n), SeqBatch([0], [1], [n - 1]), kv)
                records = self._calibration
        finally:
            self._calibration, self.use_fused_layers = None, fused
        # positions spread over every one a sequence may reach (no two a period apart)
        golden = (5**0.5 - 1) / 2

        def spread(count: int) -> torch.Tensor:
            count = min(count, self.max_len)
            return torch.tensor([int(self.max_len * ((i * golden) % 1.0)) for i in range(count)])

        mean_pos, stat_pos = (
            spread(self.KEY_TRANSFORM_MEAN_POSITIONS),
            spread(self.KEY_TRANSFORM_RANGE_POSITIONS),
        )
        group = cfg.num_heads // kv_heads
        shifts, scales = [], []
        with torch.inference_mode():
            for i in range(layers):
                ((q, k),) = records[i]  # [n - 1, H, D], [n - 1, Hkv, D] before rotation
                turn = self._rotary[self.cfg.layer_rope_theta(i)].rotate_each
                shift = turn(k.float().mean(0), mean_pos).mean(0)  # [Hkv, D]
                # (max over the flattened rows first: a reduction over two dims of a view ran ~4x slower)
                qmax = (
                    turn(q, stat_pos).abs().flatten(0, 1).amax(0).view(kv_heads, group, d).amax(1)
                )
                kmax = (turn(k, stat_pos) - shift).abs().flatten(0, 1).amax(0)
                ratio = (qmax.clamp_min(1e-6) / kmax.clamp_min(1e-6)).sqrt()
                shifts.append(shift)
                scales.append(ratio.clamp(2.0**-16, 2.0**16))
        return torch.stack(shifts), torch.stack(scales)

    def _apply_key_transform(self) -> None:
        """Hand ``key_shift`` / ``key_scale`` to the native layers (their writes from now on; the
        caches ``make_kv_cache`` makes carry the same)."""
        if self._fused is None:
            return
        for i, layer in enumerate(self._fused):
            if self.key_shift is None:
                layer.set_key_transform(None, None)
            else:
                layer.set_key_transform(self.key_shift[i], self.key_scale[i])

    def make_kv_cache(self, num_slots: int, max_len: int, num_layers: int | None = None) -> KVCache:
        n = num_layers or self.cfg.num_layers
        q8 = self.kv_dtype == torch.int8 and self.key_shift is not None
        return KVCache(
            n,
            num_slots,
            self.shard_cfg.num_kv_heads,
            max_len,
            self.cfg.head_dim,
            self.kv_dtype,
            self.device,
            key_block=self.ops.key_block,
            share_block=self.ops.attn_block if self.use_fused_layers else 0,
            key_shift=self.key_shift[:n] if q8 else None,
            key_scale=self.key_scale[:n] if q8 else None,
        )


def _int8_pays(eligible: list[Linear]) -> bool:
    """Whether most of the eligible layers' bytes are in formats the 8-bit kernels speed up."""
    total = sum(lin.weight.nbytes for lin in eligible)
    paying = sum(lin.weight.nbytes for lin in eligible if int8_activations_pay(lin.weight.qtype))
    return 2 * paying >= total
