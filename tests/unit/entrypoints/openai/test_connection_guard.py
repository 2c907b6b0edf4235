"""Request-head limits below the HTTP parser (entrypoints/openai/connection.py), over raw sockets
against uvicorn with a small ASGI app, for both of uvicorn's parsers: HTTP/0.9, a slowloris
trickle, idle connections, an oversized head, a slow second head on a keep-alive connection, a
bad request line after a kept-alive request, pipelined requests split across reads, a trickled
body, and a streamed response that lasts longer than the head timeout."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from specdec.entrypoints.openai.connection import HeadLimits, guarded_protocol

TIMEOUT_S = 1.5
CAP = 4
BODY_TIMEOUT_S = 2.0
LIMITS = HeadLimits(
    timeout_s=TIMEOUT_S,
    max_pending_per_client=CAP,
    max_head_bytes=4096,
    over_cap_grace_s=0.3,
    body_timeout_s=BODY_TIMEOUT_S,
)
SLACK_S = 1.5  # scheduling on a loaded 2-core machine
AT_ONCE_S = TIMEOUT_S / 2
OK = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def _app(scope, receive, send) -> None:  # noqa: ANN001
    if scope["type"] != "http":
        return
    if scope["method"] == "POST":  # the whole body first, as the server's routes read it
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size, more = size + len(message.get("body", b"")), message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"got %d" % size})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if scope["path"] == "/stream":  # 2.5 head timeouts long
        for _ in range(5):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            await asyncio.sleep(TIMEOUT_S / 2)
        await send({"type": "http.response.body", "body": b"end"})
        return
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module", params=["httptools", "h11"])
def port(request):
    pytest.importorskip(request.param)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        _app, http=guarded_protocol(LIMITS, request.param), log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    sock.close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_all(conn: socket.socket, limit_s: float = TIMEOUT_S + 5) -> tuple[bytes, float]:
    """Everything until the server closes the connection, and how long that took."""
    start = time.monotonic()
    conn.settimeout(limit_s)
    out = b""
    while True:
        data = conn.recv(65536)
        if not data:
            return out, time.monotonic() - start
        out += data


def _error(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]


def _normal_request_succeeds(port: int) -> None:
    with _connect(port) as conn:
        conn.sendall(OK)
        response, took = _read_all(conn)
    assert response.startswith(b"HTTP/1.1 200") and b"\r\nok\r\n" in response
    assert took < AT_ONCE_S


def test_http09_request_line_is_a_400_at_once(port) -> None:
    with _connect(port) as conn:
        conn.sendall(b"GET /\r\n")
        response, took = _read_all(conn)
    assert response.startswith(b"HTTP/1.1 400")
    assert _error(response)["code"] == "invalid_request_line"
    assert took < AT_ONCE_S


def _trickle(conn: socket.socket, every_s: float, limit_s: float) -> tuple[bytes, float]:
    """A byte every ``every_s`` until the server answers (or closes): its answer, and when."""
    start, response = time.monotonic(), b""
    conn.settimeout(every_s)
    while time.monotonic() - start < limit_s:
        try:
            conn.sendall(b"X")
            response = conn.recv(65536)
            break
        except TimeoutError:
            continue
        except OSError:
            break
    return response, time.monotonic() - start


def test_slowloris_trickle_is_closed_at_the_head_timeout(port) -> None:
    with _connect(port) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        response, took = _trickle(conn, 0.1, TIMEOUT_S + SLACK_S + 2)
    assert response.startswith(b"HTTP/1.1 408"), response[:40]
    assert _error(response)["code"] == "request_timeout"
    assert TIMEOUT_S - 0.1 < took < TIMEOUT_S + SLACK_S


def test_idle_connections_are_closed_and_capped_while_others_are_served(port) -> None:
    idle = [_connect(port) for _ in range(3 * CAP)]
    try:
        time.sleep(LIMITS.over_cap_grace_s + 0.6)
        _normal_request_succeeds(port)
        open_now = 0
        for conn in idle:
            conn.settimeout(0.05)
            try:
                open_now += conn.recv(1) != b""
            except TimeoutError:
                open_now += 1
            except OSError:
                pass
        assert open_now <= CAP  # those beyond the cap went after the grace
        for conn in idle:  # the rest at the head timeout, silently (they sent nothing)
            conn.settimeout(TIMEOUT_S + SLACK_S)
            try:
                assert conn.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        for conn in idle:
            conn.close()
    _normal_request_succeeds(port)


def test_oversized_head_is_a_431(port) -> None:
    with _connect(port) as conn:
        try:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000)
        except OSError:
            pass
        response, took = _read_all(conn)
    # NOTE: h11 has a bound of its own (uvicorn's h11_max_incomplete_event_size): a 400 when the
    # head passes both in one read
    assert response[:12] in (b"HTTP/1.1 431", b"HTTP/1.1 400")
    assert took < AT_ONCE_S


def test_keep_alive_second_head_is_timed_too(port) -> None:
    with _connect(port) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        response, took = _read_all(conn)
    assert response.startswith(b"HTTP/1.1 200")
    assert b"HTTP/1.1 408" in response
    assert took < TIMEOUT_S + SLACK_S


def test_bad_request_line_after_a_kept_alive_request_is_a_400_at_once(port) -> None:
    with _connect(port) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.settimeout(5)
        first = b""
        while b"\r\nok" not in first:
            first += conn.recv(65536)
        conn.sendall(b"GET /\r\n")  # HTTP/0.9 on the kept-alive connection
        response, took = _read_all(conn)
    assert first.startswith(b"HTTP/1.1 200")
    assert response.startswith(b"HTTP/1.1 400"), response[:40]
    assert _error(response)["code"] == "invalid_request_line"
    assert took < AT_ONCE_S


def test_pipelined_requests_split_mid_line_are_served(port) -> None:
    """The next request's line split across reads (its start in the read that ended the first
    request) is not taken for a request line of its own."""
    with _connect(port) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /pa")
        time.sleep(0.2)
        conn.sendall(b"th HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        response, took = _read_all(conn)
    assert response.count(b"HTTP/1.1 200") == 2, response
    assert took < AT_ONCE_S


def test_a_body_in_time_is_read_and_a_trickled_one_is_a_408(port) -> None:
    with _connect(port) as conn:
        conn.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nConnection: close\r\n\r\n"
        )
        time.sleep(0.3)
        conn.sendall(b"0123456789")
        response, _ = _read_all(conn)
    assert response.startswith(b"HTTP/1.1 200") and b"\r\ngot 10\r\n" in response
    with _connect(port) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        # a byte every 0.2 s: never idle, never complete
        response, took = _trickle(conn, 0.2, BODY_TIMEOUT_S + SLACK_S + 2)
    assert response.startswith(b"HTTP/1.1 408"), response[:40]
    assert "body" in _error(response)["message"]
    assert BODY_TIMEOUT_S - 0.1 < took < BODY_TIMEOUT_S + SLACK_S


def test_head_bytes_are_counted_across_reads(port) -> None:
    with _connect(port) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        for _ in range(6):
            time.sleep(0.02)
            try:
                conn.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
            except OSError:
                break
        response, took = _read_all(conn)
    assert response.startswith(b"HTTP/1.1 431")
    assert _error(response)["code"] == "request_header_fields_too_large"


def test_a_stream_longer_than_the_head_timeout_is_not_cut(port) -> None:
    with _connect(port) as conn:
        conn.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        response, took = _read_all(conn, 10)
    assert response.startswith(b"HTTP/1.1 200")
    assert response.endswith(b"3\r\nend\r\n0\r\n\r\n")
    assert took > 2 * TIMEOUT_S


def test_limits_are_checked() -> None:
    for bad in (
        {"timeout_s": -1},
        {"timeout_s": float("nan")},
        {"max_pending_per_client": -1},
        {"body_timeout_s": float("inf")},
        {"body_timeout_s": -2},
    ):
        with pytest.raises(ValueError):
            HeadLimits(**bad)
    with pytest.raises(ValueError):
        guarded_protocol(LIMITS, "zttp")


def test_server_flags_give_the_limits() -> None:
    import argparse

    from specdec.config import ConfigError
    from specdec.entrypoints.openai.server_args import head_limits, make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args(["--body-read-timeout", "5", "--header-read-timeout", "2"])
    limits = head_limits(args)
    assert limits.body_timeout_s == 5.0 and limits.timeout_s == 2.0
    assert head_limits(parser.parse_args([])).body_timeout_s == 60.0
    for flag in ("--body-read-timeout", "--header-read-timeout"):
        with pytest.raises(ConfigError, match=flag):
            head_limits(parser.parse_args([flag, "-1"]))
