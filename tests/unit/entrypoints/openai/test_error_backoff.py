"""A client that keeps failing gets its error answers late while others are served: the score
(free allowance, growth, decay, cap, bounded table) on a fake clock, and RequestGuard holding
back exactly those answers (never a success, never on an idle server, never a relayed request's
at the replica)."""

import asyncio

import pytest

from specdec.entrypoints.openai import error_backoff as eb
from specdec.entrypoints.openai.error_backoff import ErrorBackoff
from specdec.entrypoints.openai.server_common import (
    RequestGuard,
    ServerState,
    forwarded_client_headers,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_free_failures_then_a_growing_capped_wait():
    clock = Clock()
    b = ErrorBackoff(max_delay_s=0.4, clock=clock)
    waits = [b.failed("host:a") for _ in range(20)]
    free = int(eb.FREE_FAILURES)
    assert waits[:free] == [0.0] * free
    assert waits[free] == pytest.approx(eb.STEP_S)
    assert waits[free + 1] == pytest.approx(2 * eb.STEP_S)
    assert all(b2 >= b1 for b1, b2 in zip(waits, waits[1:]))
    assert max(waits) == pytest.approx(0.4)
    assert b.failed("host:b") == 0.0  # another client starts clean


def test_failures_are_forgotten_with_time():
    clock = Clock()
    b = ErrorBackoff(clock=clock)
    for _ in range(12):
        b.failed("host:a")
    assert b.score("host:a") == pytest.approx(12.0)
    clock.t += eb.HALF_LIFE_S
    assert b.score("host:a") == pytest.approx(6.0)
    clock.t += 10 * eb.HALF_LIFE_S
    assert b.failed("host:a") == 0.0  # back within the allowance


def test_off_and_uncounted_statuses():
    b = ErrorBackoff(max_delay_s=0.0)
    assert all(b.failed("host:a") == 0.0 for _ in range(50))
    assert ErrorBackoff.counts(400) and ErrorBackoff.counts(413) and ErrorBackoff.counts(429)
    assert not any(ErrorBackoff.counts(s) for s in (200, 204, 307, 408, 499, 500, 503))


def test_the_table_stays_bounded_and_keeps_the_worst(monkeypatch):
    monkeypatch.setattr(eb, "MAX_CLIENTS", 64)
    b = ErrorBackoff(clock=Clock())
    for _ in range(20):
        b.failed("host:flooder")
    for i in range(500):
        b.failed(f"host:10.0.{i // 256}.{i % 256}")
    assert len(b._scores) <= 64
    assert b.score("host:flooder") == pytest.approx(20.0)


# ---- RequestGuard -------------------------------------------------------------------------------
def _app(status: int):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def _scope(method: str = "POST", host: str = "10.0.0.7", headers: dict | None = None) -> dict:
    raw = [(b"host", b"localhost"), (b"content-type", b"application/json")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "method": method, "path": "/v1/completions", "headers": raw,
            "client": (host, 5555)}  # fmt: skip


def _answer(guard: RequestGuard, scope: dict) -> tuple[int, float, list[float]]:
    """Status, seconds slept by the guard, and the sleeps asked for."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(s: float) -> None:
        slept.append(s)
        await real_sleep(0)

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def run():
        asyncio.sleep = fake_sleep  # type: ignore[assignment]
        try:
            await guard(scope, receive, send)
        finally:
            asyncio.sleep = real_sleep  # type: ignore[assignment]

    asyncio.run(run())
    return sent[0]["status"], sum(slept), slept


def _guard(status: int, busy: int, secret: str | None = None) -> RequestGuard:
    state = ServerState(allowed_hosts=None, error_backoff=ErrorBackoff(), forwarded_secret=secret)
    state.in_flight = busy  # other requests being answered
    return RequestGuard(_app(status), state)


def test_a_failing_client_waits_only_while_others_are_served():
    busy = _guard(400, busy=1)
    waits = [_answer(busy, _scope())[1] for _ in range(12)]
    free = int(eb.FREE_FAILURES)
    assert waits[:free] == [0.0] * free and waits[free:] == pytest.approx(
        [eb.STEP_S * k for k in range(1, 5)], rel=0.01
    )  # (the real clock: scores decay a little between calls)
    assert _answer(busy, _scope(host="10.0.0.8"))[1] == 0.0  # another address: its own score

    idle = _guard(400, busy=0)
    assert all(_answer(idle, _scope())[1] == 0.0 for _ in range(30))


def test_successes_and_relayed_requests_never_wait():
    ok = _guard(200, busy=3)
    assert all(_answer(ok, _scope())[:2] == (200, 0.0) for _ in range(30))

    secret = "s" * 64
    replica = _guard(400, busy=3, secret=secret)
    relayed = _scope(headers=forwarded_client_headers("host:10.0.0.7", secret))
    assert all(_answer(replica, relayed)[1] == 0.0 for _ in range(30))
    forged = _scope(headers=forwarded_client_headers("host:10.0.0.7", "t" * 64))
    assert sum(_answer(replica, forged)[1] for _ in range(30)) > 0  # not its front's signature


def test_the_guards_own_refusals_count_too():
    guard = _guard(200, busy=1)
    plain = _scope()
    plain["headers"] = [(b"host", b"localhost"), (b"content-type", b"text/plain")]
    answers = [_answer(guard, plain) for _ in range(12)]
    assert {a[0] for a in answers} == {415}
    assert answers[-1][1] > 0
