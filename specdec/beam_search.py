"""Beam search's results (vLLM's ``vllm.beam_search``): ``LLM.beam_search`` returns one
``BeamSearchOutput`` per prompt, its ``beam_width`` best ``BeamSearchSequence``s, best first."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from specdec.outputs import PositionLogprobs


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (the prompt's, then the generated ones), per generated token the
    top log-probabilities of its step (``logprobs``), their sum over the chosen tokens
    (``cum_logprob``), and once returned its ``text`` (prompt and output, decoded) and why it
    ended (``finish_reason`` "stop" at an EOS, "length" at max_tokens or max_model_len)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best sequences, best first (at most ``beam_width``)."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int],
    cumulative_logprob: float,
    eos_token_id: int | Collection[int],
    length_penalty: float = 1.0,
) -> float:
    """The cumulative log-probability over ``len(tokens) ** length_penalty`` (a final EOS not
    counted): vLLM's score, after Hugging Face transformers' beam scorer."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else eos_token_id
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)
