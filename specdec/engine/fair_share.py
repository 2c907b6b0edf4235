"""The machine's share between decoding and prefill: while some requests decode, the prompts read
beside them (prefill chunks, prompt-logprob rows) may take at most ``share`` times the decoding's
own time, so a stream's tokens come on average at most ``1 + share`` times slower while others'
prompts are read, and no step carrying prompt tokens takes more than about
``1 + max(share, BURST)`` decode steps' time.

Stall-free batching as in Sarathi-Serve (Agrawal et al. 2024, arXiv:2403.02310), with the chunk
found from measured step times on this machine and model instead of a fixed token count: the
time of a step without prefill is the median of the latest such steps with as many decoding
requests (a batch that grows or shrinks first decodes alone once), and the chunk is the size
whose extra time is ``BURST`` of a lone stream's decode steps (a larger batch's own steps are
slower for each of its streams already), from the extra time a prompt token was measured to add
(extra time is about linear in the chunk; prompt tokens and prompt-logprob rows each learnt
apart, one kind a step), at most doubling a step.

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
import statistics
from collections import deque
from dataclasses import dataclass, field

# Fewest prompt tokens a step reads beside decoding: the prompt always moves on.
MIN_CHUNK = 4
FIRST_CHUNK = 16
REFRESH_STEPS = 32
# Decode-only steps (per number of decoding requests) whose median is the decode step's time.
# NOTE: a median per batch size, not one moving mean: the steps in which a server takes a long
# prompt in (its HTTP work competing for the cores) ran 2-3x a decode step, and the long prompts'
# own few decode steps beside the stream ran 1.7x its steps alone; a mean with weight 0.3 took
# both in, and the chunks sized from it ran at 5-9 decode steps' extra time for the next ten
# steps instead of BURST (two clients looping 1,500-token prompts beside a stream, SmolLM2,
# 2-core Xeon).
DECODE_WINDOW = 9
# The extra time of a step that reads prompt tokens beside decoding, in decode steps: a stream's
# longest wait between two steps is about 1 + BURST of its steps under load.
BURST = 2.5
# A step that reads prompt tokens takes at most max(GAP, 1 + share) of a lone stream's decode
# steps at its quickest (the QUICK_QUANTILE of its latest QUICK_WINDOW decode-only steps),
# whatever decodes beside it and however loaded the machine is (GAP: 10% below the 5 idle steps
# a stream should never wait; tighter, the chunks' extra time fell below two decode steps under
# load, chunk and decode steps alternated and a stream's median wait doubled).
# NOTE: under a server's load (the HTTP work of the clients sending long prompts) the decode-only
# steps around the chunks ran 6.4-7 ms against 5.1-5.2 ms for the same stream on its own, so
# chunks of BURST of those ran 25-31 ms: 5-6 of the stream's idle steps (two clients looping
# 1,500-token prompts beside a stream, SmolLM2, 2-core Xeon)
GAP = 4.5
QUICK_WINDOW = 64
QUICK_QUANTILE = 0.25


# What a step reads of a prompt: its tokens ("prompt"), or rows whose logits are all kept
# ("logprobs": prompt_logprobs; ~0.8 ms a row against ~0.5 ms a token beside one stream on
# SmolLM2, 2-core Xeon); each kind's time per token is learnt apart, so a chunk of one is never
# sized from the other's.
KINDS = ("prompt", "logprobs")


@dataclass
class _TokenCost:
    """What one prompt token of a kind adds to a decoding step (learnt), and the largest chunk:
    twice that of the kind's latest chunk step."""

    token_ms: float | None = None
    cap: int = FIRST_CHUNK


@dataclass
class PrefillShare:
    """Prefill tokens a step may carry (``budget``), learnt from step times (``observe``).

    ``share`` <= 0 turns the limit off: prefill takes the whole token budget."""

    share: float = 1.0
    steps_since_decode_only: int = 0
    balance_ms: float = 0.0  # the token bucket: share earned minus prefill time spent
    # decode-only step times by number of decoding requests; the size and kind of the latest step
    _decode_steps: dict[int, deque] = field(default_factory=dict, repr=False)
    _decode_median: dict[int, float] = field(default_factory=dict, repr=False)  # of those
    # a lone stream's decode-only steps, a longer window (its quick steps: quick_ms)
    _lone_steps: deque = field(default_factory=lambda: deque(maxlen=QUICK_WINDOW), repr=False)
    _decoding: int = 1
    _costs: dict[str, _TokenCost] = field(
        default_factory=lambda: {k: _TokenCost() for k in KINDS}, repr=False
    )
    _kind: str = "prompt"

    @property
    def decode_ms(self) -> float | None:
        """A step that only decodes as many requests as the latest: the median of the latest
        such steps (None before one)."""
        return self._decode_median.get(self._decoding)

    @property
    def token_ms(self) -> float | None:
        """What a prompt token of the latest kind adds to a decoding step (None before one)."""
        return self._costs[self._kind].token_ms

    @property
    def stream_ms(self) -> float | None:
        """The decode step a stream's wait is counted in: one request's alone when known (a
        larger batch's steps are already slower for each of its streams), else the latest
        batch size's."""
        decode_ms, alone = self.decode_ms, self._decode_median.get(1)
        if decode_ms is None or alone is None:
            return decode_ms
        return min(decode_ms, alone)

    @property
    def quick_ms(self) -> float | None:
        """A lone stream's decode step at its quickest: the QUICK_QUANTILE of its latest
        QUICK_WINDOW decode-only steps (None before one). NOTE: found when a chunk is sized, not
        on every decode-only step."""
        if not self._lone_steps:
            return None
        steps = sorted(self._lone_steps)
        return steps[int(QUICK_QUANTILE * (len(steps) - 1))]

    @property
    def chunk(self) -> int:
        """Prompt tokens of the latest kind a step reads beside the latest batch size's decoding:
        ``burst`` of a stream's decode steps (``stream_ms``) over a token's time, no more than
        leaves the step within ``max(GAP, 1 + burst)`` of a lone stream's quick steps
        (``quick_ms``), at most twice the kind's latest chunk step's."""
        cost, stream_ms, decode_ms = self._costs[self._kind], self.stream_ms, self.decode_ms
        if cost.token_ms is None or stream_ms is None or decode_ms is None:
            return cost.cap
        extra = self.burst * stream_ms
        quick_ms = self.quick_ms
        if quick_ms is not None:
            extra = min(extra, max(GAP, 1 + self.burst) * quick_ms - decode_ms)
        want = extra / cost.token_ms
        return max(MIN_CHUNK, min(int(want), cost.cap))

    @property
    def enabled(self) -> bool:
        return self.share > 0

    @property
    def burst(self) -> float:
        """Extra time of a step with prompt tokens, in decode steps."""
        return max(self.share, BURST)

    def budget(self, max_tokens: int, decoding: int, kind: str = "prompt") -> int:
        """Prompt tokens of ``kind`` (``KINDS``) this step may read, out of ``max_tokens``,
        beside ``decoding`` decoding requests."""
        if not self.enabled or not decoding:
            return max_tokens
        self._decoding, self._kind = int(decoding), kind
        if self.decode_ms is None or self.steps_since_decode_only >= REFRESH_STEPS:
            return 0  # a step that decodes alone: what prefill is held against
        if self.balance_ms < 0:
            return 0  # paying the last chunk back
        return min(max_tokens, self.chunk)

    def observe(self, prefill_tokens: int, decoding: int, ms: float, kind: str = "prompt") -> None:
        """A step's time (``ms``) with ``prefill_tokens`` prompt tokens of ``kind`` beside
        ``decoding`` decoding requests."""
        if not self.enabled or not decoding or not math.isfinite(ms) or ms <= 0:
            return
        self._decoding, self._kind = int(decoding), kind
        if prefill_tokens == 0:
            steps = self._decode_steps.setdefault(self._decoding, deque(maxlen=DECODE_WINDOW))
            steps.append(ms)
            self._decode_median[self._decoding] = statistics.median(steps)
            if self._decoding == 1:
                self._lone_steps.append(ms)
            self.steps_since_decode_only = 0
            self._earn(0.0)
            return
        self.steps_since_decode_only += 1
        decode_ms = self.decode_ms
        if decode_ms is None:
            return
        extra = max(ms - decode_ms, 1e-3)
        self._earn(extra)
        # NOTE: a dearer token is believed at once (a prompt's tokens cost more as its context
        # grows: a lagging estimate sized chunks at 4+ decode steps); a cheaper one by a
        # geometric step, which damps the noise of one step
        cost, chunk = self._costs[kind], self.chunk
        if cost.token_ms is not None:
            old = cost.token_ms
        else:
            old = self.burst * (self.stream_ms or decode_ms) / chunk
        per_token = extra / prefill_tokens
        cost.token_ms = per_token if per_token > old else math.sqrt(old * per_token)
        cost.cap = 2 * chunk

    def _earn(self, spent_ms: float) -> None:
        """A decoding step: its share earned, ``spent_ms`` of prompt reading paid; what a step
        earns is all that is kept while no prompt is read."""
        decode_ms = self.decode_ms
        assert decode_ms is not None
        earned = self.share * decode_ms
        self.balance_ms = min(earned, self.balance_ms + earned - spent_ms)
