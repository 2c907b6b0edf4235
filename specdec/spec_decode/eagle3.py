"""EAGLE-3 (Li et al., 2025): the target's low, middle and high states fused by ``fc``, one
decoder layer whose attention reads [normed embedding; normed feature], and a head of its own
over a reduced draft vocabulary (``d2t[i]``: draft id i is target id ``i + d2t[i]``).

Loads SafeAILab's releases (``config.json`` with ``draft_vocab_size``; keys ``fc.weight``,
``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``) and vLLM's ``speculators``
format (``speculators_model_type: eagle3``, ``transformer_layer_config``, keys ``layers.0.*``,
``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``).
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.config import ConfigError
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.model.registry import default_head
from specdec.spec_decode.base import DraftRequest, Proposer
from specdec.spec_decode.eagle import check_hidden_size
from specdec.spec_decode.hidden_head import (
    HEAD_QTYPES,
    HeadLinear,
    HiddenStateProposer,
    check_shape,
    read_eagle_weights,
    read_head,
)

# The head's weights at run time (where the 8-bit activation kernels run): Q4_0 reads half the
# bytes of Q8_0 per draft (measured 2026-11-24; `git show 5196d6d:BENCHMARKS.md`).
DEFAULT_QTYPE = "q4_0"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: the states entering layers 2, L // 2 and L - 3."""
    return (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))


def layer_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the decoder layer's config, the head's own keys) for either layout."""
    if cfg.get("speculators_model_type") is not None:
        if cfg["speculators_model_type"] != "eagle3":
            raise ConfigError(
                "speculative_config.model: a speculators head of type "
                f"{cfg['speculators_model_type']!r}, method 'eagle3' needs type 'eagle3'"
            )
        return dict(cfg.get("transformer_layer_config") or {}), cfg
    return cfg, cfg


class Eagle3Proposer(HiddenStateProposer):
    def __init__(
        self,
        target: LlamaModel,
        path: str,
        max_num_seqs: int,
        max_len: int,
        sample_method: str,
        qtype: str = DEFAULT_QTYPE,
    ) -> None:
        folder, raw = read_head(path, "eagle3")
        layer_cfg, own = layer_config(raw)
        speculators = raw.get("speculators_model_type") is not None
        check_hidden_size(layer_cfg, target, "eagle3")
        w = read_eagle_weights(folder)
        w = {k.replace("midlayer.", "layers.0.", 1): v for k, v in w.items()}
        tcfg = target.cfg
        H, V = tcfg.hidden_size, tcfg.vocab_size
        ids = own.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(tcfg.num_layers)
        self.hidden_layers = tuple(int(i) for i in ids)
        if not all(0 <= i < tcfg.num_layers for i in self.hidden_layers):
            raise ConfigError(
                f"speculative_config.model: eagle_aux_hidden_state_layer_ids {list(ids)} are not "
                f"all layers of the target (it has {tcfg.num_layers})"
            )
        for key in ("fc.weight", "norm.weight", "lm_head.weight"):
            if key not in w:
                raise ConfigError(
                    f"speculative_config.model: {folder} has no {key} (not an EAGLE-3 head)"
                )
        check_shape("fc.weight", w["fc.weight"], (H, len(ids) * H),
                    f"[hidden, {len(ids)} x the target's hidden]")  # fmt: skip
        draft_vocab = w["lm_head.weight"].shape[0]
        if "d2t" in w:
            check_shape("d2t", w["d2t"], (draft_vocab,), "one offset per draft token")
        elif draft_vocab != V:
            raise ConfigError(
                f"speculative_config.model: the head's vocabulary is {draft_vocab} tokens with no "
                f"d2t map, the target's is {V}"
            )
        if "t2d" in w:
            check_shape("t2d", w["t2d"], (V,), "the target's vocabulary")
        super().__init__(target, layer_cfg, max_num_seqs, max_len, sample_method)
        dev = self.device

        def f32(name: str) -> torch.Tensor | None:  # the tensors kept as they are
            t = w.get(name)
            return None if t is None else t.to(device=dev, dtype=torch.float32)

        self.fc = HeadLinear(w["fc.weight"], None, target, qtype)
        self.lm_head = HeadLinear(w["lm_head.weight"], None, target, qtype)
        self.norm = f32("norm.weight")
        self.layer = self.build_layer(w, "layers.0.", qtype)
        self.qtype = qtype
        if self.layer.input_norm is None or "layers.0.hidden_norm.weight" not in w:
            raise ConfigError(
                "speculative_config.model: the EAGLE-3 layer needs input_layernorm and hidden_norm"
            )
        check_shape("q_proj", w["layers.0.self_attn.q_proj.weight"],
                    (self.layer.q.out_features, 2 * H), "reads [embedding; hidden]")  # fmt: skip
        self.hidden_norm = f32("layers.0.hidden_norm.weight")
        self.embed = f32("embed_tokens.weight")
        if self.embed is not None:
            check_shape(
                "embed_tokens.weight", self.embed, (V, H), "the target's vocabulary x hidden"
            )
        # NOTE: vLLM reads speculators heads with norm_before_residual true unless it says not
        default = speculators
        self.norm_before_residual = bool(own.get("norm_before_residual", default))
        self.target_ids = None
        self._full: torch.Tensor | None = None  # [rows, V] -inf outside the draft vocabulary
        if "d2t" in w:
            self.target_ids = torch.arange(draft_vocab, device=dev) + w["d2t"].to(dev, torch.long)
            if int(self.target_ids.min()) < 0 or int(self.target_ids.max()) >= V:
                raise ConfigError(
                    "speculative_config.model: d2t maps draft tokens outside the target's vocabulary"
                )
        self.native = self._native_head(w, layer_cfg)

    def _native_head(self, w: dict[str, torch.Tensor], layer_cfg: dict[str, Any]) -> Any:
        """The head as ``_C.Eagle3Head`` (one call per step, one per greedy chain) where the
        native kernels run and the head has a draft vocabulary (whose embeddings it keeps as
        float32); None: the Python layer."""
        C = getattr(self.ops, "_C", None)
        if C is None or not hasattr(C, "Eagle3Head") or self.target_ids is None:
            return None
        H, lw = self.hidden_size, self.layer
        if any(x.bias is not None for x in (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down)):
            return None

        def fused(*names: str) -> tuple[torch.Tensor, int]:
            rows = [w[f"layers.0.{n}.weight"] for n in names]
            return HeadLinear(torch.cat(rows), None, self.target, self.qtype).native()

        qkv, qt_qkv = fused("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        gate_up, qt_gate_up = fused("mlp.gate_proj", "mlp.up_proj")
        (fc, qt_fc), (o, qt_o) = self.fc.native(), lw.o.native()
        (down, qt_down), (lm, qt_lm) = lw.down.native(), self.lm_head.native()
        return C.Eagle3Head(
            hidden=H, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, intermediate=lw.gate.out_features, eps=self.eps,
            norm_before_residual=self.norm_before_residual, fc_w=fc, fc_qt=qt_fc,
            fc_k=self.fc.in_features, qkv_w=qkv, qkv_qt=qt_qkv, o_w=o, o_qt=qt_o,
            gate_up_w=gate_up, gate_up_qt=qt_gate_up, down_w=down, down_qt=qt_down, lm_w=lm,
            lm_qt=qt_lm, draft_vocab=self.lm_head.out_features, input_norm=lw.input_norm,
            hidden_norm=self.hidden_norm, post_norm=lw.post_norm, norm=self.norm,
            draft_embed=self._embed(self.target_ids).contiguous(), target_ids=self.target_ids,
            cos=self.rotary.cos, sin=self.rotary.sin,
        )  # fmt: skip

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return self.embed[token_ids]
        return super()._embed(token_ids)

    def _step(
        self,
        token_ids: torch.Tensor,  # [T]
        feats: torch.Tensor,  # [T, 3 H] the target's states, or [T, H] the head's outputs
        from_target: bool,
        positions: torch.Tensor,  # [T]
        batch: SeqBatch,
    ) -> torch.Tensor:  # [T, H] before the final norm
        if self.native is not None:
            return self.native.step(
                self._embed(token_ids), feats.contiguous(), from_target, positions.tolist(),
                self.kv.k[0], self.kv.v[0], batch.slots, batch.start_pos, batch.num_tokens,
            )  # fmt: skip
        if from_target:
            feats = self.fc(feats)
        hidden = self._norm(feats, self.hidden_norm)
        emb = self._norm(self._embed(token_ids), self.layer.input_norm)
        residual = hidden if self.norm_before_residual else feats
        return self._layer(
            0, self.layer, residual, torch.cat([emb, hidden], dim=-1), positions, batch
        )

    def _greedy_chain(
        self, live: list[DraftRequest], feats: torch.Tensor, drafts: dict[str, list[int]]
    ) -> bool:
        k = live[0].max_num_drafts
        if self.native is None or any(
            r.max_num_drafts != k or not (r.sampling.is_greedy or self.sample_method == "greedy")
            for r in live
        ):
            return False
        pos = [len(r.token_ids) - 1 for r in live]  # draft 1 (token n) sits at position n - 1
        out = self.native.greedy_chain(
            feats, k, pos, self.kv.k[0], self.kv.v[0], [self.states[r.req_id].slot for r in live],
            [p - self.states[r.req_id].base for p, r in zip(pos, live)],
        )  # fmt: skip
        for r, row in zip(live, out.tolist()):
            drafts[r.req_id].extend(row)
        return True

    def _logits(self, out: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V]
        if self.native is not None:
            z = self.native.logits(out)
        else:
            z = self.lm_head(self._norm(out, self.norm))
        if self.target_ids is None:
            return z
        R = z.shape[0]
        if self._full is None or self._full.shape[0] < R:
            # NOTE: kept: a fresh [R, V] tensor each call costs more than the head's layer
            # (page faults). Entries outside the draft vocabulary stay -inf for good.
            V = self.target.cfg.vocab_size
            self._full = torch.full((max(R, 8), V), float("-inf"), device=z.device)
        full = self._full[:R]
        full.index_copy_(1, self.target_ids, z)  # NOTE: ~10x faster than full[:, ids] = z
        return full


def head_path(cfg, target: LlamaModel) -> str:
    """``speculative_config.model``, or the head shipped for the target (smollm2-135m)."""
    if cfg.model:
        return cfg.model
    shipped = default_head("eagle3", target.source_path)
    if shipped is None:
        raise ConfigError(
            "speculative_config.model: method 'eagle3' needs a head folder for this model "
            "(a head ships only for smollm2-135m; `specdec train eagle3` makes one)"
        )
    return str(shipped)


def head_qtype(cfg) -> str:
    """The head's weight format: ``speculative_config.draft_quantization`` or the default."""
    qtype = cfg.draft_quantization or DEFAULT_QTYPE
    if qtype not in HEAD_QTYPES:
        raise ConfigError(
            f"speculative_config.draft_quantization: {qtype!r} for an EAGLE-3 head, expected "
            f"one of {', '.join(HEAD_QTYPES)}"
        )
    return qtype


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    return Eagle3Proposer(
        target, head_path(cfg, target), max_num_seqs, max_len, cfg.draft_sample_method,
        head_qtype(cfg),
    )  # fmt: skip
