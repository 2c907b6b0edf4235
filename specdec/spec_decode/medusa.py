"""Medusa (Cai et al., 2024): K heads on the target's last final normed state; head i (a stack
of residual blocks ``x + SiLU(W x + b)`` then its own vocabulary projection) predicts the token
i + 2 positions past that state. No KV cache: all drafts come from one state at once.

Loads FasterDecoding's ``medusa_lm_head.safetensors`` / ``.pt`` (keys ``medusa_head.{i}.{j}.linear
.weight|bias``, ``medusa_head.{i}.{L}.weight``, with or without the prefix) and vLLM's layout
(``blocks.{i}.layers.{j}.weight|bias``, ``lm_heads.{i}.weight``).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from specdec.config import ConfigError
from specdec.model.llama import HIDDEN_FINAL, LlamaModel
from specdec.spec_decode.base import DraftInput, DraftOutput, DraftRequest, Proposer
from specdec.spec_decode.draft_model import draw_draft
from specdec.spec_decode.eagle import check_hidden_size
from specdec.spec_decode.hidden_head import (
    HeadLinear,
    check_shape,
    read_head,
    read_weights,
    strip_prefix,
)

WEIGHT_FILES = (
    "medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin",
)  # fmt: skip


def _heads(w: dict[str, torch.Tensor]) -> list[tuple[list[tuple], torch.Tensor]]:
    """[(residual blocks [(W, b)], vocabulary projection)] per head, in either layout."""
    w = strip_prefix(w, ("medusa_head.", "medusa_heads.", "model."))
    vllm = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
    fast = re.compile(r"(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
    blocks: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[int, torch.Tensor] = {}
    for name, t in w.items():
        if m := re.fullmatch(r"lm_heads\.(\d+)\.weight", name):
            out[int(m[1])] = t
        elif m := vllm.fullmatch(name):
            blocks.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = t
        elif m := fast.fullmatch(name):
            blocks.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = t
    if out:  # vLLM: blocks and lm_heads apart
        num = len(out)
        return [([(b["weight"], b.get("bias")) for _, b in sorted(blocks.get(i, {}).items())],
                 out[i]) for i in range(num)]  # fmt: skip
    # FasterDecoding: the last module of each head is the projection (a weight, no bias)
    heads = []
    for i in range(len(blocks)):
        mods = blocks[i]
        last = max(mods)
        if "bias" in mods[last] or "weight" not in mods[last]:
            raise ConfigError(
                f"speculative_config.model: Medusa head {i} has no vocabulary projection"
            )
        heads.append(
            ([(mods[j]["weight"], mods[j].get("bias")) for j in range(last)], mods[last]["weight"])
        )
    return heads


class MedusaProposer(Proposer):
    hidden_layers = (HIDDEN_FINAL,)

    def __init__(self, target: LlamaModel, path: str, sample_method: str) -> None:
        folder, cfg = read_head(path, "medusa")
        check_hidden_size(cfg, target, "medusa")
        heads = _heads(read_weights(folder, WEIGHT_FILES))
        if not heads:
            raise ConfigError(f"speculative_config.model: no Medusa heads in {folder}")
        H, V = target.cfg.hidden_size, target.cfg.vocab_size
        self.heads = []
        for i, (blocks, proj) in enumerate(heads):
            check_shape(f"head {i} projection", proj, (V, H), "the target's vocabulary x hidden")
            for j, (wt, _) in enumerate(blocks):
                check_shape(f"head {i} block {j}", wt, (H, H), "hidden x hidden")
            self.heads.append(
                ([HeadLinear(wt, b, target) for wt, b in blocks], HeadLinear(proj, None, target))
            )
        self.target = target
        self.sample_method = sample_method
        self._last: dict[str, tuple[int, torch.Tensor]] = {}  # req -> (position, state [H])

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        self._last.pop(req_id, None)

    def _state(self, r: DraftRequest) -> torch.Tensor | None:
        """The target's state at the position before the last token (None: not computed)."""
        if r.hidden_states is not None and r.hidden_states.shape[0]:
            end = r.hidden_start + r.hidden_states.shape[0] - 1
            self._last[r.req_id] = (end, r.hidden_states[-1])
        last = self._last.get(r.req_id)
        return last[1] if last is not None and last[0] == len(r.token_ids) - 2 else None

    def propose(self, inp: DraftInput) -> DraftOutput:
        ids: list[list[int]] = [[] for _ in inp.requests]
        probs: list[list[torch.Tensor]] = [[] for _ in inp.requests]
        rows, live = [], []
        for i, r in enumerate(inp.requests):
            state = self._state(r) if r.max_num_drafts > 0 else None
            if state is not None:
                rows.append(state)
                live.append(i)
        if live:
            x0 = torch.stack(rows).to(torch.float32)  # [R, H]
            for h, (blocks, proj) in enumerate(
                self.heads[: max(inp.requests[i].max_num_drafts for i in live)]
            ):
                x = x0
                for block in blocks:
                    x = x + F.silu(block(x))
                logits = proj(x)  # [R, V]
                for row, i in enumerate(live):
                    r = inp.requests[i]
                    if h < r.max_num_drafts:
                        tok, q = draw_draft(
                            logits[row : row + 1],
                            r,
                            r.next_position + h,
                            ids[i],
                            self.sample_method,
                        )
                        ids[i].append(tok)
                        if q is not None:
                            probs[i].append(q)
        return DraftOutput(ids, [torch.cat(p) if p else None for p in probs])


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    return MedusaProposer(target, cfg.model, cfg.draft_sample_method)
