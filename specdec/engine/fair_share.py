"""The machine's share between decoding and prefill: while some requests decode, the prompts read
beside them (prefill chunks, prompt-logprob rows) may take at most ``share`` times the decoding's
own time, so a stream's tokens come on average at most ``1 + share`` times slower while others'
prompts are read, and no step carrying prompt tokens takes more than ``1 + max(share, BURST)``
decode steps' time.

Stall-free batching as in Sarathi-Serve (Agrawal et al. 2024, arXiv:2403.02310), with the chunk
found from measured step times on this machine and model instead of a fixed token count: the
time of a step without prefill is an average of such steps, and the chunk moves toward the size
whose extra time meets the target (extra time is about linear in the chunk), at most doubling a
step.

The share is paid from a budget of time, a token bucket: each step that decodes earns ``share``
times a decode-only step's time, a step that reads prompt tokens spends its extra time, and a
step may read prompt tokens only while the balance is not negative (a balance keeps at most one
step's earnings, so time no prompt needed is not saved up). Below ``share = BURST`` the
prompt is thus read in chunks of ``BURST`` decode steps' time, with decode-only steps between
them that pay the chunk back, rather than a sliver beside every step: the same share of the
machine on average, but each chunk reads its KV cache and weights once for more prompt tokens,
so a long prompt's first token comes sooner (a 1,500-token prompt beside one stream on SmolLM2:
1.8-2.0x its time alone, against 2.5-2.6x in slivers; benchmarks/prefill_share.py). The decode-only steps also keep the
average decode time current; with a share of ``BURST`` or more, every ``REFRESH_STEPS``-th such
step decodes alone for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Fewest prompt tokens a step reads beside decoding: the prompt always moves on.
MIN_CHUNK = 4
FIRST_CHUNK = 16
REFRESH_STEPS = 32
DECODE_EMA = 0.3  # weight of the newest decode-only step in the average
# The extra time of a step that reads prompt tokens beside decoding, in decode steps: a stream's
# longest wait between two steps is about 1 + BURST of its steps under load.
BURST = 2.5


@dataclass
class PrefillShare:
    """Prefill tokens a step may carry (``budget``), learnt from step times (``observe``).

    ``share`` <= 0 turns the limit off: prefill takes the whole token budget."""

    share: float = 1.0
    decode_ms: float | None = None  # average time of a step that only decodes
    chunk: int = FIRST_CHUNK
    steps_since_decode_only: int = 0
    balance_ms: float = 0.0  # the token bucket: share earned minus prefill time spent

    @property
    def enabled(self) -> bool:
        return self.share > 0

    @property
    def burst(self) -> float:
        """Extra time of a step with prompt tokens, in decode steps."""
        return max(self.share, BURST)

    def budget(self, max_tokens: int, decoding: bool) -> int:
        """Prompt tokens this step may read, out of ``max_tokens``, when some request ``decoding``."""
        if not self.enabled or not decoding:
            return max_tokens
        if self.decode_ms is None or self.steps_since_decode_only >= REFRESH_STEPS:
            return 0  # a step that decodes alone: what prefill is held against
        if self.balance_ms < 0:
            return 0  # paying the last chunk back
        return min(max_tokens, self.chunk)

    def observe(self, prefill_tokens: int, decoding: bool, ms: float) -> None:
        """A step's time (``ms``) with ``prefill_tokens`` prompt tokens beside decoding rows."""
        if not self.enabled or not decoding or not math.isfinite(ms) or ms <= 0:
            return
        if prefill_tokens == 0:
            old = self.decode_ms
            self.decode_ms = ms if old is None else (1 - DECODE_EMA) * old + DECODE_EMA * ms
            self.steps_since_decode_only = 0
            self._earn(0.0)
            return
        self.steps_since_decode_only += 1
        if self.decode_ms is None:
            return
        extra = max(ms - self.decode_ms, 1e-3)
        self._earn(extra)
        want = prefill_tokens * self.burst * self.decode_ms / extra
        # NOTE: a geometric step toward the target damps the noise of one step's time
        target = math.sqrt(max(want, 1.0) * self.chunk)
        self.chunk = max(MIN_CHUNK, min(int(target), 2 * self.chunk))

    def _earn(self, spent_ms: float) -> None:
        """A decoding step: its share earned, ``spent_ms`` of prompt reading paid; what a step
        earns is all that is kept while no prompt is read."""
        assert self.decode_ms is not None
        earned = self.share * self.decode_ms
        self.balance_ms = min(earned, self.balance_ms + earned - spent_ms)
