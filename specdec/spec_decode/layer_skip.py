"""Self-speculation: the target's own first layers (then its final norm and head) draft, with a
KV cache of their own; no extra weights."""

from __future__ import annotations

from specdec.spec_decode.base import Proposer
from specdec.spec_decode.draft_model import DraftModelProposer


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    # NOTE: on SmolLM2-135M (not trained for early exit) acceptance collapses below the last few
    # layers: 8 layers accept 4% of first drafts, 24 layers 40%, 28 layers 57% (BENCHMARKS.md).
    layers = cfg.num_draft_layers or max(1, target.cfg.num_layers - 2)
    layers = min(layers, target.cfg.num_layers)
    return DraftModelProposer(
        target, max_num_seqs, max_len, num_layers=layers, sample_method=cfg.draft_sample_method
    )
