"""A client looping refused requests beside another's stream, on a live server: past its free
failures its 400s come late (so it sends fewer), the stream's own request is never held, and
once nothing else runs the same refusals are answered at once."""

from __future__ import annotations

import json
import threading
import time

import httpx

from specdec.entrypoints.openai import error_backoff as eb
from tests.fixtures.server import _SlowSteps, _start, _wait_idle

BAD = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": 5}  # stop: not a string or list


def _refusal_times(url: str, n: int) -> list[float]:
    times = []
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            t = time.perf_counter()
            r = c.post(f"{url}/v1/completions", json=BAD)
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
            times.append(time.perf_counter() - t)
    return times


def test_refusals_wait_while_others_are_served_and_not_when_idle(tiny_llama) -> None:
    srv = _start(str(tiny_llama), app={"error_backoff_s": 0.3})
    try:
        url, done, stream = srv.url, threading.Event(), {}

        def decode() -> None:
            body = {"model": "tiny", "prompt": "the cat", "max_tokens": 40, "stream": True,
                    "ignore_eos": True, "temperature": 0,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                stream["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                        stream["tokens"] = json.loads(line[6:])["usage"]["completion_tokens"]
            done.set()

        with _SlowSteps(srv, delay=0.08):  # the stream runs ~3 s
            worker = threading.Thread(target=decode)
            worker.start()
            time.sleep(0.3)
            busy = _refusal_times(url, int(eb.FREE_FAILURES) + 6)
            assert not done.is_set(), "the stream ended before the refusals: make it longer"
            worker.join(60)
        assert stream == {"status": 200, "tokens": 40}
        free = int(eb.FREE_FAILURES)
        assert sum(busy[: free - 1]) < 0.5, busy  # the allowance: answered at once
        assert sum(busy[free:]) >= 0.25, busy  # then late: 50 ms more each, at most 0.3 s
        assert max(busy) < 0.3 + 0.5, busy
        _wait_idle(srv)
        idle = _refusal_times(url, 6)  # a score still high, but nobody else is served
        assert sum(idle) < 0.5, idle
    finally:
        srv.stop()
