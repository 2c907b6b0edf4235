"""specdec: speculative decoding inference engine."""

from specdec.config import EngineConfig, SpeculativeConfig
from specdec.llm import LLM
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "SpeculativeConfig"]
__version__ = "0.1.0"
