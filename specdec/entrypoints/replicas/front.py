"""The OpenAI front of ``specdec serve --data-parallel-size N``: one endpoint, N replicas.

The front runs the single server's checks before routing (``RequestGuard``: Host, JSON-only bodies,
503 while draining; the API key; the body limit; the request models' validation, so a bad
request never reaches a replica), picks a replica (``router.Router``), relays the replica's
answer and names it in ``x-specdec-replica``. A replica that dies mid-answer: its streams end
with an error event and ``[DONE]``, its non-streamed requests get a 503 with ``Retry-After``,
requests not yet sent go to another replica, and the pool restarts it. ``/metrics`` holds every
replica's metrics with a ``replica`` label, and the front's own (replica up, ongoing requests,
restarts, routing decisions).

Each relayed request names its caller (``server_common.client_lane``: its API key's hash, else
its address) in ``x-specdec-client``, signed with the pool's secret, so each replica keeps
tenants apart as a single server does (per-client lanes, stored responses). ``/v1/responses``
is routed by that caller (rendezvous hashing over the replicas that are up): a tenant's stored
responses live on one replica, where its follow-ups, GETs and DELETEs go too.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from specdec.entrypoints.openai.api_server import MAX_BODY_BYTES
from specdec.entrypoints.openai.error_backoff import DEFAULT_MAX_DELAY_S, ErrorBackoff
from specdec.entrypoints.openai.server_common import (
    DISCONNECTED,
    RequestGuard,
    ServerState,
    add_health_routes,
    api_key_dependency,
    client_lane,
    forwarded_client_headers,
    parse_request,
    read_body,
    validated,
    wait_until,
    with_cancellation,
)
from specdec.entrypoints.replicas.pool import Replica, ReplicaPool
from specdec.entrypoints.replicas.router import Router, rendezvous, routing_salt, routing_text

logger = logging.getLogger("specdec.entrypoints.replicas")

REPLICA_HEADER = "x-specdec-replica"
SESSION_HEADER = "x-session-id"
RETRY_AFTER_S = 1
_DONE = b"data: [DONE]\n\n"


class _ReplicaLost(Exception):
    """The replica's connection broke after the request was sent: ``error`` is the client's 503."""

    def __init__(self, error: Any) -> None:
        super().__init__()
        self.error = error


class _ConnectFailed(Exception):
    """The replica could not be reached: nothing was sent, another may take the request."""


def replica_lost_error(index: int | str) -> Any:
    from specdec.entrypoints.openai.protocol import RequestError

    return RequestError(
        f"replica {index} stopped while answering; retry the request",
        status=503,
        code=None,
        type="service_unavailable",
    )


def no_replica_error() -> Any:
    from specdec.entrypoints.openai.protocol import RequestError

    return RequestError(
        "no replica is ready; retry shortly", status=503, code=None, type="service_unavailable"
    )


def build_front_app(
    pool: ReplicaPool,
    router: Router,
    api_key: str | None = None,
    *,
    allowed_hosts: list[str] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    shutdown_timeout: float = 10.0,
    error_backoff_s: float = DEFAULT_MAX_DELAY_S,
) -> Any:
    """The FastAPI front; its lifespan starts the replicas and its drain stops them. The front
    holds back a failing client's error answers (``error_backoff``); its replicas do not."""
    from fastapi import FastAPI

    state = ServerState(
        allowed_hosts=list(allowed_hosts) if allowed_hosts is not None else None,
        error_backoff=ErrorBackoff(error_backoff_s),
    )
    relay = _Relay(pool, router, state, max_body_bytes, pool.client_secret)

    async def drain(force_exit: Any = lambda: False) -> None:
        # NOTE: each replica drains its own requests on SIGTERM (finish within the timeout, then
        # an error event and [DONE]); the front relays that and waits for its streams to end.
        state.draining = True
        pool.terminate()
        loop = asyncio.get_running_loop()
        await wait_until(lambda: not state.in_flight or force_exit(), loop, shutdown_timeout + 5)

    app = FastAPI(title="specdec (replicas)", lifespan=_lifespan(pool, shutdown_timeout))
    app.state.drain = drain
    app.state.pool = pool
    app.state.router = router
    check_api_key = install_checks(app, state, api_key)
    _add_api_routes(app, relay, check_api_key)
    _add_front_routes(app, relay)
    return app


def _lifespan(pool: ReplicaPool, shutdown_timeout: float) -> Any:
    """The front's lifespan: the replicas started, watched and restarted, then stopped."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Any):
        try:
            await pool.start()
        except BaseException:
            await pool.stop(5.0)
            raise
        monitor = asyncio.ensure_future(pool.monitor())
        try:
            yield
        finally:
            monitor.cancel()
            await pool.stop(shutdown_timeout + 5.0)

    return lifespan


class _Relay:
    """What the front's routes share: picking a replica (the routing decisions counted) and
    relaying a request to it, to another when it cannot be reached."""

    def __init__(
        self,
        pool: ReplicaPool,
        router: Router,
        state: ServerState,
        max_body_bytes: int,
        client_secret: str,
    ) -> None:
        self.pool, self.router, self.state = pool, router, state
        self.max_body_bytes = max_body_bytes
        self.client_secret = client_secret
        self.decisions: Counter[tuple[int, str]] = Counter()

    def headers(self, request: Any) -> dict[str, str]:
        """What a replica is sent of ``request``'s headers, and its caller, signed."""
        lane = client_lane(request)
        return _headers(request.headers) | forwarded_client_headers(lane, self.client_secret)

    def pick(self, text: str, session: str | None, salt: str | None) -> Replica:
        loads = {r.index: r.ongoing for r in self.pool.serving()}
        if not loads or self.state.draining:
            raise no_replica_error()
        choice = self.router.choose(text, session, loads, salt)
        self.decisions[(choice.replica, choice.reason)] += 1
        return self.pool.replicas[choice.replica]

    def pick_tenant(self, tenant: str) -> Replica:
        """The tenant's replica among those up (rendezvous hashing): where its stored
        responses live."""
        up = [r.index for r in self.pool.serving()]
        if not up or self.state.draining:
            raise no_replica_error()
        index = rendezvous(tenant, up)
        self.decisions[(index, "tenant")] += 1
        return self.pool.replicas[index]

    async def generate(self, request: Any, model: Any) -> Any:
        """A completion: checked and parsed here (400 before routing), routed, relayed."""
        from specdec.entrypoints.openai.protocol import RequestError

        body = await read_body(request, self.max_body_bytes, RequestError)
        # 400 before routing; the body parsed once, off the event loop
        req, text, salt = await asyncio.to_thread(parse_for_routing, body, model)
        session = request.headers.get(SESSION_HEADER)
        return await self._send(request, body, req.stream, lambda: self.pick(text, session, salt))

    async def responses(self, request: Any) -> Any:
        """``/v1/responses`` (create, retrieve, delete): checked here (a body parsed, 400 before
        routing), sent to the caller's replica, relayed."""
        from specdec.entrypoints.openai.protocol import RequestError
        from specdec.entrypoints.openai.responses import ResponsesRequest

        body = await read_body(request, self.max_body_bytes, RequestError)
        stream = False
        if request.method == "POST":
            req = await asyncio.to_thread(parse_request, body, ResponsesRequest)
            stream = req.stream
        tenant = client_lane(request)
        return await self._send(request, body, stream, lambda: self.pick_tenant(tenant))

    async def _send(self, request: Any, body: bytes, stream: bool, pick: Any) -> Any:
        """``request`` to the replica ``pick()`` names, to the next one when it cannot be
        reached; its answer (streamed when ``stream``) relayed."""
        from fastapi.responses import Response

        path, method, headers = request.url.path, request.method, self.headers(request)
        for _ in range(len(self.pool.replicas)):
            replica = pick()
            try:
                if stream:
                    return await _relay_stream(
                        replica, path, body, headers, lambda r=replica: self.pool.mark_lost(r)
                    )
                result = await with_cancellation(
                    _relay(replica, path, body, headers, method), request
                )
                return Response(status_code=499) if result is DISCONNECTED else result
            except _ConnectFailed:
                self.pool.mark_down(replica)
            except _ReplicaLost as lost:
                self.pool.mark_lost(replica)
                raise lost.error from None
        raise no_replica_error()

    async def forward_any(self, request: Any) -> Any:
        """Any other request, as it came, to a replica."""
        from specdec.entrypoints.openai.protocol import RequestError

        body = await read_body(request, self.max_body_bytes, RequestError)
        return await self._send(request, body, False, lambda: self.pick("", None, None))


def parse_for_routing(body: bytes, model: Any) -> tuple[Any, str, str | None]:
    """The request ``model`` (a RequestError naming the field), and the text and salt it is
    routed on."""
    from specdec.entrypoints.openai.safety import parse_json_body

    data = parse_json_body(body)
    return validated(data, model), routing_text(data), routing_salt(data)


def _add_api_routes(app: Any, relay: _Relay, check_api_key: Any) -> None:
    """/v1 (completions routed, responses by caller, models relayed), then /tokenize,
    /detokenize and /replicas."""
    from fastapi import APIRouter, Depends, Request
    from fastapi.responses import JSONResponse

    from specdec.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await relay.generate(request, ChatCompletionRequest)

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        return await relay.generate(request, CompletionRequest)

    async def responses(request: Request) -> Any:
        return await relay.responses(request)

    # NOTE: create, retrieve and delete alike: relayed to the caller's replica
    v1.add_api_route("/responses", responses, methods=["POST"])
    v1.add_api_route("/responses/{response_id}", responses, methods=["GET", "DELETE"])

    @v1.get("/models")
    async def list_models(request: Request) -> Any:
        return await relay.forward_any(request)

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> Any:
        return await relay.forward_any(request)

    app.include_router(v1)
    tools = APIRouter(dependencies=[Depends(check_api_key)])

    @tools.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        return await relay.forward_any(request)

    @tools.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return await relay.forward_any(request)

    @tools.get("/replicas")
    async def replicas() -> Any:
        return JSONResponse({"replicas": [_describe(r) for r in relay.pool.replicas]})

    app.include_router(tools)


def _add_front_routes(app: Any, relay: _Relay) -> None:
    """/version (a replica's), /health (while a replica is up), /metrics (the replicas' and the
    front's own), and the chat page."""
    from fastapi import Request
    from fastapi.responses import Response

    from specdec.entrypoints.openai.chat_page import add_chat_page

    pool = relay.pool

    @app.get("/version")
    async def version(request: Request) -> Any:
        return await relay.forward_any(request)

    add_health_routes(
        app,
        relay.state,
        lambda: None if any(r.up for r in pool.replicas) else "no replica is ready",
    )

    @app.get("/metrics")
    async def metrics() -> Any:
        from specdec.metrics import CONTENT_TYPE

        texts = await asyncio.gather(*(_scrape(r) for r in pool.replicas))
        merged = merge_metrics({r.index: t for r, t in zip(pool.replicas, texts) if t})
        return Response(merged + front_metrics(pool, relay.decisions), media_type=CONTENT_TYPE)

    add_chat_page(app)  # NOTE: its /v1 calls go through this front like any client's


def install_checks(app: Any, state: ServerState, api_key: str | None) -> Any:
    """The single server's checks on a front app (``RequestGuard``, OpenAI-style errors, 503s with
    Retry-After); returns the API key dependency for its routers."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from specdec.entrypoints.openai.protocol import RequestError

    check_api_key = api_key_dependency(api_key)

    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    app.add_exception_handler(RequestError, request_error)
    app.add_middleware(RequestGuard, state=state)
    return check_api_key


def _headers(incoming: Any) -> dict[str, str]:
    keep = ("content-type", "accept", SESSION_HEADER, "x-request-id")
    return {k: incoming[k] for k in keep if k in incoming}


def _answer(resp: Any, replica: Replica) -> Any:
    from fastapi.responses import Response

    headers = {REPLICA_HEADER: str(replica.index)}
    if "retry-after" in resp.headers:
        headers["Retry-After"] = resp.headers["retry-after"]
    media_type = resp.headers.get("content-type", "application/json")
    return Response(resp.content, resp.status_code, headers=headers, media_type=media_type)


async def _relay(
    replica: Replica, path: str, body: bytes, headers: dict[str, str], method: str = "POST"
) -> Any:
    """The replica's whole answer, or a 503 with Retry-After when it dies before answering."""
    import httpx

    replica.ongoing += 1
    try:
        content = body if method == "POST" else None
        resp = await replica.client.request(method, path, content=content, headers=headers)
    except httpx.ConnectError:
        raise _ConnectFailed from None
    except httpx.TransportError:
        raise _ReplicaLost(replica_lost_error(replica.index)) from None
    finally:
        replica.ongoing -= 1
    return _answer(resp, replica)


async def _relay_stream(
    replica: Replica,
    path: str,
    body: bytes,
    headers: dict[str, str],
    on_lost: Callable[[], None] = lambda: None,
) -> Any:
    """The replica's SSE stream, relayed; if the replica dies mid-stream, an error event and
    ``[DONE]`` end it (and ``on_lost`` is called)."""
    import httpx
    from fastapi.responses import StreamingResponse

    replica.ongoing += 1
    try:
        request = replica.client.build_request("POST", path, content=body, headers=headers)
        resp = await replica.client.send(request, stream=True)
    except httpx.ConnectError:
        replica.ongoing -= 1
        raise _ConnectFailed from None
    except httpx.TransportError:
        replica.ongoing -= 1
        raise _ReplicaLost(replica_lost_error(replica.index)) from None
    if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith(
        "text/event-stream"
    ):
        try:
            await resp.aread()
        finally:
            await resp.aclose()
            replica.ongoing -= 1
        return _answer(resp, replica)

    async def events() -> Any:
        tail = b"\n\n"
        try:
            async for chunk in resp.aiter_raw():
                tail = (tail + chunk)[-2:]
                yield chunk
        except httpx.TransportError:
            logger.warning("replica %d: a stream broke off (the replica stopped)", replica.index)
            on_lost()
            err = replica_lost_error(replica.index)
            yield (
                b"" if tail == b"\n\n" else b"\n\n"
            ) + f"data: {json.dumps(err.body())}\n\n".encode()
            yield _DONE
        finally:
            await resp.aclose()
            replica.ongoing -= 1

    headers = {
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        REPLICA_HEADER: str(replica.index),
    }
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


async def _scrape(replica: Replica) -> str:
    import httpx

    if not replica.up:
        return ""
    try:
        resp = await replica.client.get("/metrics", timeout=3.0)
    except httpx.TransportError:
        return ""
    return resp.text if resp.status_code == 200 else ""


def _describe(r: Replica) -> dict[str, Any]:
    return {
        "replica": r.index, "pid": r.pid, "up": r.up, "ongoing": r.ongoing,
        "restarts": r.restarts, "cores": r.cores,
    }  # fmt: skip


def merge_metrics(texts: dict[int, str] | dict[str, str]) -> str:
    """Prometheus texts from several replicas as one, each sample labelled ``replica``."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for index, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                family = parts[2] if len(parts) > 2 else family
                if family not in families:
                    families[family], samples[family] = [], []
                if len(families[family]) < 2 and line not in families[family]:
                    families[family].append(line)
            elif line.strip():
                samples.setdefault(family, []).append(_label(line, index))
                families.setdefault(family, [])
    out = []
    for family, header in families.items():
        out.extend(header)
        out.extend(samples.get(family, []))
    return "\n".join(out) + "\n" if out else ""


def _label(sample: str, index: int | str) -> str:
    """``name{a="b"} 1`` -> ``name{replica="I",a="b"} 1``."""
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        close = sample[brace + 1 :]
        sep = "" if close.startswith("}") else ","
        return f'{sample[:brace]}{{replica="{index}"{sep}{close}'
    return f'{sample[:space]}{{replica="{index}"}}{sample[space:]}'


def front_metrics(pool: ReplicaPool, decisions: Counter) -> str:
    """The front's own series: replica up, ongoing requests, restarts, routing decisions."""
    lines = []
    for name, kind, help_text, value in (
        ("specdec:replica_up", "gauge", "1 while the replica takes requests", lambda r: int(r.up)),
        ("specdec:replica_ongoing_requests", "gauge", "requests the front has sent to the replica and not finished", lambda r: r.ongoing),
        ("specdec:replica_restarts_total", "counter", "times the replica was restarted", lambda r: r.restarts),
    ):  # fmt: skip
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{replica="{r.index}"}} {value(r)}' for r in pool.replicas]
    name = "specdec:router_requests_total"
    lines += [f"# HELP {name} requests routed, by replica and reason", f"# TYPE {name} counter"]
    lines += [
        f'{name}{{replica="{r}",reason="{why}"}} {n}' for (r, why), n in sorted(decisions.items())
    ]
    return "\n".join(lines) + "\n"
