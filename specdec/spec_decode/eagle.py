"""EAGLE-1/2 (Li et al., 2024): fc over [token embedding; the target's final normed state], then
the head's decoder layers (the first without an input norm), read by the target's own LM head.

Loads SafeAILab's releases (``config.json`` + ``pytorch_model.bin`` or ``model.safetensors``;
keys ``fc.weight`` / ``fc.bias``, ``layers.{i}.*``) and the same keys under vLLM's ``model.``
prefix. The head's ``embed_tokens`` copy of the target's, when present, is only checked.
"""

from __future__ import annotations

import torch

from specdec.config import ConfigError
from specdec.model.llama import HIDDEN_FINAL, LlamaModel, SeqBatch
from specdec.spec_decode.base import Proposer
from specdec.spec_decode.hidden_head import (
    HeadLinear,
    HiddenStateProposer,
    check_shape,
    read_eagle_weights,
    read_head,
)


class EagleProposer(HiddenStateProposer):
    hidden_layers = (HIDDEN_FINAL,)

    def __init__(
        self, target: LlamaModel, path: str, max_num_seqs: int, max_len: int, sample_method: str
    ) -> None:
        folder, cfg = read_head(path, "eagle")
        w = read_eagle_weights(folder)
        H = target.cfg.hidden_size
        check_hidden_size(cfg, target, "eagle")
        if "fc.weight" not in w:
            raise ConfigError(
                f"speculative_config.model: {folder} has no fc.weight (not an EAGLE head)"
            )
        check_shape("fc.weight", w["fc.weight"], (H, 2 * H), "[hidden, 2 * hidden]")
        if "embed_tokens.weight" in w:
            check_shape("embed_tokens.weight", w["embed_tokens.weight"],
                        (target.cfg.vocab_size, H), "the target's vocabulary x hidden")  # fmt: skip
        num_layers = 1 + max(int(k.split(".")[1]) for k in w if k.startswith("layers."))
        super().__init__(target, cfg, max_num_seqs, max_len, sample_method, num_layers)
        self.fc = HeadLinear(w["fc.weight"], w.get("fc.bias"), target)
        self.layers = [self.build_layer(w, f"layers.{i}.") for i in range(num_layers)]
        self.layers[0].input_norm = None  # NOTE: EAGLE's first layer reads fc's output as it is

    def _step(
        self,
        token_ids: torch.Tensor,  # [T]
        feats: torch.Tensor,  # [T, H]
        from_target: bool,
        positions: torch.Tensor,  # [T]
        batch: SeqBatch,
    ) -> torch.Tensor:  # [T, H]
        x = self.fc(torch.cat([self._embed(token_ids), feats], dim=-1))
        for i, lw in enumerate(self.layers):
            attn_in = x if lw.input_norm is None else self._norm(x, lw.input_norm)
            x = self._layer(i, lw, x, attn_in, positions, batch)
        return x

    def _logits(self, out: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V]
        return self.target.compute_logits(out.to(self.target.dtype))


def check_hidden_size(cfg: dict, target: LlamaModel, method: str) -> None:
    size = cfg.get("hidden_size")
    if size is not None and int(size) != target.cfg.hidden_size:
        raise ConfigError(
            f"speculative_config.model: the {method} head's hidden_size is {size}, the "
            f"target's is {target.cfg.hidden_size}; the head was made for another model"
        )


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    return EagleProposer(target, cfg.model, max_num_seqs, max_len, cfg.draft_sample_method)
