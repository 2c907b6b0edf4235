"""Ray Serve: ``specdec serve MODEL --ray --num-replicas N`` (or ``--min-replicas/--max-replicas``).

Two deployments. ``SpecdecEngine``: one replica = one specdec engine, run as the same
``specdec serve`` process the single server is (a child of the replica actor on a private Unix
socket; it dies with the actor), so every engine flag means what it means there. Resources per
replica: ``num_cpus`` = threads x tensor_parallel_size; when a replica is tensor-parallel
(``--tensor-parallel-size`` > 1, with the executor's ``distributed_executor_backend``), a
placement group with one ``{"CPU": threads}`` bundle per rank (STRICT_PACK: a replica's ranks
share one host and its shared-memory all-reduce). ``SpecdecIngress``: the OpenAI endpoint, with
the single server's checks before routing (the same ``RequestGuard``, API key, body limit and request
models) and the answer relayed with ``x-specdec-replica``. The engine deployment routes with
``SpecdecRequestRouter``, a Ray Serve 2.60 custom request router around the same ``Router`` the
``--data-parallel-size`` front uses (prefix tree per replica, ``x-session-id`` rendezvous
hashing, least-loaded when queues differ by more than ``imbalanced_threshold``). Autoscaling is
Ray Serve's: ``target_ongoing_requests`` per replica between the min and the max.

As behind the ``--data-parallel-size`` front, the ingress names each request's caller in a
header signed with a secret generated at deploy time and given to the engines (their
environment), so each engine keeps tenants apart; ``/v1/responses`` goes to the caller's
replica (rendezvous hashing over the live replicas), where its stored responses live.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import argparse
import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from specdec.entrypoints.openai.error_backoff import DEFAULT_MAX_DELAY_S, ErrorBackoff
from specdec.entrypoints.openai.server_common import FORWARDED_CLIENT_SECRET_ENV
from specdec.entrypoints.replicas.pool import _child_setup, replica_argv

logger = logging.getLogger("specdec.entrypoints.replicas")

APP_NAME = "specdec"
ENGINE_NAME = "SpecdecEngine"
STARTUP_TIMEOUT_S = 600.0
METRICS_TIMEOUT_S = 3.0
TTFT_METRIC = "ttft_mean_s"  # NOTE: the name a custom autoscaling policy reads
TTFT_WINDOW_S = 30.0  # as Ray Serve's default look_back_period_s


class SpecdecEngine:
    """One Ray Serve replica: a ``specdec serve`` engine process and a relay to it."""

    def __init__(
        self, argv: list[str], threads: int, tp: int = 1, client_secret: str | None = None
    ) -> None:
        import httpx
        from ray import serve

        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self._ttft = TrailingMean(TTFT_WINDOW_S)
        self.workdir = tempfile.mkdtemp(prefix="specdec-ray-")
        os.chmod(self.workdir, 0o700)
        sock = os.path.join(self.workdir, "engine.sock")
        cmd = [sys.executable, "-m", "specdec.cli", "serve", *argv,
               "--uds", sock, "--threads", str(threads)]  # fmt: skip
        cores = sorted(os.sched_getaffinity(0))
        if tp > 1:  # NOTE: its ranks pin themselves: to this replica's share of the host
            local_rank = getattr(getattr(context, "rank", None), "local_rank", 0) or 0
            cores = replica_cores(cores, local_rank, threads * tp)
        env = {k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEY"}
        env.pop(FORWARDED_CLIENT_SECRET_ENV, None)
        if client_secret:  # NOTE: the ingress signs the caller it names with it
            env[FORWARDED_CLIENT_SECRET_ENV] = client_secret
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=lambda: _child_setup(cores),  # noqa: PLW1509
        )  # fmt: skip
        transport = httpx.HTTPTransport(uds=sock)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(transport=transport, base_url="http://localhost") as probe:
            while not self._healthy(probe):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the specdec engine did not start ({self.proc.returncode})")
                time.sleep(0.2)
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=sock),
            base_url="http://localhost",
            timeout=httpx.Timeout(None, connect=5.0),
        )

    @staticmethod
    def _healthy(probe: Any) -> bool:
        import httpx

        try:
            return probe.get("/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    async def generate(self, route: dict, path: str, body: bytes, headers: dict) -> Any:
        """The engine's answer: first ``{"status", "headers", "replica"}``, then body chunks."""
        async with self.client.stream("POST", path, content=body, headers=headers) as resp:
            keep = {k: v for k, v in resp.headers.items() if k in ("content-type", "retry-after")}
            yield {"status": resp.status_code, "headers": keep, "replica": self.name}
            async for chunk in resp.aiter_raw():
                yield chunk

    async def request(
        self, route: dict | None, method: str, path: str, body: bytes, headers: dict
    ) -> dict:
        """The engine's whole answer; ``route`` (``{"tenant": ...}`` or None: any replica) is
        what ``SpecdecRequestRouter`` reads."""
        resp = await self.client.request(method, path, content=body or None, headers=headers)
        keep = {k: v for k, v in resp.headers.items() if k in ("content-type", "retry-after")}
        return {
            "status": resp.status_code, "headers": keep, "body": resp.content, "replica": self.name,
        }  # fmt: skip

    async def metrics(self) -> dict:
        """This engine's Prometheus text and the replica it comes from (for the ingress merge)."""
        resp = await self.client.get("/metrics", timeout=METRICS_TIMEOUT_S)
        return {"replica": self.name, "text": resp.text if resp.status_code == 200 else ""}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics (a policy reads
        ``ctx.aggregated_metrics[TTFT_METRIC][replica_id]``): this engine's mean TTFT over the
        requests that got their first token in the last ``TTFT_WINDOW_S`` (0 when none did)."""
        text = (await self.metrics())["text"]
        total = histogram_totals(text, "time_to_first_token_seconds")
        return {TTFT_METRIC: self._ttft.observe(time.monotonic(), total)}

    def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose engine died is replaced."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the specdec engine exited ({self.proc.returncode})")

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(getattr(self, "workdir", ""), ignore_errors=True)


def replica_cores(usable: list[int], local_rank: int, per_replica: int) -> list[int]:
    """A tensor-parallel replica's cores on its host: the ``local_rank``-th group of
    ``per_replica`` (round robin when the host has fewer groups; all when one group is more)."""
    groups = len(usable) // per_replica
    if groups < 1:
        return usable
    g = local_rank % groups
    return usable[g * per_replica : (g + 1) * per_replica]


def histogram_totals(text: str, family: str) -> tuple[float, float]:
    """``(sum, count)`` of a histogram in Prometheus text, summed over its label sets, under
    whichever prefix the engine exports (``vllm:`` first, then ``specdec:``)."""
    import re

    for prefix in ("vllm:", "specdec:"):
        name = re.escape(f"{prefix}{family}")
        got = {
            part: [float(v) for v in re.findall(rf"^{name}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
            for part in ("sum", "count")
        }  # fmt: skip
        if got["count"]:
            return sum(got["sum"]), sum(got["count"])
    return 0.0, 0.0


@dataclass
class TrailingMean:
    """The mean of a histogram's observations over the last ``window_s``, from cumulative
    ``(sum, count)`` readings. NOTE: a trailing window, not "since the last reading": Ray Serve
    averages the reports over its look-back period, and readings of 0 between requests would
    dilute a per-interval mean below any TTFT target."""

    window_s: float
    readings: deque[tuple[float, float, float]] = field(default_factory=deque)  # (t, sum, count)

    def observe(self, now: float, total: tuple[float, float]) -> float:
        if self.readings and total[1] < self.readings[-1][2]:
            self.readings.clear()  # a reset counter: the window starts over
        self.readings.append((now, *total))
        while len(self.readings) > 1 and self.readings[1][0] <= now - self.window_s:
            self.readings.popleft()  # NOTE: the newest reading at or before the window's start stays
        # NOTE: no reading as old as the window (just started): since the engine started
        start, first_sum, first_count = self.readings[0]
        if start > now - self.window_s:
            first_sum, first_count = 0.0, 0.0
        n = total[1] - first_count
        return (total[0] - first_sum) / n if n > 0 else 0.0


def build_ingress_app(
    api_key: str | None,
    allowed_hosts: list[str] | None,
    client_secret: str | None = None,
    error_backoff_s: float = DEFAULT_MAX_DELAY_S,
) -> Any:
    """The OpenAI endpoint in front of the engine deployment (same checks as the single server);
    ``client_secret`` signs the caller named to the engines (``server_common.client_lane``);
    ``error_backoff_s``: the longest a failing client's error answer waits (``error_backoff``)."""
    from fastapi import FastAPI
    from ray import serve

    from specdec.entrypoints.openai.server_common import ServerState, add_health_routes
    from specdec.entrypoints.replicas.front import install_checks

    state = ServerState(
        allowed_hosts=allowed_hosts,
        error_backoff=ErrorBackoff(error_backoff_s),
    )
    app = FastAPI(title="specdec (Ray Serve)")
    check_api_key = install_checks(app, state, api_key)
    engine = serve.get_deployment_handle(ENGINE_NAME, APP_NAME)
    _add_relay_routes(app, check_api_key, engine, client_secret or "")
    add_health_routes(app, state, lambda: None)  # NOTE: Ray Serve replaces dead replicas

    async def metrics() -> Any:
        return await gather_metrics(engine)

    app.add_api_route("/metrics", metrics, methods=["GET"])
    from specdec.entrypoints.openai.chat_page import add_chat_page

    add_chat_page(app)  # NOTE: its /v1 calls go through this ingress like any client's
    return app


def _add_relay_routes(app: Any, check_api_key: Any, engine: Any, secret: str) -> None:
    """The API routes of the ingress (behind ``check_api_key``, and ``/version``): each request
    checked here, then answered by a replica of ``engine`` (``secret`` signs its caller)."""
    from fastapi import APIRouter, Depends, Request
    from fastapi.responses import Response

    from specdec.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        RequestError,
    )
    from specdec.entrypoints.openai.responses import ResponsesRequest
    from specdec.entrypoints.openai.server_common import client_lane, read_body
    from specdec.entrypoints.replicas.front import REPLICA_HEADER

    async def generate(request: Request, model: Any) -> Any:
        body = await read_body(request, MAX_BODY, RequestError)
        return await _generate(engine, request, body, model, secret)

    async def forward(request: Request, route: dict | None = None) -> Any:
        body = await read_body(request, MAX_BODY, RequestError)
        try:
            got = await engine.request.remote(
                route, request.method, request.url.path, body, relayed_headers(request, secret)
            )
        except Exception as e:  # noqa: BLE001 - a replica lost (a Ray error): retry later
            raise _lost(e) from None
        headers = {**got["headers"], REPLICA_HEADER: got["replica"]}
        return Response(got["body"], got["status"], headers=headers)

    async def responses(request: Request) -> Any:
        """Create: checked (400 before routing) and sent to the caller's replica."""
        body = await read_body(request, MAX_BODY, RequestError)
        route = {"tenant": client_lane(request)}
        return await _generate(engine, request, body, ResponsesRequest, secret, route)

    async def stored_response(request: Request, response_id: str) -> Any:
        """Retrieve or delete: at the caller's replica."""
        return await forward(request, {"tenant": client_lane(request)})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    v1.add_api_route("/chat/completions", _route(generate, ChatCompletionRequest), methods=["POST"])
    v1.add_api_route("/completions", _route(generate, CompletionRequest), methods=["POST"])
    v1.add_api_route("/responses", responses, methods=["POST"])
    v1.add_api_route("/responses/{response_id}", stored_response, methods=["GET", "DELETE"])
    v1.add_api_route("/models", forward, methods=["GET"])
    v1.add_api_route("/models/{model_id:path}", forward, methods=["GET"])
    app.include_router(v1)
    tools = APIRouter(dependencies=[Depends(check_api_key)])
    tools.add_api_route("/tokenize", forward, methods=["POST"])
    tools.add_api_route("/detokenize", forward, methods=["POST"])
    app.include_router(tools)
    app.add_api_route("/version", forward, methods=["GET"])


async def gather_metrics(engine: Any) -> Any:
    """Every live replica's engine metrics, each sample labelled ``replica`` (the id
    ``x-specdec-replica`` names), one ``# HELP``/``# TYPE`` per family, as the
    ``--data-parallel-size`` front serves them; plus ``specdec:replica_up`` per answering replica.
    A replica that does not answer within the timeout is left out of this scrape."""
    from fastapi.responses import Response

    from specdec.entrypoints.replicas.front import merge_metrics
    from specdec.metrics import CONTENT_TYPE

    try:
        got = await engine.broadcast("metrics").results_async(
            timeout_s=METRICS_TIMEOUT_S + 1.0, return_exceptions=True
        )
    except Exception as e:  # noqa: BLE001 - no replica (a Ray error) or the whole scrape timed out
        logger.warning("metrics: no replica answered (%s)", type(e).__name__)
        got = []
    texts = {g["replica"]: g["text"] for g in got if isinstance(g, dict) and g.get("text")}
    name = "specdec:replica_up"
    up = [
        f"# HELP {name} 1 for each replica whose metrics this scrape holds",
        f"# TYPE {name} gauge",
    ]
    up += [f'{name}{{replica="{r}"}} 1' for r in sorted(texts)]
    return Response(merge_metrics(texts) + "\n".join(up) + "\n", media_type=CONTENT_TYPE)


MAX_BODY = 4 * 1024 * 1024


def _route(generate: Any, model: Any) -> Any:
    from fastapi import Request

    async def handler(request: Request) -> Any:
        return await generate(request, model)

    return handler


def _lost(e: Exception) -> Any:
    from specdec.entrypoints.replicas.front import replica_lost_error

    logger.warning("a replica was lost: %s", type(e).__name__)
    return replica_lost_error("of the engine deployment")


def relayed_headers(request: Any, secret: str) -> dict[str, str]:
    """What an engine is sent of ``request``'s headers, and its caller, signed."""
    from specdec.entrypoints.openai.server_common import client_lane, forwarded_client_headers
    from specdec.entrypoints.replicas.front import _headers

    named = forwarded_client_headers(client_lane(request), secret) if secret else {}
    return _headers(request.headers) | named


async def _generate(
    engine: Any, request: Any, body: bytes, model: Any, secret: str, route: dict | None = None
) -> Any:
    """Validate (400 before routing), route on text and session (or ``route``), relay the
    replica's answer."""
    from fastapi.responses import Response, StreamingResponse

    from specdec.entrypoints.replicas.front import REPLICA_HEADER, SESSION_HEADER, parse_for_routing

    # 400 before routing; the body parsed once, off the event loop
    req, text, salt = await asyncio.to_thread(parse_for_routing, body, model)
    if route is None:
        route = {"text": text, "salt": salt, "session": request.headers.get(SESSION_HEADER)}
    gen = engine.options(stream=True).generate.remote(
        route, request.url.path, body, relayed_headers(request, secret)
    )
    try:
        head = await gen.__anext__()
        if req.stream and head["status"] == 200:
            headers = {"Cache-Control": "no-cache", REPLICA_HEADER: head["replica"]}
            return StreamingResponse(_relay(gen), media_type="text/event-stream", headers=headers)
        content = b"".join([chunk async for chunk in gen])
    except asyncio.CancelledError:
        gen.cancel()
        raise
    except Exception as e:  # noqa: BLE001 - a replica lost (a Ray error): 503 + Retry-After
        raise _lost(e) from None
    headers = {**head["headers"], REPLICA_HEADER: head["replica"]}
    return Response(content, head["status"], headers=headers)


async def _relay(gen: Any) -> Any:
    """A replica's SSE stream; a replica lost mid-stream ends it with an error event and [DONE]."""
    tail = b"\n\n"
    try:
        async for chunk in gen:
            tail = (tail + chunk)[-2:]
            yield chunk
    except Exception as e:  # noqa: BLE001 - a replica lost (a Ray error)
        err = _lost(e)
        yield (b"" if tail == b"\n\n" else b"\n\n") + f"data: {json.dumps(err.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        gen.cancel()


def check_ray_args(args: argparse.Namespace) -> None:
    """The Ray flags, checked before anything starts: a bad one is a one-line ``ConfigError``
    naming it."""
    from specdec.config import ConfigError

    scaled = args.min_replicas is not None or args.max_replicas is not None
    if not args.ray:
        given = [f for f, v in (("--num-replicas", args.num_replicas != 1), ("--min-replicas", args.min_replicas is not None), ("--max-replicas", args.max_replicas is not None), ("--autoscaling-policy", args.autoscaling_policy is not None), ("--ray-address", args.ray_address is not None)) if v]  # fmt: skip
        if given:
            raise ConfigError(f"{given[0]} needs --ray")
        return
    low = args.min_replicas if args.min_replicas is not None else 1
    if args.num_replicas < 1:
        raise ConfigError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    if low < 0:
        raise ConfigError(f"--min-replicas must be >= 0, got {low}")
    if args.max_replicas is not None and args.max_replicas < max(low, 1):
        raise ConfigError(f"--max-replicas must be >= max(1, --min-replicas), got {args.max_replicas}")  # fmt: skip
    if not args.target_ongoing_requests > 0:
        raise ConfigError(f"--target-ongoing-requests must be > 0, got {args.target_ongoing_requests}")  # fmt: skip
    if args.autoscaling_policy is not None and (not scaled or ":" not in args.autoscaling_policy):
        raise ConfigError(
            "--autoscaling-policy takes MODULE:FUNCTION, with --min-replicas or --max-replicas"
        )


def engine_resources(args: argparse.Namespace) -> dict[str, Any]:
    """The engine deployment's resources and scale: ``num_cpus`` = threads x TP size, or, when
    the replica is tensor-parallel, one ``{"CPU": threads}`` bundle per rank, STRICT_PACK (the
    ranks share memory on one host); ``num_replicas`` or Ray Serve's autoscaling config."""
    threads = args.threads or 1
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": threads * tp}}
    if tp > 1:  # NOTE: the replica actor takes the first bundle; rank 0 runs in it
        options["ray_actor_options"] = {"num_cpus": threads}
        options["placement_group_bundles"] = [{"CPU": threads}] * tp
        options["placement_group_strategy"] = "STRICT_PACK"
    if args.min_replicas is not None or args.max_replicas is not None:
        low = args.min_replicas if args.min_replicas is not None else 1
        options["autoscaling_config"] = {
            "min_replicas": low,
            "max_replicas": args.max_replicas if args.max_replicas is not None else max(low, 1),
            "target_ongoing_requests": args.target_ongoing_requests,
        }
        if args.autoscaling_policy:  # NOTE: Ray imports it in its controller
            options["autoscaling_config"]["policy"] = {"policy_function": args.autoscaling_policy}
    else:
        options["num_replicas"] = args.num_replicas
    return options


def build_ray_app(args: argparse.Namespace, argv: list[str], api_key: str | None,
                  allowed_hosts: list[str] | None) -> Any:  # fmt: skip
    """The Ray Serve application: the engine deployment (resources, router, autoscaling) bound
    under the ingress."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    threads = args.threads or 1
    options = {
        "name": ENGINE_NAME,
        "request_router_config": RequestRouterConfig(
            request_router_class="specdec.entrypoints.replicas.ray_router.SpecdecRequestRouter"
        ),
        "health_check_period_s": 2.0,
        "graceful_shutdown_timeout_s": args.shutdown_timeout + 5.0,
        **engine_resources(args),
    }
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    secret = secrets.token_hex(32)  # NOTE: the ingress signs the caller it names with it
    engine = serve.deployment(SpecdecEngine, **options).bind(
        replica_argv(argv), threads, tp, secret
    )

    def builder() -> Any:
        return build_ingress_app(api_key, allowed_hosts, secret, args.error_backoff)

    @serve.ingress(builder)
    class SpecdecIngress:
        def __init__(self, engine: Any) -> None:
            self.engine = engine  # NOTE: bound so that the app deploys it; found by name

    ingress = serve.deployment(
        SpecdecIngress, name="SpecdecIngress", ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(engine)


def serve_ray(args: argparse.Namespace, argv: list[str], api_key: str | None,
              allowed_hosts: list[str] | None) -> int:  # fmt: skip
    """Start (or join, ``--ray-address``) Ray, deploy, serve until SIGINT/SIGTERM, clean up."""
    import ray
    from ray import serve

    started = time.monotonic()
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(
            build_ray_app(args, argv, api_key, allowed_hosts), name=APP_NAME, route_prefix="/"
        )
        logger.info(
            "Ray Serve app %r ready on http://%s:%d/v1 after %.1f s",
            APP_NAME, args.host, args.port, time.monotonic() - started,
        )  # fmt: skip
        _wait_for_signal()
    finally:
        import psutil

        # NOTE: taken before Ray stops: its per-node agents can outlive the raylet, orphaned
        started_here = psutil.Process().children(recursive=True)
        local = args.ray_address is None
        # NOTE: bounded: a signal to the whole process group (Ctrl-C in a terminal) also stops
        # the raylet, and serve.delete then waits on it forever
        stopper = threading.Thread(target=_stop_ray, args=(local,), daemon=True)
        stopper.start()
        stopper.join(args.shutdown_timeout + 30.0)
        if local:
            _reap(started_here)
    return 0


def _stop_ray(local: bool) -> None:
    import ray
    from ray import serve

    try:
        serve.delete(APP_NAME)
        if local:
            serve.shutdown()
    finally:
        ray.shutdown()


def _reap(left: list, grace_s: float = 10.0) -> None:
    """The local Ray this command started: its processes still running get SIGTERM, then
    SIGKILL, by PID."""
    import psutil

    for proc in left:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _wait_for_signal() -> None:
    """Until SIGINT or SIGTERM. NOTE: not sigwait: Ray's threads do not block the signals, and
    Python runs handlers on the main thread only between bytecodes."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    logger.info("stopping the Ray Serve app")
