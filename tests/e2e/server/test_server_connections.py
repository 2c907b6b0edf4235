"""The server's request-head limits against hostile connections (raw sockets): HTTP/0.9, a
slowloris trickle and a flood of idle connections are each closed within the bound while a
normal client's requests, a stream included, are served."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from specdec.config import EngineConfig
from specdec.engine.async_llm import AsyncLLM
from specdec.entrypoints.openai.api_server import BackgroundServer, build_app
from specdec.entrypoints.openai.connection import HeadLimits

TIMEOUT_S = 2.0
CAP = 8
CHAT = {"messages": [{"role": "user", "content": "Say something about the cat."}]}


@pytest.fixture(scope="module")
def server(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), max_model_len=256, max_num_seqs=4)
    llm = AsyncLLM.from_config(config, log_stats=False)
    limits = HeadLimits(timeout_s=TIMEOUT_S, max_pending_per_client=CAP, over_cap_grace_s=0.5)
    srv = BackgroundServer(build_app(llm, ["tiny"]), head_limits=limits).start()
    yield srv
    srv.stop()


def _connect(srv: BackgroundServer) -> socket.socket:
    return socket.create_connection((srv.host, srv.port), timeout=10)


def _closed_within(conn: socket.socket, limit_s: float) -> tuple[bytes, float]:
    start = time.monotonic()
    conn.settimeout(limit_s)
    out = b""
    try:
        while data := conn.recv(65536):
            out += data
    except ConnectionResetError:
        pass
    return out, time.monotonic() - start


def _chat_works(srv: BackgroundServer, stream: bool = False) -> None:
    body = {**CHAT, "max_tokens": 8, "stream": stream}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")


def test_http09_is_refused_at_once(server) -> None:
    with _connect(server) as conn:
        conn.sendall(b"GET /health\r\n")
        response, took = _closed_within(conn, TIMEOUT_S + 5)
    assert response.startswith(b"HTTP/1.1 400") and took < TIMEOUT_S / 2
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_request_line"


def test_slowloris_and_idle_flood_are_closed_while_clients_are_served(server) -> None:
    slow = _connect(server)  # NOTE: first: those beyond the cap are closed early (429)
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
    start = time.monotonic()
    idle = [_connect(server) for _ in range(4 * CAP)]
    try:
        _chat_works(server)
        _chat_works(server, stream=True)
        slow.settimeout(0.2)
        response = b""
        while time.monotonic() - start < TIMEOUT_S + 5 and not response:
            try:
                slow.sendall(b"x")
                response = slow.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
        assert response.startswith(b"HTTP/1.1 408")
        assert time.monotonic() - start < TIMEOUT_S + 1.5
        for conn in idle:
            _, took = _closed_within(conn, TIMEOUT_S + 2)
            assert took < TIMEOUT_S + 2
        _chat_works(server)
    finally:
        slow.close()
        for conn in idle:
            conn.close()


def test_a_stream_longer_than_the_head_timeout_runs_to_its_end(server) -> None:
    body = {**CHAT, "max_tokens": 120, "ignore_eos": True, "stream": True}
    start, events = time.monotonic(), []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                time.sleep(TIMEOUT_S / 40)  # a slow reader: the stream outlasts the timeout
    assert events[-1] == "data: [DONE]"
    assert time.monotonic() - start > TIMEOUT_S
