"""specdec: speculative decoding inference engine."""

from __future__ import annotations

import os
import sys
import warnings
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.beam_search import BeamSearchOutput, BeamSearchSequence
    from specdec.config import EngineConfig, SpeculativeConfig
    from specdec.inputs import TextPrompt, TokensPrompt
    from specdec.llm import LLM
    from specdec.outputs import CompletionOutput, RequestOutput
    from specdec.sampling_params import BeamSearchParams, SamplingParams
    from specdec.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"

# NOTE: OpenMP's default spin-waiting makes every parallel region cost milliseconds as soon as the
# cores are shared (measured here: a 64-token forward 1473 ms spinning vs 185 ms passive; decode
# 33 ms vs 14 ms per step under load). Takes effect when specdec is imported before torch: torch's
# OpenMP runtime reads it once, when torch loads. After `import torch` first, 256 greedy tokens
# ran at 38-41 tok/s instead of 100-165 (2026-11-22), so say so.
if "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    warnings.warn(
        "specdec: torch was imported before specdec, so its OpenMP threads spin-wait and can make "
        "generation several times slower on a few cores; import specdec first, or set "
        "OMP_WAIT_POLICY=PASSIVE in the environment",
        RuntimeWarning,
        stacklevel=2,
    )
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_WHERE = {
    "LLM": "specdec.llm",
    "SamplingParams": "specdec.sampling_params",
    "BeamSearchParams": "specdec.sampling_params",
    "BeamSearchOutput": "specdec.beam_search",
    "BeamSearchSequence": "specdec.beam_search",
    "SpeculativeConfig": "specdec.config",
    "EngineConfig": "specdec.config",
    "RequestOutput": "specdec.outputs",
    "CompletionOutput": "specdec.outputs",
    "StructuredOutputsParams": "specdec.structured.params",
    "GuidedDecodingParams": "specdec.structured.params",
    "TextPrompt": "specdec.inputs",
    "TokensPrompt": "specdec.inputs",
}


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so `import specdec.sampling_params` does not load torch models and kernels.
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
