"""Failing clients wait their turn: a client whose requests keep failing (answered 4xx) gets its
further error answers late while other requests are being served.

Why: a refused request is cheap, but not free. Reading a 4 MB body, parsing it and building
the error takes the same cores that decode everyone else's tokens, and a client that loops
requests the server refuses (a broken script, a fuzzer, a flood) can send hundreds a second. On
a 2-core machine thirty to four hundred refusals during one 48-token stream slowed that stream
2.3-3.6x. A client that loops waits for each answer before it sends the next, so answering its
errors late makes it send fewer; a client whose requests succeed is never delayed.

How: each client (its address; behind a front, the front applies this itself) has a failure
score: +1 for every 4xx answer, halved every ``HALF_LIFE_S`` seconds. The first
``FREE_FAILURES`` cost nothing; past them, an error answer waits ``STEP_S`` seconds per failure
over the allowance, at most ``max_delay_s``, and only while the server has other requests in
flight (an idle server answers at once: nobody else is kept waiting). The wait holds only the
client's own connection; nothing else queues behind it. 408 (the client's own slowness: its
connection is closed) and 499 (nobody is listening) are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

FREE_FAILURES = 8.0  # recent failures a client may have before its error answers wait
STEP_S = 0.05  # each failure over the allowance adds this much to the wait
HALF_LIFE_S = 10.0  # a failure counts half after this long
DEFAULT_MAX_DELAY_S = 1.0
MAX_CLIENTS = 4096  # scores kept; past it the lowest are forgotten
UNCOUNTED = frozenset({408, 499})


@dataclass
class _Score:
    value: float
    at: float


@dataclass
class ErrorBackoff:
    """Per-client failure scores and the wait an error answer gets (see the module's notes)."""

    max_delay_s: float = DEFAULT_MAX_DELAY_S
    clock: Callable[[], float] = time.monotonic
    _scores: dict[str, _Score] = field(default_factory=dict)

    @staticmethod
    def counts(status: int) -> bool:
        """Whether an answer with this status is a failure that counts."""
        return 400 <= status < 500 and status not in UNCOUNTED

    def score(self, client: str) -> float:
        """The client's failure score now."""
        s = self._scores.get(client)
        if s is None:
            return 0.0
        return s.value * 0.5 ** ((self.clock() - s.at) / HALF_LIFE_S)

    def failed(self, client: str) -> float:
        """Count one failure of ``client``; the seconds its error answer should wait if others
        are being served (0 within the allowance)."""
        now = self.clock()
        value = self.score(client) + 1.0
        self._scores[client] = _Score(value, now)
        if len(self._scores) > MAX_CLIENTS:
            self._forget()
        if self.max_delay_s <= 0 or value <= FREE_FAILURES:
            return 0.0
        return min(self.max_delay_s, STEP_S * (value - FREE_FAILURES))

    def _forget(self) -> None:
        """Drop the lower half of the scores (a flood of addresses cannot grow the table)."""
        ranked = sorted(self._scores, key=self.score)
        for client in ranked[: len(ranked) // 2]:
            del self._scores[client]
