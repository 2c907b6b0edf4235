"""specdec: speculative decoding inference engine."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.config import EngineConfig, SpeculativeConfig
    from specdec.llm import LLM
    from specdec.outputs import CompletionOutput, RequestOutput
    from specdec.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "SpeculativeConfig"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "specdec.llm",
    "SamplingParams": "specdec.sampling_params",
    "SpeculativeConfig": "specdec.config",
    "EngineConfig": "specdec.config",
    "RequestOutput": "specdec.outputs",
    "CompletionOutput": "specdec.outputs",
}


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so `import specdec.sampling_params` does not load torch models and kernels.
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
