"""The machine's share between decoding and prefill: while some requests decode, the prompts read
beside them (prefill chunks, prompt-logprob rows) may add at most ``share`` times a decode-only
step's time to a step, so a stream's tokens come at most ``1 + share`` times slower while others'
prompts are read.

Stall-free batching as in Sarathi-Serve (Agrawal et al. 2024, arXiv:2403.02310), with the chunk
found from measured step times on this machine and model instead of a fixed token count: the
time of a step without prefill is an average of such steps, and the chunk moves toward the size
whose extra time meets the target (extra time is about linear in the chunk), at most doubling a
step. Every ``REFRESH_STEPS`` steps with prefill beside decoding, one step decodes alone, so the
average follows the batch and the context as they change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Fewest prompt tokens a step reads beside decoding: the prompt always moves on.
MIN_CHUNK = 4
FIRST_CHUNK = 16
REFRESH_STEPS = 32
DECODE_EMA = 0.3  # weight of the newest decode-only step in the average


@dataclass
class PrefillShare:
    """Prefill tokens a step may carry (``budget``), learnt from step times (``observe``).

    ``share`` <= 0 turns the limit off: prefill takes the whole token budget."""

    share: float = 1.0
    decode_ms: float | None = None  # average time of a step that only decodes
    chunk: int = FIRST_CHUNK
    steps_since_decode_only: int = 0

    @property
    def enabled(self) -> bool:
        return self.share > 0

    def budget(self, max_tokens: int, decoding: bool) -> int:
        """Prompt tokens this step may read, out of ``max_tokens``, when some request ``decoding``."""
        if not self.enabled or not decoding:
            return max_tokens
        if self.decode_ms is None or self.steps_since_decode_only >= REFRESH_STEPS:
            return 0  # a step that decodes alone: what prefill is held against
        return min(max_tokens, self.chunk)

    def observe(self, prefill_tokens: int, decoding: bool, ms: float) -> None:
        """A step's time (``ms``) with ``prefill_tokens`` prompt tokens beside decoding rows."""
        if not self.enabled or not decoding or not math.isfinite(ms) or ms <= 0:
            return
        if prefill_tokens == 0:
            old = self.decode_ms
            self.decode_ms = ms if old is None else (1 - DECODE_EMA) * old + DECODE_EMA * ms
            self.steps_since_decode_only = 0
            return
        self.steps_since_decode_only += 1
        if self.decode_ms is None:
            return
        extra = max(ms - self.decode_ms, 1e-3)
        want = prefill_tokens * self.share * self.decode_ms / extra
        # NOTE: a geometric step toward the target damps the noise of one step's time
        target = math.sqrt(max(want, 1.0) * self.chunk)
        self.chunk = max(MIN_CHUNK, min(int(target), 2 * self.chunk))
