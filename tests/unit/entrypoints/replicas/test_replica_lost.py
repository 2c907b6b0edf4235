"""A replica whose connection broke (specdec/entrypoints/replicas/pool.py ``mark_lost``) takes no
new requests until its /health answers again; one that exits stays down for the monitor."""

from __future__ import annotations

import asyncio
import shutil

from specdec.entrypoints.replicas.pool import ReplicaPool


class _Proc:
    def __init__(self) -> None:
        self.code: int | None = None
        self.pid = 1

    def poll(self) -> int | None:
        return self.code


class _Answer:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class _Client:
    """/health answers 503 ``sick`` times, then 200."""

    def __init__(self, sick: int) -> None:
        self.sick, self.asked = sick, 0

    async def get(self, path: str, timeout: float) -> _Answer:
        assert path == "/health"
        self.asked += 1
        return _Answer(503 if self.asked <= self.sick else 200)


def _pool() -> ReplicaPool:
    pool = ReplicaPool(argv=[], core_groups=[[0], [1]], startup_timeout=30.0)
    for r in pool.replicas:
        r.proc, r.up, r.client = _Proc(), True, _Client(sick=3)
    return pool


def test_a_lost_replica_is_held_out_until_healthy() -> None:
    async def run() -> None:
        pool = _pool()
        victim = pool.replicas[0]
        pool.mark_lost(victim)
        assert [r.index for r in pool.serving()] == [1]  # at once, before its process is reaped
        await asyncio.wait_for(victim.watcher, 10)
        assert victim.client.asked == 4 and victim.up  # back after its /health said 200
        assert [r.index for r in pool.serving()] == [0, 1]
        shutil.rmtree(pool.workdir, ignore_errors=True)

    asyncio.run(run())


def test_a_lost_replica_that_exits_stays_down() -> None:
    async def run() -> None:
        pool = _pool()
        victim = pool.replicas[0]
        pool.mark_lost(victim)
        victim.proc.code = -9  # it was dying: the monitor restarts it
        assert await asyncio.wait_for(victim.watcher, 10) is False
        assert not victim.up and [r.index for r in pool.serving()] == [1]
        shutil.rmtree(pool.workdir, ignore_errors=True)

    asyncio.run(run())
