"""The hostile corpus against a live `specdec serve` of the real model with suffix speculation.

Each case is a request (or a few at once) that once crashed the server, stalled it or leaked
through an error: grammars deep or slow enough to overflow or busy the grammar library, costly
logprobs and bad words, odd logit_bias keys, control characters, wrong types. For each one:
never a 5xx, every error an OpenAI-style body naming its field, the process alive afterwards,
and `/health` answering with no gap over 200 ms while the case runs (polled every ~10 ms from
another client). The server is a subprocess so that a crash is seen, not suffered.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.hostile import CASES, _completion
from tests.fixtures.server import serve

MAX_HEALTH_GAP_S = 0.2
CASE_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def live():
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": 8})
    with serve(
        "smollm2-135m", "--max-model-len", "4096", "--speculative-config", spec,
        "--shutdown-timeout", "1", "--uvicorn-log-level", "warning", timeout=60, grace=15,
    ) as srv:  # fmt: skip
        yield srv
    log = srv.log()
    assert "Traceback" not in log, log[-3000:]


class _HealthWatch:
    """Polls /health from its own client; ``max_gap`` is the longest time between answers."""

    def __init__(self, url: str) -> None:
        self.url, self.max_gap, self.failures = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            last = time.perf_counter()
            while not self._stop.is_set():
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                now = time.perf_counter()
                if ok:
                    self.max_gap, last = max(self.max_gap, now - last), now
                else:
                    self.failures += 1
                time.sleep(0.01)

    def __enter__(self) -> _HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def _send(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/{path}", json={"model": "smollm2-135m", **body}, timeout=CASE_TIMEOUT_S
    )


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_case_never_5xx_never_stalls(live, name: str) -> None:
    requests = CASES[name]
    with _HealthWatch(live.url) as watch, ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda pb: _send(live.url, *pb), requests))
    assert live.proc.poll() is None, live.stop()[-3000:]
    for r in answers:
        assert r.status_code < 500, (name, r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["param"] and "\n" not in err["message"], (name, err)
            assert len(err["message"]) < 400, (name, err["message"][:400])
        else:
            assert all(c["finish_reason"] != "error" for c in r.json()["choices"]), name
    assert watch.failures == 0, name
    assert watch.max_gap < MAX_HEALTH_GAP_S, (name, watch.max_gap)
    ok = _send(live.url, *_completion({"max_tokens": 4}))
    assert ok.status_code == 200


def test_model_cards_show_no_local_path(live) -> None:
    """The model as the operator named it (vLLM's root), never where its file lies."""
    for path in ("/v1/models", "/v1/models/smollm2-135m"):
        r = httpx.get(f"{live.url}{path}", timeout=10)
        assert r.status_code == 200 and ".gguf" not in r.text and "site-packages" not in r.text
    assert httpx.get(f"{live.url}/v1/models/smollm2-135m", timeout=10).json()["root"] == (
        "smollm2-135m"
    )
