"""The scheduler's engine arguments: how many sequences and tokens a step takes, and how
prompts share a step with decoding."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.config.arg_spec import _arg, human_int


@dataclass
class SchedulerArgs:
    """Batching and prompt chunks."""

    max_num_seqs: int = _arg(
        8, "sequences decoded together (llama.cpp's -np/--parallel)", type=int,
        flags=("-np", "--parallel"),
    )  # fmt: skip
    max_num_batched_tokens: int = _arg(
        512,
        "tokens per step; longer prompts are prefilled in chunks of this size",
        type=human_int,
    )
    prefill_time_share: float = _arg(
        1.0,
        "while requests decode, the prompts read beside them may take at most this times the "
        "decoding's time on average, in chunks of ~2.5 decode steps' time (1: their tokens come "
        "~2x slower on average; higher favours throughput and time to first token; 0: no "
        "limit, prompts take the whole token budget)",
        type=float,
    )
