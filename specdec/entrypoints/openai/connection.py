"""Connection handling below the HTTP parser: each request head must arrive in bounded time.

uvicorn bounds the idle time between requests (``timeout_keep_alive``) but not the time a client
takes to send a request head: a connection that sends ``GET /\\r\\n`` (HTTP/0.9, no headers) or
trickles one header byte a second was held open indefinitely, and a hundred of them exhausted the
server. ``guarded_protocol`` subclasses uvicorn's HTTP protocol (httptools, or h11) so that

* a request head (request line and headers) must be complete within ``HeadLimits.timeout_s`` of
  the connection opening or of the request's first byte; otherwise the connection is closed, with
  a 408 when the client has sent part of a head (a connection that sent nothing is closed
  silently, as a keep-alive timeout closes it: a client may have it pooled);
* a request line that does not end in ``HTTP/1.0`` or ``HTTP/1.1`` is answered 400 at once, the
  first on a connection or one after a kept-alive request;
* a head larger than ``max_head_bytes`` is answered 431 (httptools sets no bound of its own);
* one client address may hold at most ``max_pending_per_client`` connections whose head is due:
  those beyond it are closed with a 429 after ``over_cap_grace_s`` if the address is still over.

* a request body must be complete within ``HeadLimits.body_timeout_s`` of its head (a client
  that trickles a declared body is answered 408 and closed, as a slow head is).

Only the request is timed: once it has arrived, a long generation or a stream runs for as long as
it runs.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_HEADER_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_PENDING_PER_CLIENT = 32
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
# RFC 9112 3: method SP request-target SP HTTP-version (3.1: the method is a token)
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [^\x00-\x20\x7f]+ HTTP/1\.[01]")


@dataclass(frozen=True)
class HeadLimits:
    """Bounds on reading a request head (0 turns one off)."""

    timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S
    max_pending_per_client: int = DEFAULT_MAX_PENDING_PER_CLIENT
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    body_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    # NOTE: a client's burst of connections is counted before any has been read (the event loop
    # accepts a batch, then reads), so the cap is applied to those still pending a moment later
    over_cap_grace_s: float = 1.0

    def __post_init__(self) -> None:
        for name, value in (("header", self.timeout_s), ("body", self.body_timeout_s)):
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"{name} read timeout must be a finite number >= 0, got {value}")
        if self.max_pending_per_client < 0:
            raise ValueError(
                f"pending connections per client must be >= 0, got {self.max_pending_per_client}"
            )
        if self.max_head_bytes < 0:
            raise ValueError(f"request head bytes must be >= 0, got {self.max_head_bytes}")


def _error_response(status: int, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-style error body, closing the connection."""
    # NOTE: RequestError.body()'s shape, without importing pydantic into a refusal
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _HeadDeadline:
    """The part shared by both parsers' protocols. The subclass calls ``_head_begin`` when a
    head is due, ``_head_end`` when it is complete, and ``_head_admit`` / ``_head_fed`` around
    feeding the parser."""

    _limits: HeadLimits
    _pending: dict[str, int]  # client address -> its connections whose head is due
    # from uvicorn's protocols
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._head_init()
        self._head_begin()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_end()
        self._body_end()
        super().connection_lost(exc)  # type: ignore[misc]

    def _head_init(self) -> None:
        self._head_due = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_deadline = math.inf
        self._head_bytes = 0
        self._first_line: bytearray | None = bytearray()  # until a request line is read
        self._body_timer: asyncio.TimerHandle | None = None
        # a request ended and none began after it in the bytes read so far: the next bytes start
        # a request line, checked as the first one is
        self._between_requests = False

    def _client_key(self) -> str:
        return self.client[0] if self.client else ""

    def _head_begin(self) -> None:
        if self._head_due or self.transport.is_closing():
            return
        self._head_due = True
        self._head_bytes = 0
        key = self._client_key()
        self._pending[key] = num = self._pending.get(key, 0) + 1
        limits = self._limits
        if limits.timeout_s:
            self._head_deadline = self.loop.time() + limits.timeout_s
        cap = limits.max_pending_per_client
        delay = min(
            limits.timeout_s or math.inf, limits.over_cap_grace_s if cap and num > cap else math.inf
        )
        if delay != math.inf:
            self._head_timer = self.loop.call_later(delay, self._head_check)

    def _head_end(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if not self._head_due:
            return
        self._head_due = False
        self._head_deadline = math.inf
        key = self._client_key()
        left = self._pending.get(key, 1) - 1
        if left > 0:
            self._pending[key] = left
        else:
            self._pending.pop(key, None)

    def _head_check(self) -> None:
        self._head_timer = None
        if not self._head_due:
            return
        cap = self._limits.max_pending_per_client
        if cap and self._pending.get(self._client_key(), 0) > cap:
            self._refuse(
                429,
                "too_many_connections",
                f"more than {cap} connections from this address are still sending a request "
                "head; connection closed",
            )
            return
        left = self._head_deadline - self.loop.time()
        if left <= 0.001:
            self._refuse(
                408,
                "request_timeout",
                f"the request head was not complete within {self._limits.timeout_s:g} s; "
                "connection closed",
            )
        elif left != math.inf:
            self._head_timer = self.loop.call_later(left, self._head_check)

    def _body_begin(self) -> None:
        """A head is complete: its body (if any) is due within ``body_timeout_s``."""
        self._between_requests = False
        if self._limits.body_timeout_s and self._body_timer is None:
            self._body_timer = self.loop.call_later(self._limits.body_timeout_s, self._body_late)

    def _body_end(self) -> None:
        """A request is complete (or the connection gone): nothing more is due."""
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_late(self) -> None:
        self._body_timer = None
        self._refuse(
            408,
            "request_timeout",
            f"the request body was not complete within {self._limits.body_timeout_s:g} s; "
            "connection closed",
            body=True,
        )

    def _next_request_line(self) -> None:
        """After feeding the parser: if a request ended and no other began, the next bytes are a
        request line, to be checked before the parser sees them."""
        if self._between_requests and self._first_line is None:
            self._first_line = bytearray()
        self._between_requests = False

    def _refuse(self, status: int, code: str, message: str, body: bool = False) -> None:
        """Close the connection, answering ``status`` if a response can be written: not while a
        response of an earlier request on it is being sent, nor to a client that sent nothing.
        ``body``: the current request's body is late (its response has not begun)."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if body:
            sent_part, responding = True, cycle is not None and cycle.response_started
        else:
            sent_part = self._head_bytes > 0 or bool(self._first_line)
            responding = cycle is not None and not cycle.response_complete
        self._head_end()
        self._body_end()
        logger.debug("closing a connection from %s: %d %s", self._client_key() or "?", status, code)
        if sent_part and not responding:
            self.transport.write(_error_response(status, code, message))
        self.transport.close()

    def _head_admit(self, data: bytes) -> bool:
        """Before the parser sees ``data``: False if the connection is closed or refused."""
        if self.transport.is_closing():
            return False
        if self._first_line is None:
            return True
        self._first_line += data
        # NOTE: RFC 9112 2.2: empty lines before the request line are ignored
        line = self._first_line.lstrip(b"\r\n")
        end = line.find(b"\n")
        if end < 0:
            if len(self._first_line) > (self._limits.max_head_bytes or DEFAULT_MAX_HEAD_BYTES):
                self._first_line = None  # no line yet: _head_fed answers a head too large
            return True
        self._first_line = None
        if _REQUEST_LINE.fullmatch(line[:end].rstrip(b"\r")) is None:
            self._head_bytes = len(data)
            self._refuse(
                400,
                "invalid_request_line",
                "the request line must be 'METHOD TARGET HTTP/1.1' (or HTTP/1.0); connection closed",
            )
            return False
        return True

    def _head_fed(self, num_bytes: int) -> None:
        """After the parser saw ``num_bytes`` more: a 431 if the head due is too large."""
        if not self._head_due or self.transport.is_closing():
            return
        self._head_bytes += num_bytes
        cap = self._limits.max_head_bytes
        if cap and self._head_bytes > cap:
            self._refuse(
                431,
                "request_header_fields_too_large",
                f"the request head is larger than {cap} bytes; connection closed",
            )


def _httptools_protocol(limits: HeadLimits) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(_HeadDeadline, HttpToolsProtocol):
        _limits = limits
        _pending: dict[str, int] = {}

        def data_received(self, data: bytes) -> None:
            if self._head_admit(data):
                super().data_received(data)
                self._head_fed(len(data))
                self._next_request_line()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._between_requests = False
            self._head_begin()

        def on_headers_complete(self) -> None:
            self._head_end()
            self._body_begin()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._body_end()
            super().on_message_complete()
            self._between_requests = True

    return GuardedHttpToolsProtocol


def _h11_protocol(limits: HeadLimits) -> type[asyncio.Protocol]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(_HeadDeadline, H11Protocol):
        _limits = limits
        _pending: dict[str, int] = {}
        _read_a_request = False  # a request head has been read on this connection

        def data_received(self, data: bytes) -> None:
            # NOTE: h11 is IDLE until a request head is complete (and between requests, where
            # uvicorn's keep-alive timeout runs until a byte arrives), then SEND_BODY, then DONE
            # until uvicorn starts the next cycle; bytes it holds unread are part of a request
            self._between_requests = (
                self._read_a_request
                and self.conn.their_state in (h11.IDLE, h11.DONE)
                and not self.conn.trailing_data[0]
            )
            self._next_request_line()
            if not self._head_admit(data):
                return
            if self.conn.their_state is h11.IDLE:
                self._head_begin()
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE:
                self._head_fed(len(data))
                return
            self._read_a_request = True
            if self._head_due:  # the head is complete
                self._head_end()
                self._body_begin()
            if state is not h11.SEND_BODY:
                self._body_end()

    return GuardedH11Protocol


def guarded_protocol(limits: HeadLimits, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``http``: "auto" = httptools when installed, else h11, as
    uvicorn picks) with ``limits`` on reading request heads; pass it as ``uvicorn.Config(http=)``.
    Each call makes a class of its own, counting its own server's connections."""
    if http == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            http = "h11"
        else:
            http = "httptools"
    if http == "httptools":
        return _httptools_protocol(limits)
    if http == "h11":
        return _h11_protocol(limits)
    raise ValueError(f"http must be 'auto', 'httptools' or 'h11', got {http!r}")
