"""A drafter that fails, behind the server: a request whose drafter raises gets plain decoding's
answer (and the metrics count the failure); one the drafter cannot take is a JSON 500 that says
nothing of the fault, and the server goes on."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.fixtures.server import _client, _engine, _metric, _start, _wait_idle

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False}
PROMPT = "the cat sat on the mat and the cat sat on the"
FAILURES = "specdec:spec_decode_num_drafter_failures_total"


@pytest.fixture(scope="module")
def suffix_server(tiny_llama):
    srv = _start(str(tiny_llama), spec=SUFFIX)
    yield srv
    srv.stop()


def _failures_reach(srv, want: float, timeout: float = 5.0) -> bool:
    """The engine thread folds its counts into the metrics after answering: wait for it."""
    deadline = time.monotonic() + timeout
    while _metric(srv, FAILURES) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return _metric(srv, FAILURES) == want


def _complete(srv, salt: str) -> tuple[dict, str]:
    out = _client(srv).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=48, temperature=0.0,
        extra_body={"ignore_eos": True, "cache_salt": salt},
    )  # fmt: skip
    return out.model_extra["spec_decode"], out.choices[0].text


def test_drafter_that_raises_falls_back_to_plain(suffix_server) -> None:
    stats, want = _complete(suffix_server, "drafting")
    assert stats["num_drafts"] > 0
    _wait_idle(suffix_server)
    proposer = _engine(suffix_server).speculator.proposer
    before = _metric(suffix_server, FAILURES)

    def broken(inp):
        raise RuntimeError("injected drafter failure")

    proposer.propose = broken
    try:
        stats, text = _complete(suffix_server, "broken")
    finally:
        del proposer.propose
    _wait_idle(suffix_server)
    assert text == want and stats["num_drafts"] == 0
    assert _failures_reach(suffix_server, before + 1)
    assert not _engine(suffix_server).speculator._drafter_off


def test_drafter_that_cannot_take_a_request_is_a_json_500(suffix_server) -> None:
    engine = _engine(suffix_server)
    proposer = engine.speculator.proposer
    before = _metric(suffix_server, FAILURES)

    def broken(req_id: str) -> None:
        raise RuntimeError("injected add fault with 'client text'")

    proposer.add_request = broken
    try:
        r = httpx.post(
            f"{suffix_server.url}/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8},
            timeout=30,
        )
    finally:
        del proposer.add_request
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_server_error" and "client text" not in err["message"]
    _wait_idle(suffix_server)
    assert not engine.requests and _failures_reach(suffix_server, before + 1)
    _complete(suffix_server, "after")  # the server goes on
