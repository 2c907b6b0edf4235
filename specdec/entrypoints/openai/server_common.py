"""What every OpenAI front shares in front of its routes: the single server (``api_server``),
the replica front and the Ray Serve ingress (``entrypoints/replicas``).

``RequestGuard`` (ASGI middleware): the Host check (``--allowed-hosts``; DNS rebinding), POST
bodies only as ``application/json`` (a cross-origin "simple" POST from a web page cannot be),
503 while shutting down, the in-flight count, error answers of a client that keeps failing held
back while others are served (``error_backoff``), and one log line, never a traceback, for an
unexpected failure. Then the API key, the body limit (``read_body``), the request models'
validation (``parse_request``), client disconnects (``with_cancellation``) and the health
routes.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import asyncio
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from specdec.entrypoints.openai.error_backoff import ErrorBackoff


@dataclass
class ServerState:
    """What the guard middleware and the shutdown drain share."""

    allowed_hosts: list[str] | None
    draining: bool = False
    in_flight: int = 0  # POST requests being answered (streams included)
    # a failing client's error answers wait while others are served (None: never)
    error_backoff: ErrorBackoff | None = None
    # a replica's: requests its front relays (signed) had their errors held back there
    forwarded_secret: str | None = None


def api_key_dependency(api_key: str | None) -> Callable[..., Any]:
    """The routers' dependency that checks ``Authorization: Bearer <api_key>`` (constant-time;
    a 401 in OpenAI's shape); nothing is checked when ``api_key`` is None."""
    from fastapi import Request

    from specdec.entrypoints.openai.protocol import RequestError

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError(
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                status=401,
                code="invalid_api_key",
                type="authentication_error",
            )

    return check_api_key


# A replica behind a front (``--data-parallel-size``, Ray Serve) sees every request come from
# the front; the front names the caller (its ``client_lane``) in CLIENT_HEADER, signed with a
# secret it generated and gave only to the replicas it started (FORWARDED_CLIENT_SECRET_ENV).
# A server without the secret, or a request without the matching signature, is its own caller.
CLIENT_HEADER = "x-specdec-client"
CLIENT_SIGNATURE_HEADER = "x-specdec-client-signature"
FORWARDED_CLIENT_SECRET_ENV = "SPECDEC_FORWARDED_CLIENT_SECRET"


def client_signature(lane: str, secret: str) -> str:
    """The front's signature of a forwarded ``lane`` (HMAC-SHA256 under ``secret``)."""
    return hmac.new(secret.encode(), lane.encode("utf-8", "replace"), hashlib.sha256).hexdigest()


def forwarded_client_headers(lane: str, secret: str) -> dict[str, str]:
    """The headers a front adds to a request it relays: who sent it, signed."""
    return {CLIENT_HEADER: lane, CLIENT_SIGNATURE_HEADER: client_signature(lane, secret)}


def forwarded_client(headers: Any, secret: str | None) -> str | None:
    """The caller a front named in ``headers``, when signed with ``secret`` (else None)."""
    lane = headers.get(CLIENT_HEADER)
    if not secret or not lane:
        return None
    given = headers.get(CLIENT_SIGNATURE_HEADER, "")
    want = client_signature(lane, secret)
    if not hmac.compare_digest(given.encode("utf-8", "replace"), want.encode()):
        return None
    return lane


def client_lane(request: Any, forwarded_secret: str | None = None) -> str:
    """Who sent ``request``, for per-client lanes in shared queues: a hash of its API key, else
    its host (NOTE: not the connection: a client opens as many of those as it likes). With
    ``forwarded_secret`` (a replica behind a front), the caller its front named, when signed."""
    forwarded = forwarded_client(request.headers, forwarded_secret)
    if forwarded is not None:
        return forwarded
    key = request.headers.get("authorization") or request.headers.get("x-api-key")
    if key:
        return "key:" + hashlib.blake2b(key.encode("utf-8", "replace"), digest_size=8).hexdigest()
    peer = request.client
    return f"host:{peer.host}" if peer else "host:?"


async def read_body(request: Any, limit: int, error: type) -> bytes:
    """The body's bytes, refusing bodies over ``limit`` bytes (413)."""
    too_large = error(
        f"request body is larger than the {limit // (1024 * 1024)} MiB limit",
        status=413,
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def parse_request(body: bytes, model: Any) -> Any:
    """The body as a request ``model`` (on the preparation pool: parsing holds the GIL)."""
    from specdec.entrypoints.openai.safety import parse_json_body

    return validated(parse_json_body(body), model)


def validated(data: Any, model: Any) -> Any:
    """``data`` (parsed JSON) as a request ``model``; a RequestError naming the field."""
    from pydantic import ValidationError

    from specdec.entrypoints.openai.protocol import validation_error

    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def wait_until(
    done: Callable[[], bool], loop: asyncio.AbstractEventLoop, timeout: float
) -> None:
    deadline = loop.time() + timeout
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.05)


class RequestGuard:
    """ASGI middleware in front of every route: the Host check, JSON-only POST bodies, 503 while
    shutting down, the in-flight count, and one log line for an unexpected failure."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        post = scope["method"] == "POST"
        refusal = self._refusal(scope)
        if refusal is not None:
            await self._hold_error(refusal.status, scope, own=0)
            await send_error(refusal, scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                await self._hold_error(message["status"], scope, own=int(post))
            await send(message)

        self.state.in_flight += post
        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001 - answer it and log one line, never a traceback
            from specdec.entrypoints.openai.protocol import random_id
            from specdec.entrypoints.openai.serving_utils import internal_error

            rid = scope.get("state", {}).get("request_id") or random_id("req")
            err = internal_error(e, rid)
            if not started:
                await send_error(err, scope, receive, send)
        finally:
            self.state.in_flight -= post

    async def _hold_error(self, status: int, scope: dict, own: int) -> None:
        """Count a failing answer against its client and, while other requests are in flight
        (beyond ``own``, this request's count in ``in_flight``), wait as long as
        ``ErrorBackoff`` says before it is sent."""
        backoff = self.state.error_backoff
        if backoff is None or not backoff.counts(status):
            return
        headers = _headers(scope)
        if forwarded_client(headers, self.state.forwarded_secret) is not None:
            return  # NOTE: relayed by a front, which holds its clients' errors back itself
        peer = scope.get("client")
        delay = backoff.failed(f"host:{peer[0]}" if peer else "host:?")
        if delay > 0 and self.state.in_flight > own:
            await asyncio.sleep(delay)

    def _refusal(self, scope: dict) -> Any:
        from specdec.entrypoints.openai.protocol import RequestError
        from specdec.entrypoints.openai.safety import host_allowed

        headers = _headers(scope)
        if not host_allowed(headers.get("host"), self.state.allowed_hosts):
            return RequestError(
                "the Host header does not name this server (see --allowed-hosts)",
                status=400,
                code="invalid_host",
            )
        if scope["method"] != "POST":
            return None
        if self.state.draining:
            from specdec.entrypoints.openai.serving_utils import shutting_down_error

            return shutting_down_error()
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            # NOTE: a web page can POST text/plain, form data or an untyped body to any address
            # without asking (a CORS "simple" request); it cannot send application/json so.
            return RequestError(
                "request bodies must be sent with 'Content-Type: application/json'",
                status=415,
                code="unsupported_media_type",
            )
        return None


def _headers(scope: dict) -> dict[str, str]:
    """An ASGI request's headers, names in lower case."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def send_error(err: Any, scope: dict, receive: Callable, send: Callable) -> None:
    from fastapi.responses import JSONResponse

    await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)


DISCONNECTED = object()


async def until_done_or(work: asyncio.Future, stop: asyncio.Future) -> None:
    """Wait until ``work`` is done or ``stop`` is; then ``stop`` is cancelled, and so is ``work``
    if it has not finished (its cancellation may still be running on return)."""
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not work.done():
            work.cancel()


async def with_cancellation(coro: Awaitable[Any], request: Any) -> Any:
    """Run ``coro`` until done or until the client disconnects (then cancel it, which aborts the
    request and frees its KV, and return ``DISCONNECTED``)."""
    task = asyncio.ensure_future(coro)
    await until_done_or(task, asyncio.ensure_future(wait_disconnect(request)))
    if not task.done():
        await asyncio.wait({task})  # let the cancellation run its clean-up
    if task.cancelled():
        return DISCONNECTED
    return task.result()


async def wait_disconnect(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def add_health_routes(app: Any, state: ServerState, not_ready: Callable[[], str | None]) -> None:
    """``GET /health`` and ``GET|POST /ping``: 200 when ready; a 503 while draining or when
    ``not_ready()`` gives a reason (the single server: its engine; the replica front: no replica
    up). Every front answers them alike."""
    from fastapi.responses import JSONResponse, Response

    async def health() -> Any:
        if state.draining:
            return JSONResponse({"error": {"message": "shutting down"}}, status_code=503)
        reason = not_ready()
        if reason is None:
            return Response(status_code=200)
        return JSONResponse({"error": {"message": reason}}, status_code=503)

    app.add_api_route("/ping", health, methods=["GET", "POST"])
    app.add_api_route("/health", health, methods=["GET"])
