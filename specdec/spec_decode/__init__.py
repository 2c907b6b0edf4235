"""Drafters, by method name. The runner looks the method up here and never branches on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from specdec.spec_decode.base import DraftInput, DraftOutput, DraftRequest, Proposer
from specdec.spec_decode.draft_model import DraftModelProposer
from specdec.spec_decode.ngram import NgramProposer
from specdec.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig
    from specdec.model.llama import LlamaModel


def _ngram(
    cfg: SpeculativeConfig, target: LlamaModel, load_draft, max_num_seqs: int, max_len: int
) -> Proposer:
    return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)


def _draft_model(
    cfg: SpeculativeConfig, target: LlamaModel, load_draft, max_num_seqs: int, max_len: int
) -> Proposer:
    return DraftModelProposer(
        load_draft(cfg), max_num_seqs, max_len, sample_method=cfg.draft_sample_method
    )


def _layer_skip(
    cfg: SpeculativeConfig, target: LlamaModel, load_draft, max_num_seqs: int, max_len: int
) -> Proposer:
    # NOTE: on SmolLM2-135M (not trained for early exit) acceptance collapses below the last few
    # layers: 8 layers accept 4% of first drafts, 24 layers 40%, 28 layers 57% (BENCHMARKS.md).
    layers = cfg.num_draft_layers or max(1, target.cfg.num_layers - 2)
    layers = min(layers, target.cfg.num_layers)
    return DraftModelProposer(
        target, max_num_seqs, max_len, num_layers=layers, sample_method=cfg.draft_sample_method
    )


def _suffix(
    cfg: SpeculativeConfig, target: LlamaModel, load_draft, max_num_seqs: int, max_len: int
) -> Proposer:
    return SuffixProposer(
        cfg.num_speculative_tokens,
        max_tree_depth=cfg.suffix_decoding_max_tree_depth,
        max_cached_requests=cfg.suffix_decoding_max_cached_requests,
        max_spec_factor=cfg.suffix_decoding_max_spec_factor,
        min_token_prob=cfg.suffix_decoding_min_token_prob,
    )


PROPOSERS: dict[str, Callable[..., Proposer]] = {
    "ngram": _ngram,
    "draft_model": _draft_model,
    "layer_skip": _layer_skip,
    "suffix": _suffix,
}

__all__ = ["PROPOSERS", "DraftInput", "DraftOutput", "DraftRequest", "Proposer"]
