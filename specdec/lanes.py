"""Client lanes in a shared pool of a few slots (grammar compile threads, chat template
workers): how many jobs each lane runs at once. A client's lane holds at most all slots but one,
so another client's job always finds one; jobs without a lane (``None``: offline, internal) may
take every slot. Standard library only. Not thread-safe: the pool guards it with its own lock."""

from __future__ import annotations

from collections.abc import Hashable


class LaneCaps:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._running: dict[Hashable, int] = {}

    def may_start(self, lane: Hashable) -> bool:
        cap = self.slots if lane is None else max(1, self.slots - 1)
        return self._running.get(lane, 0) < cap

    def started(self, lane: Hashable) -> None:
        self._running[lane] = self._running.get(lane, 0) + 1

    def finished(self, lane: Hashable) -> None:
        self._running[lane] -= 1
        if not self._running[lane]:
            del self._running[lane]
