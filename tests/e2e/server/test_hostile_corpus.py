"""The hostile corpus against a live `specdec serve` of the real model with suffix speculation.

Each case is a request (or a few at once) that once crashed the server, stalled it or leaked
through an error: grammars deep or slow enough to overflow or busy the grammar library, costly
logprobs and bad words, odd logit_bias keys, control characters, wrong types. For each one:
never a 5xx, every error an OpenAI-style body naming its field, the process alive afterwards,
and `/health` answering with no gap over 200 ms while the case runs (polled every ~10 ms from
another client). The server is a subprocess so that a crash is seen, not suffered.

Each case also has its victim ratio (tests/fixtures/victim.py): a greedy stream's median time
between tokens while the case's requests loop beside it (fresh cache salts, until the stream
ends), over the same stream's alone just before; and the longest gap, in alone medians. Both go
to the test report (``record_property``) and, at the end, to a table on the terminal. The load
test adds the issue's worst case: two clients looping unique ~1,500-token prompts beside the
stream. SPECDEC_CORPUS_SERVER_ARGS adds `specdec serve` arguments (``--prefill-time-share 0``
shows what the assertions catch).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import threading
import time

import httpx
import pytest

from tests.fixtures.hostile import CASES, _completion, unique_text
from tests.fixtures.server import serve
from tests.fixtures.victim import beside, ratio, tokens_while, victim

MODEL = "smollm2-135m"
MAX_HEALTH_GAP_S = 0.2
CASE_TIMEOUT_S = 30.0
VICTIM_TOKENS = 48
# NOTE: the goal (issue 54) is a victim ratio of at most 2 (median gap loaded / alone); before the
# prefill time share a long prompt beside the stream made it 67-85 (each of the stream's steps
# waited for a whole prompt chunk). 10 is 5x the goal, room for a shared CI machine's noise over
# a 48-token stream, and still far below any return of that stall.
MAX_VICTIM_RATIO = 10.0
SERVER_ARGS = shlex.split(os.environ.get("SPECDEC_CORPUS_SERVER_ARGS", ""))


@pytest.fixture(scope="module")
def live():
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": 8})
    with serve(
        MODEL, "--max-model-len", "4096", "--speculative-config", spec,
        "--shutdown-timeout", "1", "--uvicorn-log-level", "warning", *SERVER_ARGS,
        timeout=60, grace=15,
    ) as srv:  # fmt: skip
        victim(srv.url, MODEL, 8)  # NOTE: warm up (the first steps compile and allocate)
        yield srv
    log = srv.log()
    assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="module")
def ratios(request):
    """Rows of the victim table, shown on the terminal once the module's tests are done (past
    pytest's capture: the CI log has it without -s)."""
    rows: list[str] = []
    yield rows
    lines = [
        f"victim ratios ({VICTIM_TOKENS}-token greedy stream; server args {SERVER_ARGS}):",
        "| case | requests sent | alone ms (median) | loaded ms (median) | loaded / alone "
        "| longest / alone | /health max gap ms |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print("\n".join(lines))
        return
    with capture.global_and_fixture_disabled():
        print("\n" + "\n".join(lines))


def _record(
    record_property,
    rows: list[str],
    name: str,
    sent: int,
    alone: list[float],
    loaded: list[float],
    health_gap: float | None = None,
) -> float:
    """The victim ratio and longest gap of a run: to the report, the table; returns the ratio."""
    median_ratio, longest = ratio(alone, loaded)
    a50, l50 = statistics.median(alone) * 1e3, statistics.median(loaded) * 1e3
    record_property("victim_alone_median_ms", round(a50, 2))
    record_property("victim_loaded_median_ms", round(l50, 2))
    record_property("victim_ratio", round(median_ratio, 2))
    record_property("victim_longest_gap_in_alone_medians", round(longest, 1))
    gap = "" if health_gap is None else f"{health_gap * 1e3:.0f}"
    cells = f"{a50:.1f} | {l50:.1f} | {median_ratio:.2f} | {longest:.1f} | {gap}"
    rows.append(f"| {name} | {sent} | {cells} |")
    return median_ratio


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
    return httpx.post(f"{url}/v1/{path}", json={"model": MODEL, **body}, timeout=CASE_TIMEOUT_S)


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_case_never_5xx_never_stalls(live, ratios, record_property, name: str) -> None:
    """The case's requests, sent again under fresh salts while a victim stream runs beside them:
    never a 5xx, errors that name their field, /health answering, the victim's tokens all there
    and its ratio under MAX_VICTIM_RATIO."""
    alone = victim(live.url, MODEL, VICTIM_TOKENS, CASE_TIMEOUT_S)
    with _HealthWatch(live.url) as watch:
        run = beside(live.url, MODEL, CASES[name], VICTIM_TOKENS, max_requests=500,
                     loop_s=CASE_TIMEOUT_S, timeout=CASE_TIMEOUT_S)  # fmt: skip
    assert live.proc.poll() is None, live.stop()[-3000:]
    for stream in (alone, run.stream):
        assert stream.status == 200 and stream.finish_reason == "length", (name, stream.status)
        assert stream.completion_tokens == VICTIM_TOKENS, (name, stream.completion_tokens)
    median_ratio = _record(
        record_property, ratios, name, len(run.sent), alone.gaps, run.stream.gaps, watch.max_gap
    )
    for r in run.sent:
        assert r.status < 500, (name, r.status, r.body[:300])
        if r.status >= 400:
            err = r.json()["error"]
            assert err["param"] and "\n" not in err["message"], (name, err)
            assert len(err["message"]) < 400, (name, err["message"][:400])
        else:
            assert all(c["finish_reason"] != "error" for c in r.json()["choices"]), name
    assert watch.failures == 0, name
    assert watch.max_gap < MAX_HEALTH_GAP_S, (name, watch.max_gap)
    assert median_ratio < MAX_VICTIM_RATIO, (name, median_ratio)
    ok = _send(live.url, *_completion({"max_tokens": 4}))
    assert ok.status_code == 200


# The load test: two clients looping unique ~1,500-token prompts (the worst case; ~6
# tokens a word) beside a stream long enough to span a good part of their reading.
NEIGHBOURS = [
    ("completions", {"prompt": unique_text(7 + k, 250), "max_tokens": 4, "stream": True})
    for k in range(2)
]
LOAD_VICTIM_TOKENS = 256
# NOTE: the share of the idle rate the stream keeps while the prompts are read. The goal (2x
# slower at most) is 1/2; before the prefill time share it was ~1/70 (a step per 512-token
# chunk). 1/4 leaves a shared machine's noise room and still fails at once without the share.
MIN_TOKENS_WHILE_READ = 0.25


def test_long_prompt_neighbours_leave_the_victim_its_tokens(live, ratios, record_property) -> None:
    """While two clients' long prompts are read (each from its send to its first token), the
    victim's tokens keep coming: at least MIN_TOKENS_WHILE_READ of what its idle rate gives."""
    alone = victim(live.url, MODEL, VICTIM_TOKENS, CASE_TIMEOUT_S)
    run = beside(live.url, MODEL, NEIGHBOURS, LOAD_VICTIM_TOKENS, max_requests=8, loop_s=20,
                 timeout=CASE_TIMEOUT_S)  # fmt: skip
    assert live.proc.poll() is None, live.stop()[-3000:]
    assert run.stream.status == 200, run.stream.status
    assert run.stream.completion_tokens == LOAD_VICTIM_TOKENS, run.stream.completion_tokens
    reads = [(r.sent, r.first) for r in run.sent if r.first is not None]
    got, span = tokens_while(run.stream, reads)
    # NOTE: the idle rate is the alone stream's tokens over its time (its mean gap, not the
    # median the ratios use: the tokens a stream gets in a while are its mean rate's)
    idle = span * len(alone.gaps) / sum(alone.gaps)  # what the idle rate gives meanwhile
    kept = got / max(idle, 1e-9)
    record_property("victim_tokens_while_read", got)
    record_property("victim_tokens_idle_rate_gives", round(idle, 1))
    record_property("victim_share_kept_while_read", round(kept, 3))
    name = f"2 x 1,500-token prompts (kept {kept:.3f} of the idle rate while read: {got} "
    name += f"tokens of {idle:.0f} in {span:.1f} s)"
    _record(record_property, ratios, name, len(run.sent), alone.gaps, run.stream.gaps)
    for r in run.sent:
        assert r.status == 200 and r.first is not None, (r.status, r.body[:300])
        assert r.body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in r.body, r.body[-300:]
    assert idle >= 10, (span, idle)  # NOTE: a measurement: the prompts were read beside it
    assert kept >= MIN_TOKENS_WHILE_READ, (got, idle, kept)
    assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200


def test_model_cards_show_no_local_path(live) -> None:
    """The model as the operator named it (vLLM's root), never where its file lies."""
    for path in ("/v1/models", "/v1/models/smollm2-135m"):
        r = httpx.get(f"{live.url}{path}", timeout=10)
        assert r.status_code == 200 and ".gguf" not in r.text and "site-packages" not in r.text
    assert httpx.get(f"{live.url}/v1/models/smollm2-135m", timeout=10).json()["root"] == (
        "smollm2-135m"
    )
