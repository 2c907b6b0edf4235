"""Multi-token prediction: the MTP layers a target checkpoint ships, drafting with the target's
own extra layer (DeepSeek-V3, Liu et al., 2024; MiMo, Xiaomi, 2025).

At position t the layer reads the embedding of token t + 1 and the target's final normed state
at t, projects the two normed halves to the hidden size, runs one decoder layer and a final norm,
and predicts token t + 2. Chained drafts feed the layer's normed output back (as vLLM does).

Layouts, in the target's Hugging Face folder (config ``num_nextn_predict_layers``):
* DeepSeek-V3: ``model.layers.{N + i}.`` with ``enorm``, ``hnorm``, ``eh_proj`` over
  [embedding; state], ``shared_head.norm`` / ``shared_head.head`` and the layer's own keys;
* MiMo: ``model.mtp_layers.{i}.`` with ``token_layernorm``, ``hidden_layernorm``,
  ``input_proj`` over [state; embedding], ``final_layernorm``, the target's LM head.
Only the first MTP layer drafts (reused for every draft).
NOTE: llama.cpp defines GGUF ``nextn`` tensors only for architectures we do not run, so a GGUF
target has no MTP layers here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.config import ConfigError
from specdec.model.llama import HIDDEN_FINAL, LlamaModel, SeqBatch
from specdec.spec_decode.base import Proposer
from specdec.spec_decode.hidden_head import (
    HeadLinear,
    HiddenStateProposer,
    check_shape,
)


def read_mtp_tensors(folder: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors under any of ``prefixes`` in the folder's safetensors files."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefixes):
                    out[key] = f.get_tensor(key)
    return out


class MtpProposer(HiddenStateProposer):
    hidden_layers = (HIDDEN_FINAL,)

    def __init__(
        self,
        target: LlamaModel,
        path: str | None,
        max_num_seqs: int,
        max_len: int,
        sample_method: str,
    ) -> None:
        folder = Path(path or target.source_path)
        config_path = folder / "config.json"
        if not folder.is_dir() or not config_path.is_file():
            raise ConfigError(
                f"speculative_config.method 'mtp' drafts with the MTP layers of the target's "
                f"Hugging Face folder; {folder} is not one (GGUF files carry none for this architecture)"
            )
        cfg = json.loads(config_path.read_text())
        num_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        tcfg = target.cfg
        H, V = tcfg.hidden_size, tcfg.vocab_size
        n = int(cfg.get("num_hidden_layers", tcfg.num_layers))
        deep, mimo = f"model.layers.{n}.", "model.mtp_layers.0."
        w = read_mtp_tensors(folder, (deep, mimo)) if num_mtp else {}
        if any(k.startswith(mimo) for k in w):
            p = mimo
            names = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
            self.hidden_first = True
        elif any(k.startswith(deep) for k in w):
            p = deep
            names = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
            self.hidden_first = False
        else:
            raise ConfigError(
                f"speculative_config.method 'mtp': {folder} has no MTP layers "
                "(config num_nextn_predict_layers and model.layers.{N}.eh_proj or "
                "model.mtp_layers.0.input_proj)"
            )
        for name in names:
            if p + name + ".weight" not in w:
                raise ConfigError(
                    f"speculative_config.method 'mtp': {folder} has no {p}{name}.weight"
                )
        if int(cfg.get("hidden_size", H)) != H:
            raise ConfigError(
                f"mtp: the checkpoint's hidden_size {cfg['hidden_size']} is not the target's {H}"
            )
        super().__init__(target, cfg, max_num_seqs, max_len, sample_method)
        dev = self.device

        def f32(name: str) -> torch.Tensor:
            return w[p + name + ".weight"].to(device=dev, dtype=torch.float32)

        self.token_norm, self.hidden_norm, self.final_norm = (f32(x) for x in names[:2] + names[3:])
        check_shape(p + names[2], w[p + names[2] + ".weight"], (H, 2 * H), "[hidden, 2 * hidden]")
        self.proj = HeadLinear(w[p + names[2] + ".weight"], None, target)
        self.layer = self.build_layer(w, p)
        self.head = None
        if p + "shared_head.head.weight" in w:
            head = w[p + "shared_head.head.weight"]
            check_shape(p + "shared_head.head", head, (V, H), "the target's vocabulary")
            self.head = HeadLinear(head, None, target)

    def _step(
        self,
        token_ids: torch.Tensor,  # [T]
        feats: torch.Tensor,  # [T, H] normed states (the target's, or the layer's own)
        from_target: bool,
        positions: torch.Tensor,  # [T]
        batch: SeqBatch,
    ) -> torch.Tensor:  # [T, H] after the final norm
        emb = self._embed(token_ids)
        emb = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(emb), emb)
        emb = self._norm(emb, self.token_norm)
        hidden = self._norm(feats, self.hidden_norm)
        pair = [hidden, emb] if self.hidden_first else [emb, hidden]
        x = self.proj(torch.cat(pair, dim=-1))
        x = self._layer(0, self.layer, x, self._norm(x, self.layer.input_norm), positions, batch)
        return self._norm(x, self.final_norm)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V]
        if self.head is not None:
            return self.head(out)
        return self.target.compute_logits(out.to(self.target.dtype))


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    return MtpProposer(target, cfg.model, max_num_seqs, max_len, cfg.draft_sample_method)
