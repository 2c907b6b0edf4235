"""Drafters. A drafter is one module of this package with a ``make(cfg, target, load_draft,
max_num_seqs, max_len) -> Proposer`` function, plus one entry in the method table
(``specdec/methods.py``, re-exported here). Modules are imported when a method is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from specdec.methods import METHODS, Method, canonical_method
from specdec.spec_decode.base import DraftInput, DraftOutput, DraftRequest, Proposer

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig
    from specdec.model.llama import LlamaModel


def make_proposer(
    cfg: SpeculativeConfig,
    target: LlamaModel,
    load_draft: Callable[[SpeculativeConfig], LlamaModel],
    max_num_seqs: int,
    max_len: int,
) -> Proposer:
    module = importlib.import_module(f"specdec.spec_decode.{METHODS[cfg.method].module}")
    return module.make(cfg, target, load_draft, max_num_seqs, max_len)


__all__ = [
    "METHODS",
    "DraftInput",
    "DraftOutput",
    "DraftRequest",
    "Method",
    "Proposer",
    "canonical_method",
    "make_proposer",
]
