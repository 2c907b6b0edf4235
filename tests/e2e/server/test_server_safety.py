"""The server against a hostile client (issue 16): every cost a client controls is bounded, a
bad request is a 400 naming the field (never a 500), browsers cannot drive it, tenants keep their
prefixes apart, logs stay one escaped line per failure, and shutdown ends streams properly."""

from __future__ import annotations

import json
import logging
import re
import signal
import statistics
import threading
import time

import httpx
import pytest

from specdec.entrypoints.openai.safety import LOOPBACK_NAMES
from tests.fixtures.hostile import _BOMBS, _HOSTILE
from tests.fixtures.server import _HealthProbe, _SlowSteps, _start, _wait_idle, serve

CHAT = [{"role": "user", "content": "Say something about the cat."}]
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tiny_llama):
    """Defaults of `specdec serve` on loopback: loopback Host names only, no CORS, request
    templates refused."""
    srv = _start(str(tiny_llama), app={"allowed_hosts": list(LOOPBACK_NAMES)})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trusting_server(tiny_llama):
    """--trust-request-chat-template, with a 1 s render limit; CORS for one origin."""
    srv = _start(
        str(tiny_llama),
        app={
            "trust_request_chat_template": True,
            "chat_template_timeout": 1.0,
            "allowed_origins": [ORIGIN],
        },
    )
    yield srv
    srv.stop()


def _post_raw(srv, path: str, raw: bytes | str, **headers: str) -> httpx.Response:
    headers = {"content-type": "application/json", **headers}
    return httpx.post(f"{srv.url}{path}", content=raw, headers=headers, timeout=30)


# ---- 400, never 500 ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "param"), [h[1:] for h in _HOSTILE], ids=[h[0] for h in _HOSTILE]
)
def test_hostile_bodies_get_400_naming_the_field(server, path: str, raw: str, param: str | None) -> None:  # fmt: skip
    r = _post_raw(server, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_hostile_bodies_leave_the_server_serving(server) -> None:
    for _, path, raw, _ in _HOSTILE:
        _post_raw(server, path, raw)
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True, "temperature": 0},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{server.url}/health").status_code == 200
    _wait_idle(server)


def test_long_prompt_is_refused_without_stalling_health(server) -> None:
    """A ~1 MB prompt is tokenized off the event loop with the GIL released: /health keeps
    answering while it is, and the prompt gets its 400 for length."""
    prompt = "hello world, this is a long prompt. " * 29_000  # just under the 1 Mi-character limit
    with _HealthProbe(server) as probe:
        t0 = time.perf_counter()
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt}, timeout=60)
        took = time.perf_counter() - t0
        time.sleep(0.05)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert set(probe.codes) == {200} and len(probe.latencies) >= 3, (took, probe.latencies)
    # NOTE: before, tokenizing on the loop stalled /health for the whole 1-2 s.
    assert statistics.median(probe.latencies) < 0.1, probe.latencies
    assert max(probe.latencies) < 0.5, probe.latencies


def test_a_prompt_the_context_cannot_hold_is_refused_untokenized(server, monkeypatch) -> None:
    """More characters than max_model_len tokens can spell (each at most its vocabulary string's
    length): 400 for length before the tokenizer runs (a 3.9 MB body once held it seconds)."""
    from specdec.model.tokenizer import Tokenizer

    calls = []
    real = Tokenizer.encode_batch
    monkeypatch.setattr(
        Tokenizer, "encode_batch", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    text = "word " * 200_000
    bodies = {
        "completions": ({"prompt": text}, "prompt"),
        "chat/completions": ({"messages": [{"role": "user", "content": text}]}, "messages"),
    }
    for path, (body, param) in bodies.items():
        r = httpx.post(f"{server.url}/v1/{path}", json={**body, "max_tokens": 2}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text[:300]
        assert err["param"] == param and "characters" in err["message"]
    assert not calls
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and calls


# ---- browser safety ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_post_bodies_must_be_json(server, content_type: str | None) -> None:
    """What a web page can POST cross-origin without a preflight is refused before parsing."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = _post_raw(server, "/v1/completions", body, **{"content-type": "Application/JSON; charset=utf-8"})  # fmt: skip
    assert r.status_code == 200


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", ""]
)
def test_dns_rebinding_host_is_refused(server, host: str) -> None:
    for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/completions")):
        r = httpx.request(
            method, f"{server.url}{path}", headers={"host": host}, json={"prompt": "x"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (method, path)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "[::1]:8000"])
def test_loopback_hosts_are_accepted(server, host: str) -> None:
    assert httpx.get(f"{server.url}/health", headers={"host": host}).status_code == 200


def test_cors_is_off_unless_origins_are_given(server, trusting_server) -> None:
    preflight = {
        "origin": ORIGIN,
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    r = httpx.options(f"{server.url}/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers and r.status_code >= 400
    r = httpx.get(f"{server.url}/v1/models", headers={"origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{trusting_server.url}/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(
        f"{trusting_server.url}/v1/completions",
        headers={**preflight, "origin": "https://evil.example"},
    )
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


# ---- request chat templates ---------------------------------------------------------------------


def test_request_template_refused_unless_trusted(server) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": CHAT, "chat_template": "{{ messages[0].content }}"},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "chat_template" and err["code"] == "untrusted_chat_template"
    assert "--trust-request-chat-template" in err["message"]


@pytest.mark.parametrize("name", list(_BOMBS))
def test_template_bombs_get_400_and_health_stays_up(trusting_server, name: str) -> None:
    with _HealthProbe(trusting_server) as probe:
        t0 = time.perf_counter()
        r = httpx.post(
            f"{trusting_server.url}/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 2, "chat_template": _BOMBS[name]},
            timeout=30,
        )
        took = time.perf_counter() - t0
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template"
    assert took < 3.0, took  # the 1 s render limit, a worker restart, and a loaded machine
    assert set(probe.codes) == {200}
    # NOTE: a render on the server's loop would stall it for the 1 s limit; 0.5 s leaves room
    # for a loaded machine (a 0.5 s gap was seen with 4 jobs on 2 cores)
    assert max(probe.latencies) < 0.5, probe.latencies


def test_trusted_request_template_renders(trusting_server) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(
        f"{trusting_server.url}/v1/chat/completions", json={**body, "chat_template": template}
    )
    assert r.status_code == 200, r.text
    engine = trusting_server.server.config.app.state.llm.engine
    want = len(engine.tokenizer.encode("[user] Say something about the cat.\n", False))
    assert r.json()["usage"]["prompt_tokens"] == want
    # the worker restarts after an overrun, or a client gone mid-render, and renders the next
    httpx.post(
        f"{trusting_server.url}/v1/chat/completions",
        json={**body, "chat_template": _BOMBS["nested-loops"]},
    )
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{trusting_server.url}/v1/chat/completions",
            json={**body, "chat_template": _BOMBS["nested-loops"]},
            timeout=0.3,
        )
    for _ in range(2):
        r = httpx.post(
            f"{trusting_server.url}/v1/chat/completions", json={**body, "chat_template": template}
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == want


# ---- tenants -------------------------------------------------------------------------------------


def test_cache_salt_keeps_prefixes_apart(server) -> None:
    url = f"{server.url}/v1/completions"
    prompt = "The secret plan of tenant A is to buy seven lighthouses."
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}

    def cached(**extra: str) -> tuple[int, int]:
        usage = httpx.post(url, json={**body, **extra}).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    first, n = cached(cache_salt="tenant-a")
    assert first == 0
    assert cached(cache_salt="tenant-a") == (n - 1, n)  # the same tenant shares its prefix
    assert cached(cache_salt="tenant-b")[0] == 0  # another tenant learns nothing
    assert cached()[0] == 0  # nor does an unsalted request


# ---- logs -------------------------------------------------------------------------------------


def test_client_text_is_logged_escaped(server, caplog) -> None:
    caplog.set_level(logging.INFO)
    forged = "x\nCRITICAL root: forged line\r\x1b[31m"
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 1, forged: 1},
    )
    assert r.status_code == 200
    lines = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "\r" not in lines[0]
    assert "\x1b" not in lines[0] and "\\nCRITICAL" in lines[0]


def test_unexpected_error_is_one_line_with_request_id(server, monkeypatch, caplog) -> None:
    serving = server.server.config.app.state.serving

    async def broken(req, rid=None):
        raise RuntimeError("surprise\nsecond line")

    monkeypatch.setattr(serving, "create_completion", broken)
    caplog.set_level(logging.DEBUG, logger="specdec")
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
    monkeypatch.undo()
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_server_error" and "cmpl-" in err["message"]
    rid = err["message"].rsplit(" ", 1)[1]
    errors = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(errors) == 1 and rid in errors[0].getMessage() and errors[0].exc_info is None
    assert "\n" not in errors[0].getMessage()


@pytest.mark.parametrize("stream", [False, True])
def test_failure_during_generation_is_short_and_logged_once(server, monkeypatch, caplog, stream: bool) -> None:  # fmt: skip
    """A request the engine fails (finish_reason "error"): the client gets a fixed message with
    the request id, never the exception's text; the log one line with the exception's type."""
    from specdec.worker import model_runner

    def broken(*args, **kw):
        raise KeyError("client text SECRET\nparser state: {...}")

    monkeypatch.setattr(model_runner, "verify", broken)
    caplog.set_level(logging.DEBUG, logger="specdec")
    body = {"prompt": "hi", "max_tokens": 4, "stream": stream}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    monkeypatch.undo()
    if stream:
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        err = json.loads(r.text.strip().split("\n\n")[-2][6:])["error"]
    else:
        assert r.status_code == 500
        err = r.json()["error"]
    assert re.fullmatch(r"request (cmpl-\w+) failed: sampling failed", err["message"]), err
    assert err["type"] == "internal_server_error"
    rid = err["message"].split(" ")[1]
    lines = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(lines) == 1 and rid in lines[0].getMessage() and lines[0].exc_info is None
    assert "KeyError" in lines[0].getMessage() and "\n" not in lines[0].getMessage()


# ---- shutdown ----------------------------------------------------------------------------------


def _read_stream(srv, body: dict, out: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)
                started.set()


def test_shutdown_ends_running_streams_with_error_and_done(tiny_llama) -> None:
    """Past the shutdown timeout, running streams end with an error event and [DONE]; new
    requests get a 503 meanwhile, and /health says so."""
    srv = _start(str(tiny_llama), app={"shutdown_timeout": 1.0})
    body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    outs: list[list[str]] = [[] for _ in range(3)]
    started = [threading.Event() for _ in outs]
    with _SlowSteps(srv, delay=0.05):  # 200 tokens: ~10 s per stream
        readers = [
            threading.Thread(target=_read_stream, args=(srv, body, out, ev))
            for out, ev in zip(outs, started)
        ]
        for t in readers:
            t.start()
        assert all(ev.wait(10) for ev in started)
        t0 = time.perf_counter()
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        time.sleep(0.3)
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        for t in readers:
            t.join(15)
        stopper.join(15)
        took = time.perf_counter() - t0
    assert 0.9 < took < 6.0, took
    for out in outs:
        assert out[-1] == "data: [DONE]", out[-3:]
        err = json.loads(out[-2][6:])["error"]
        assert "shutting down" in err["message"] and err["type"] == "service_unavailable"
        assert any('"text"' in line for line in out[:-2])  # it was streaming before


def test_shutdown_lets_running_requests_finish(tiny_llama) -> None:
    srv = _start(str(tiny_llama), app={"shutdown_timeout": 10.0})
    body = {"prompt": "hi", "max_tokens": 30, "ignore_eos": True, "stream": True}
    out: list[str] = []
    started = threading.Event()
    with _SlowSteps(srv, delay=0.05):  # ~1.5 s
        reader = threading.Thread(target=_read_stream, args=(srv, body, out, started))
        reader.start()
        assert started.wait(10)
        srv.stop()
        reader.join(15)
    assert out[-1] == "data: [DONE]"
    assert json.loads(out[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sigterm_under_load_ends_streams_properly(tiny_llama) -> None:
    """`specdec serve` in a subprocess, one seat and a queue of streams: SIGTERM stops admitting,
    lets the running ones go on for --shutdown-timeout, then ends every stream still open with an
    error event and [DONE], and exits. Also its defaults: loopback Host names only, JSON bodies
    only, request templates refused."""
    with serve(
        str(tiny_llama), "--max-model-len", "512", "--max-num-seqs", "1",
        "--shutdown-timeout", "0.5", "--uvicorn-log-level", "warning", timeout=60, grace=0,
    ) as srv:  # fmt: skip
        proc, url = srv.proc, srv.url
        assert httpx.get(f"{url}/health", headers={"host": "evil.example"}).status_code == 400
        r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x"}')
        assert r.status_code == 415
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": CHAT, "chat_template": "{{ 1 }}"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
        outs: list[list[str]] = [[] for _ in range(12)]
        started = [threading.Event() for _ in outs]
        readers = [
            threading.Thread(target=_read_stream_url, args=(url, body, out, ev))
            for out, ev in zip(outs, started)
        ]
        for t in readers:
            t.start()
        # NOTE: SIGTERM only once the whole queue reached the server: on a loaded machine the
        # later clients may connect after the first stream has run its 500 tokens
        _wait_queued(url, len(outs) - 1)
        assert any(ev.wait(30) for ev in started)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        try:  # new requests: 503 while draining, or refused once the listener closed
            late = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=5)
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        for t in readers:
            t.join(30)
        proc.wait(30)
        took = time.perf_counter() - t0
    log = srv.log()
    assert proc.returncode in (0, -signal.SIGTERM), log
    assert took < 10, took
    ended = 0
    for out in outs:
        if len(out) == 1 and not out[0].startswith("data:"):
            # NOTE: this client's request reached the server after SIGTERM: a 503, never admitted
            assert json.loads(out[0])["error"]["message"] == "the server is shutting down", out
            continue
        assert out and out[-1] == "data: [DONE]", (out[-2:], log)
        last = json.loads(out[-2][6:])
        if "error" in last:
            assert "shutting down" in last["error"]["message"]
            ended += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert ended >= 1, log  # 12 x 500 tokens one at a time outlast 0.5 s
    assert "Traceback" not in log and "ended" in log, log


def test_sigterm_while_requests_are_prepared_answers_503s_and_exits_at_once(tiny_llama) -> None:
    """Requests still being prepared (16 of 128 prompts of ~6.6k characters, each just within
    what 512 tokens can spell: seconds of tokenizing on two threads) when SIGTERM comes get a
    JSON 503 at once, and the process exits without waiting for them; the log has no traceback.
    Before: plain-text 500s from uvicorn, a 60-line traceback each, and the exit after
    --shutdown-timeout + 6 s."""
    # NOTE: a longer prompt is refused for length before tokenizing (max_token_chars)
    prompt = ["hello world, this is a long prompt. " * 180] * 128
    answers: list[httpx.Response | Exception] = []

    def post() -> None:
        try:
            answers.append(httpx.post(f"{url}/v1/completions", json={"prompt": prompt}, timeout=60))
        except httpx.TransportError as e:
            answers.append(e)

    with serve(
        str(tiny_llama), "--max-model-len", "512", "--shutdown-timeout", "0.5",
        "--uvicorn-log-level", "warning", timeout=60, grace=0,
    ) as srv:  # fmt: skip
        proc, url = srv.proc, srv.url
        clients = [threading.Thread(target=post) for _ in range(16)]
        for t in clients:
            t.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        took = time.perf_counter() - t0
        for t in clients:
            t.join(30)
    log = srv.log()
    assert proc.returncode in (0, -signal.SIGTERM), log
    # NOTE: no speed goal: the 3 s flush and uvicorn's 3 s grace it no longer waits for
    assert took < 3.5, (took, log)
    codes = [a.status_code if isinstance(a, httpx.Response) else type(a).__name__ for a in answers]
    assert len(answers) == 16 and set(codes) <= {400, 503} and 503 in codes, (codes, log)
    for a in answers:
        assert a.headers["content-type"] == "application/json", a.text[:200]
        if a.status_code == 503:
            err = a.json()["error"]
            assert err["message"] == "the server is shutting down", err
            assert err["type"] == "service_unavailable"
        else:  # prepared before SIGTERM: the prompt is too long for the model
            assert a.json()["error"]["code"] == "context_length_exceeded"
    assert "Traceback" not in log and not any(line[:1].isspace() for line in log.splitlines()), log


def _read_stream_url(url: str, body: dict, out: list[str], started: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    out.append(line)
                    started.set()
    except httpx.TransportError as e:  # a stream cut short shows as a missing [DONE]
        out.append(f"transport error: {e}")


def _wait_queued(url: str, waiting: int, timeout: float = 60) -> None:
    """Until the server's gauge shows at least ``waiting`` requests queued."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        m = re.search(r"^specdec:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M)
        if m and float(m.group(1)) >= waiting:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {waiting} requests queued after {timeout} s")
