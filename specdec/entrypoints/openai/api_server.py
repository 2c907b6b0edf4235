"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), started like vLLM's.

    specdec serve smollm2-135m --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
    python -m specdec.entrypoints.openai.api_server --model smollm2-135m --port 8000

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus). FastAPI and uvicorn are imported only when a server is built, so the
``specdec`` command stays quick for its other subcommands.

In front of every route (``RequestGuard``): the Host check (``--allowed-hosts``; DNS rebinding), POST
bodies only as ``application/json`` (a cross-origin "simple" POST from a web page cannot be),
503 while shutting down, and one log line, never a traceback, for an unexpected failure. CORS is
off unless ``--allowed-origins`` is given. On SIGTERM the server stops admitting, lets running
requests finish for ``--shutdown-timeout`` seconds, then ends the rest with an error event and
``[DONE]``.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations, and the
# handlers are defined inside build_app next to the lazily imported classes they name.

import argparse
import asyncio
import gc
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from specdec.config import (
    ConfigError,
    EngineArgs,
    common,
    json_value,
    log_ignored,
    section_group,
)
from specdec.entrypoints.openai import response_store
from specdec.entrypoints.openai.connection import (
    DEFAULT_HEADER_READ_TIMEOUT_S,
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_MAX_PENDING_PER_CLIENT,
)
from specdec.entrypoints.openai.server_common import (
    DISCONNECTED,
    RequestGuard,
    ServerState,
    add_health_routes,
    api_key_dependency,
    client_lane,
    parse_request,
    read_body,
    validated,
    wait_until,
    with_cancellation,
)
from specdec.entrypoints.utils import (
    LOG_FORMAT,
    add_sampling_args,
    read_chat_template,
    run_command,
    sampling_defaults,
)

logger = logging.getLogger("specdec.entrypoints.openai.api_server")

MAX_BODY_BYTES = 4 * 1024 * 1024
API_KEY_ENV = "SPECDEC_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
FLUSH_TIMEOUT_S = 3.0  # after the drain: for the last events and [DONE] to reach the clients

# NOTE: the names these had before they moved to server_common.py (and became public)
_ServerState, _Guard, _DISCONNECTED = ServerState, RequestGuard, DISCONNECTED
_read_body, _parse_request, _validated = read_body, parse_request, validated
_wait_until, _with_cancellation, _FLUSH_TIMEOUT_S = wait_until, with_cancellation, FLUSH_TIMEOUT_S


# ---- the app ---------------------------------------------------------------------------------


def build_app(
    llm: Any,
    served_model_names: list[str],
    api_key: str | None = None,
    model_root: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    *,
    trust_request_chat_template: bool = False,
    allowed_hosts: list[str] | None = None,
    allowed_origins: list[str] | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    chat_template_timeout: float | None = None,
    sampling_defaults: dict[str, Any] | None = None,
    metrics_prefixes: tuple[str, ...] | None = None,
    per_request_spec_decode_metrics: str | None = None,
    special_tokens_in_content: str = "allow",
    responses_store: response_store.ResponseStore | None = None,
) -> Any:
    """A FastAPI app serving ``llm`` (an AsyncLLM); its lifespan starts and stops the engine thread.

    ``allowed_hosts`` None accepts any Host header (``specdec serve`` defaults to the loopback
    names when bound to loopback); ``allowed_origins`` None: no CORS. ``app.state.drain`` is the
    graceful shutdown that ``make_server``'s servers run on SIGTERM. ``responses_store`` keeps
    ``/v1/responses`` (default: ``ResponseStore()``; ``app.state.responses_store``).
    """
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    import specdec
    from specdec.entrypoints.openai import utility
    from specdec.entrypoints.openai.chat_sandbox import DEFAULT_TIMEOUT_S, TemplateSandbox
    from specdec.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        RequestError,
        one_line,
        random_id,
    )
    from specdec.entrypoints.openai.serving import EventStream, OpenAIServing
    from specdec.metrics import CONTENT_TYPE, METRIC_PREFIXES, EngineMetrics

    if llm.metrics is None:
        llm.metrics = EngineMetrics(
            served_model_names[0], prefixes=metrics_prefixes or METRIC_PREFIXES
        )
    sandbox = None
    if trust_request_chat_template:
        sandbox = TemplateSandbox(timeout_s=chat_template_timeout or DEFAULT_TIMEOUT_S)
    serving = OpenAIServing(
        llm, served_model_names, model_root, template_sandbox=sandbox,
        sampling_defaults=sampling_defaults,
        per_request_spec_decode_metrics=per_request_spec_decode_metrics,
        special_tokens_in_content=special_tokens_in_content,
    )  # fmt: skip
    state = ServerState(allowed_hosts=list(allowed_hosts) if allowed_hosts is not None else None)

    class SSEResponse(StreamingResponse):
        """Streams an EventStream and aborts its request however the response ends."""

        def __init__(self, events: EventStream) -> None:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            super().__init__(events.events, media_type="text/event-stream", headers=headers)
            self.events = events

        async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.events.close()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        if sandbox is not None:
            await sandbox.start()
        # NOTE: as vLLM: the startup heap (torch, the model's modules) is left out of collections
        # from here on; a full collection over it held the GIL for ~0.4 s, and building a large
        # reply (3,000 tokens of top-20 logprobs: 60k objects) sets one off
        gc.collect()
        gc.freeze()
        watchdog = asyncio.create_task(_watch_engine(app, llm, state))
        try:
            yield
        finally:
            watchdog.cancel()
            await serving.close()
            llm.shutdown()

    async def drain(force_exit: Callable[[], bool] = lambda: False) -> None:
        serving.begin_shutdown()
        await _drain(state, llm, shutdown_timeout, force_exit)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.llm = llm
    app.state.serving = serving
    app.state.server_state = state
    app.state.drain = drain

    check_api_key = api_key_dependency(api_key)

    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    app.add_exception_handler(RequestError, request_error)
    # NOTE: unexpected exceptions are answered by RequestGuard: Starlette's handler for Exception
    # re-raises after answering, and uvicorn then logs a ~120-line traceback per request.
    app.add_middleware(RequestGuard, state=state)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    async def read_request(request: Request, model: Any, prefix: str) -> Any:
        request.state.request_id = rid = random_id(prefix)
        body = await read_body(request, max_body_bytes, RequestError)
        req = await serving.run_blocking(parse_request, body, model)
        req._client = client_lane(request)
        return rid, req

    def respond(result: Any) -> Any:
        if result is DISCONNECTED:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        if isinstance(result, EventStream):
            return SSEResponse(result)
        return Response(result, media_type="application/json")  # encoded off the event loop

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> Any:
        return JSONResponse(serving.models().model_dump())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        rid, req = await read_request(request, ChatCompletionRequest, "chatcmpl")
        return respond(await with_cancellation(serving.create_chat_completion(req, rid), request))

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        rid, req = await read_request(request, CompletionRequest, "cmpl")
        return respond(await with_cancellation(serving.create_completion(req, rid), request))

    from specdec.entrypoints.openai import responses as api

    store = responses_store if responses_store is not None else response_store.ResponseStore()
    app.state.responses_store = store

    @v1.post("/responses")
    async def responses(request: Request) -> Any:
        """OpenAI's Responses API on the chat path (entrypoints/openai/responses.py)."""
        rid, req = await read_request(request, api.ResponsesRequest, "resp")
        turn = api.ResponseTurn.begin(rid, req, serving.served_model_names[0], store)
        try:
            chat = validated(turn.chat_body(), ChatCompletionRequest)
            chat._client = req._client
            result = await with_cancellation(serving.create_chat_completion(chat, rid), request)
        except RequestError as e:
            raise turn.renamed(e) from None
        if isinstance(result, EventStream):
            return SSEResponse(EventStream(turn.stream(result.events), result.stream))
        if result is DISCONNECTED:
            return respond(result)
        return Response(json.dumps(turn.finish(json.loads(result))), media_type="application/json")

    @v1.get("/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Any:
        stored = store.get(client_lane(request), response_id)
        if stored is None:
            raise api.not_found(response_id)
        return JSONResponse(stored.response)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Any:
        if not store.delete(client_lane(request), response_id):
            raise api.not_found(response_id)
        return JSONResponse(api.deleted(response_id))

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Any:
        return JSONResponse(utility.model_card(serving, model_id))

    app.include_router(v1)
    tools = APIRouter(dependencies=[Depends(check_api_key)])

    @tools.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        _, req = await read_request(request, utility.TokenizeRequest, "tok")
        return JSONResponse(await utility.tokenize(serving, req))

    @tools.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        _, req = await read_request(request, utility.DetokenizeRequest, "detok")
        return JSONResponse(await utility.detokenize(serving, req))

    app.include_router(tools)

    @app.get("/version")
    async def version() -> Any:
        return JSONResponse({"version": specdec.__version__})

    def not_ready() -> str | None:
        if llm.is_running:
            return None
        return f"engine is not running: {one_line(str(llm.dead_error), 200)}"

    add_health_routes(app, state, not_ready)

    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE)

    from specdec.entrypoints.openai.chat_page import add_chat_page

    add_chat_page(app)
    return app


async def _drain(
    state: ServerState, llm: Any, timeout: float, force_exit: Callable[[], bool]
) -> None:
    """Stop admitting; wait up to ``timeout`` s for running requests; end the rest (their streams
    get an error event and [DONE]) and give them a moment to reach the clients."""
    state.draining = True
    loop = asyncio.get_running_loop()
    if state.in_flight:
        logger.info(
            "shutting down: no new requests; waiting up to %g s for %d running",
            timeout,
            state.in_flight,
        )
    await wait_until(lambda: not state.in_flight or force_exit(), loop, timeout)
    if not state.in_flight:
        return
    reason = f"the server is shutting down (its {timeout:g} s shutdown timeout passed)"
    try:
        ended = await asyncio.wait_for(llm.abort_all(reason), 5.0)
    except Exception as e:  # noqa: BLE001 - the engine is gone: uvicorn cancels what is left
        logger.warning("shutting down: could not end the running requests: %s", e)
        return
    logger.warning("shutting down: ended %d request(s) still running", ended)
    await wait_until(lambda: not state.in_flight or force_exit(), loop, FLUSH_TIMEOUT_S)


# ---- running it --------------------------------------------------------------------------------

ENGINE_DEATH_GRACE_S = 1.0  # /health says why for this long before the process exits


async def _watch_engine(app: Any, llm: Any, state: Any) -> None:
    """A dead engine (a tensor-parallel worker gone, the loop crashed) cannot come back in this
    process: after ``ENGINE_DEATH_GRACE_S`` (/health answers 503 with the reason), the server
    stops and ``specdec serve`` exits with status 1, so that a supervisor (systemd, Kubernetes,
    the replica pool) starts it again. Without a hook (a server in tests), it keeps answering 503."""
    while llm.dead_error is None or state.draining:
        await asyncio.sleep(0.2)
    await asyncio.sleep(ENGINE_DEATH_GRACE_S)
    from specdec.entrypoints.openai.protocol import one_line

    exit_hook = getattr(app.state, "on_engine_death", None)
    if exit_hook is not None and not state.draining:
        logger.error(
            "the engine is not running (%s): the server exits with status 1 for a restart",
            one_line(str(llm.dead_error), 200),
        )
        app.state.engine_died = True
        exit_hook()


def make_server(config: Any) -> Any:
    """A uvicorn Server whose shutdown first runs the app's graceful drain (``app.state.drain``):
    on SIGTERM (or ``should_exit``) new requests get a 503 and running ones finish or are ended
    with an error event and ``[DONE]`` before uvicorn closes the connections."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            drain = getattr(getattr(self.config.app, "state", None), "drain", None)
            if drain is not None:
                await drain(lambda: self.force_exit)
            await super().shutdown(sockets)

    return _Server(config)


class BackgroundServer:
    """uvicorn on a daemon thread, bound to ``host:port`` (port 0: a free one). For tests/benches."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        head_limits: Any = None,
    ) -> None:
        import uvicorn

        from specdec.entrypoints.openai.connection import HeadLimits, guarded_protocol

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            app,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
            http=guarded_protocol(head_limits or HeadLimits()),
        )
        self.server = make_server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S + 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# vLLM's server flags beyond those make_arg_parser spells out, by disposition: (name, how the
# value parses: bool is --X/--no-X, "+" a list, "append" repeatable, else the value's type).
# Honoured: read by cmd_serve (uvicorn's socket, TLS and logging; the app's root path,
# middleware and docs). Prompt token details (cached_tokens) are always reported.
HONOURED_SERVER_FLAGS = (
    ("root_path", str), ("uds", str), ("ssl_keyfile", str), ("ssl_certfile", str),
    ("ssl_ca_certs", str), ("ssl_cert_reqs", int), ("ssl_ciphers", str),
    ("disable_uvicorn_access_log", bool), ("h11_max_incomplete_event_size", int),
    ("middleware", "append"), ("disable_fastapi_docs", bool),
    ("enable_prompt_tokens_details", bool),
)  # fmt: skip
# Without effect here: accepted, logged once when given.
IGNORED_SERVER_FLAGS = (
    ("disable_log_requests", bool), ("enable_log_requests", bool), ("enable_log_outputs", bool),
    ("enable_log_deltas", bool), ("max_log_len", int), ("log_config_file", str),
    ("log_error_stack", bool), ("disable_frontend_multiprocessing", bool),
    ("enable_auto_tool_choice", bool), ("tool_call_parser", str), ("tool_parser_plugin", str),
    ("exclude_tools_when_tool_choice_none", bool), ("tool_server", str),
    ("enable_request_id_headers", bool), ("api_server_count", int),
    ("default_chat_template_kwargs", json_value), ("return_tokens_as_token_ids", bool),
    ("enable_per_request_metrics", bool), ("enable_server_load_tracking", bool),
    ("enable_force_include_usage", bool), ("enable_tokenizer_info_endpoint", bool),
    ("cohere_is_reasoning_model", bool), ("cohere_format", str), ("tokens_only", bool),
    ("fingerprint_mode", str), ("fingerprint_value", str),
    ("data_parallel_supervisor_port", int), ("dp_supervisor_probe_interval_s", float),
    ("dp_supervisor_probe_timeout_s", float), ("dp_supervisor_probe_failure_threshold", int),
    ("disable_access_log_for_endpoints", str), ("allow_credentials", bool),
    ("allowed_methods", json_value), ("allowed_headers", json_value),
    ("enable_ssl_refresh", bool), ("h11_max_header_count", int), ("enable_offline_docs", bool),
    ("enable_flash_late_interaction", bool),
)  # fmt: skip
# Values that would change what clients get and cannot be honoured: (name, parse, the values
# accepted, why others are refused).
REFUSED_SERVER_FLAGS = (
    ("lora_modules", "+", (None,), "specdec loads no LoRA adapters"),
    ("response_role", str, (None, "assistant"), "replies always have role 'assistant'"),
    ("chat_template_content_format", str, (None, "auto", "string"),
     "message content reaches the chat template as text ('string')"),
    ("headless", bool, (None, False), "specdec serve always runs its API server"),
    ("grpc", bool, (None, False), "specdec serves HTTP only"),
    ("config", str, (None,), "no YAML option files; give the options as flags"),
)  # fmt: skip
# the vLLM server flags whose default is on (--no-X turns them off)
_ON_BY_DEFAULT = ("enable_log_deltas", "cohere_is_reasoning_model", "enable_flash_late_interaction")
_SHORT_FLAGS = {"api_server_count": ("-asc",)}


# what the honoured vLLM server flags do here
_HONOURED_HELP = {
    "root_path": "the app's path prefix behind a proxy",
    "uds": "listen on this Unix domain socket instead of --host/--port",
    "ssl_keyfile": "TLS: the private key file",
    "ssl_certfile": "TLS: the certificate file",
    "ssl_ca_certs": "TLS: CA certificates that client certificates are checked against",
    "ssl_cert_reqs": "TLS: client certificates (Python's ssl.CERT_*: 0 none, 2 required)",
    "ssl_ciphers": "TLS: the ciphers allowed",
    "disable_uvicorn_access_log": "no access log line per request",
    "h11_max_incomplete_event_size": "the largest incomplete HTTP event, in bytes",
    "middleware": "an ASGI middleware class (import path) to add; repeatable",
    "disable_fastapi_docs": "no /docs, /redoc or /openapi.json",
    "enable_prompt_tokens_details": "accepted: prompt token details are always reported",
}


def _add_vllm_flag(group: Any, name: str, parse: Any, help: str) -> None:
    """One of vLLM's server flags, parsed as vLLM parses it."""
    flags = (f"--{name.replace('_', '-')}", *_SHORT_FLAGS.get(name, ()))
    if parse is bool:
        default = True if name in _ON_BY_DEFAULT else None
        group.add_argument(
            *flags, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help
        )
    elif parse in ("+", "append"):
        nargs = "+" if parse == "+" else None
        action = "append" if parse == "append" else None
        group.add_argument(*flags, dest=name, nargs=nargs, action=action, default=None, help=help)
    else:
        group.add_argument(*flags, dest=name, type=parse, default=None, help=help)


def make_arg_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine flags (EngineArgs, as ``specdec generate``) plus vLLM's server flags, and
    llama.cpp's server sampling defaults (--temp, --top-k, --top-p, --repeat-penalty)."""
    EngineArgs.add_cli_args(p)
    add_sampling_args(p, {}, "the default of requests that set none")
    server = section_group(p, "server")
    common(server.add_argument("--host", default="127.0.0.1", help="address to bind"))
    common(server.add_argument("--port", type=int, default=8000, help="port to listen on"))
    common(server.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="name(s) clients use; default: the model",
    ))  # fmt: skip
    common(server.add_argument(
        "--api-key", nargs="+", default=None,
        help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV}); one key",
    ), "require 'Authorization: Bearer KEY'")  # fmt: skip
    server.add_argument(
        "--allowed-hosts",
        nargs="+",
        type=_name_list,
        default=None,
        help="Host header names to accept ('*' any, '*.example.com' its subdomains); default: "
        "the loopback names when bound to a loopback address, any otherwise",
    )
    server.add_argument(
        "--allowed-origins",
        nargs="+",
        type=_name_list,
        default=None,
        help="origins (https://app.example.com, or '*') that browsers may call from (CORS); "
        "default: none, CORS off",
    )
    common(server.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template itself) used instead of the model's: "
        "for base models, or to give a model's tools a template that lists them",
    ), "a chat template (a file, or the text) instead of the model's")  # fmt: skip
    server.add_argument(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accept a chat_template in requests (rendered in a sandboxed worker process with "
        "bounded time and memory); refused by default",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds running requests may take to finish before they are ended "
        f"with an error (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    server.add_argument(
        "--special-tokens-in-content",
        choices=["allow", "text", "reject"],
        default="allow",
        help="special-token strings (a chat turn marker such as <|im_start|>) in client text "
        "(message content, tools, completion prompts): 'allow' reads them as the special tokens "
        "(as vLLM; default), 'text' as plain characters, 'reject' answers 400; a request may ask "
        "for a stricter one in its special_tokens_in_content field",
    )
    server.add_argument(
        "--header-read-timeout",
        type=float,
        default=DEFAULT_HEADER_READ_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection must send its complete request head (request line and headers) "
        "within this many seconds of opening or of its request's first byte, else it is closed "
        f"(408); bodies and responses are not timed (default {DEFAULT_HEADER_READ_TIMEOUT_S:g}; 0 "
        "off)",
    )
    server.add_argument(
        "--max-pending-connections-per-client",
        type=int,
        default=DEFAULT_MAX_PENDING_PER_CLIENT,
        metavar="N",
        help="connections one client address may hold open without a complete request head; "
        f"those beyond are closed (429) (default {DEFAULT_MAX_PENDING_PER_CLIENT}; 0 no cap)",
    )
    server.add_argument(
        "--max-request-head-bytes",
        type=int,
        default=DEFAULT_MAX_HEAD_BYTES,
        metavar="BYTES",
        help=f"the largest request head accepted (431 beyond) (default {DEFAULT_MAX_HEAD_BYTES}; 0 "
        "no limit)",
    )
    server.add_argument(
        "--responses-store-size",
        type=int,
        default=response_store.DEFAULT_STORE_SIZE,
        metavar="N",
        help="/v1/responses kept in memory for previous_response_id and GET (all clients "
        f"together; least recently used out first) (default {response_store.DEFAULT_STORE_SIZE}; 0: "
        "none kept)",
    )
    server.add_argument(
        "--responses-store-bytes",
        type=int,
        default=response_store.DEFAULT_STORE_BYTES,
        metavar="BYTES",
        help="the stored responses' JSON, all clients together "
        f"(default {response_store.DEFAULT_STORE_BYTES})",
    )
    server.add_argument(
        "--metrics-prefix",
        choices=["both", "specdec", "vllm"],
        default="both",
        help="/metrics names: specdec:*, vLLM's vllm:* (what dashboards built for vLLM query), "
        "or both (default)",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    for name, parse in HONOURED_SERVER_FLAGS:
        _add_vllm_flag(server, name, parse, f"vLLM: {_HONOURED_HELP[name]}")
    ignored = section_group(p, "ignored")
    for name, parse in IGNORED_SERVER_FLAGS:
        _add_vllm_flag(ignored, name, parse, "no effect here: a vLLM server option")
    for name, parse, accepted, why in REFUSED_SERVER_FLAGS:
        shown = ", ".join(repr(v) for v in accepted if v is not None)
        what = f"accepted as {shown} only" if shown else "refused if given"
        _add_vllm_flag(ignored, name, parse, f"vLLM: {what} ({why})")
    parallel = section_group(p, "parallel")
    parallel.add_argument(
        "--replica-cpu-binding",
        default=None,
        help="with --data-parallel-size N: each replica's cores, '0-3|4-7' (one group per "
        "replica); default: the usable cores split evenly",
    )
    parallel.add_argument(
        "--replica-routing",
        choices=["affinity", "round_robin"],
        default="affinity",
        help="with --data-parallel-size: session, prefix and load affinity (default), or round "
        "robin (a baseline)",
    )
    ray = section_group(p, "ray")
    ray.add_argument("--ray", action="store_true", help="deploy on Ray Serve: one engine per replica behind one OpenAI ingress")  # fmt: skip
    ray.add_argument("--ray-address", default=None, help="join this Ray cluster ('auto': the local one started by `ray start`); default: start a local Ray")  # fmt: skip
    ray.add_argument("--num-replicas", type=int, default=1, help="engine replicas (fixed)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale from this many replicas")  # fmt: skip
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")  # fmt: skip
    ray.add_argument("--target-ongoing-requests", type=float, default=2.0, help="autoscaling target: ongoing requests per replica")  # fmt: skip
    ray.add_argument("--autoscaling-policy", default=None, metavar="MODULE:FUNCTION", help="a custom Ray Serve autoscaling policy (import path); it may read each replica's mean TTFT as ctx.aggregated_metrics['ttft_mean_s']")  # fmt: skip
    return p


def _name_list(value: str) -> list[str]:
    """One flag value: a name, or (as vLLM's flags take them) a JSON list of names."""
    if value.lstrip().startswith("["):
        names = json.loads(value)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return names
    return [value]


def _flatten(groups: list[list[str]] | None) -> list[str] | None:
    return None if groups is None else [name for group in groups for name in group]


def add_serve_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (vLLM-style)",
        usage="%(prog)s [MODEL] [options]",
    )
    p.sectioned = True  # NOTE: --help by section (entrypoints/arg_parser.py)
    common(
        section_group(p, "model").add_argument(
            "model_tag",
            nargs="?",
            default=None,
            metavar="MODEL",
            help="the model (same as --model)",
        )
    )
    make_arg_parser(p)
    p.set_defaults(func=cmd_serve)


def check_serve_args(args: argparse.Namespace) -> tuple[Any, Any, list[str] | None]:
    """Every flag checked (a bad one: exit 2) before anything loads: (engine args, engine
    config, accepted Host names). ``--data-parallel-size`` is the replicas' (one engine each)."""
    if not args.shutdown_timeout >= 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    head_limits(args)
    _check_server_flags(args)
    from specdec.entrypoints.openai.safety import default_allowed_hosts

    allowed_hosts = _flatten(args.allowed_hosts)
    if allowed_hosts is None:
        allowed_hosts = default_allowed_hosts(args.host)
    args.model = getattr(args, "model_tag", None) or args.model
    num_replicas = args.data_parallel_size
    if num_replicas < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {num_replicas}")
    args.data_parallel_size = 1
    try:
        # NOTE: every engine flag is checked (bad JSON, method, parallel size) before loading
        engine_args = EngineArgs.from_cli_args(args)
        config = engine_args.create_engine_config()
    finally:
        args.data_parallel_size = num_replicas
    return engine_args, config, allowed_hosts


def head_limits(args: argparse.Namespace) -> Any:
    """The request-head limits the flags give (a ConfigError naming a bad one)."""
    from specdec.entrypoints.openai.connection import HeadLimits

    timeout = args.header_read_timeout
    if not 0 <= timeout < float("inf"):
        raise ConfigError(f"--header-read-timeout must be a number of seconds >= 0, got {timeout}")
    for flag, value in (
        ("--max-pending-connections-per-client", args.max_pending_connections_per_client),
        ("--max-request-head-bytes", args.max_request_head_bytes),
    ):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    return HeadLimits(
        timeout_s=timeout,
        max_pending_per_client=args.max_pending_connections_per_client,
        max_head_bytes=args.max_request_head_bytes,
    )


def api_key_from(args: argparse.Namespace) -> str | None:
    return (args.api_key or [None])[0] or os.environ.get(API_KEY_ENV) or None


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate the flags, load the model, serve until interrupted (one engine)."""
    if args.ray or args.data_parallel_size != 1:
        raise ConfigError("--data-parallel-size / --ray: start replicas with `specdec serve`")
    engine_args, config, allowed_hosts = check_serve_args(args)
    spec = config.speculative
    # vLLM's --generation-config / --override-generation-config under llama.cpp's --temp ...
    defaults = {**engine_args.generation_defaults(), **sampling_defaults(args)}
    from specdec.sampling_params import SamplingParams

    SamplingParams(**defaults)  # bad sampling defaults: exit 2 before loading anything
    from specdec.model.registry import resolve_model_path

    root = str(resolve_model_path(config.model))  # NOTE: a hub id's files are local by now
    import prometheus_client

    prometheus_client.disable_created_metrics()  # as vLLM: no *_created series
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    log_ignored([name for name, parse in IGNORED_SERVER_FLAGS if _given(args, name, parse)])
    if args.tool_call_parser not in (None, "hermes"):
        logger.warning(
            "--tool-call-parser %s: tool_choice auto reads Hermes <tool_call> blocks only (models "
            "whose template writes them); tool_choice required and named functions work with "
            "any model whose template lists tools",
            args.tool_call_parser,
        )
    import uvicorn

    from specdec.engine.async_llm import AsyncLLM
    from specdec.engine.llm_engine import LLMEngine
    from specdec.metrics import PREFIX_CHOICES

    template = read_chat_template(args.chat_template) if args.chat_template else None
    # NOTE: the same engine construction as `specdec generate`, so every engine flag applies here.
    engine = LLMEngine(config)
    if template is not None:
        engine.tokenizer.chat_template = template
    engine.grammar_compiler.start()  # NOTE: not at the first structured request
    llm = AsyncLLM(engine, log_stats=not args.disable_log_stats)
    names = args.served_model_name or [args.model]
    api_key = api_key_from(args)
    app = build_app(
        llm,
        names,
        api_key=api_key,
        model_root=args.model,  # NOTE: as given (vLLM's root), never the resolved local path
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_hosts=allowed_hosts,
        allowed_origins=_flatten(args.allowed_origins),
        shutdown_timeout=args.shutdown_timeout,
        sampling_defaults=defaults,
        metrics_prefixes=PREFIX_CHOICES[args.metrics_prefix],
        per_request_spec_decode_metrics=_spec_metrics_level(args.per_request_spec_decode_metrics),
        special_tokens_in_content=args.special_tokens_in_content,
        responses_store=response_store.ResponseStore(
            args.responses_store_size, args.responses_store_bytes
        ),
    )
    _apply_app_flags(app, args)
    logger.info(
        "serving %s (%s) on %s/v1 (chat page: %s/), max_model_len %d, prefix caching: %s, speculation: %s",
        names[0], root, _address(args), _address(args), llm.max_model_len,
        "on" if args.enable_prefix_caching else "off",
        f"{spec.method} k={spec.num_speculative_tokens}" if spec else "off",
    )  # fmt: skip
    logger.info("KV cache: %s", llm.describe_kv_cache())
    logger.info(
        "API key: %s; accepted Host names: %s; CORS origins: %s; request chat templates: %s; "
        "special tokens in client text: %s",
        "required" if api_key else "none (anyone who can connect may use the server)",
        ", ".join(allowed_hosts) if allowed_hosts is not None else "any",
        ", ".join(_flatten(args.allowed_origins) or []) or "none",
        "trusted (sandboxed)" if args.trust_request_chat_template else "refused",
        args.special_tokens_in_content,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
        **_uvicorn_options(args),
    )
    server = make_server(config)
    app.state.on_engine_death = lambda: setattr(server, "should_exit", True)
    server.run()
    return 0 if server.started and not getattr(app.state, "engine_died", False) else 1


def _spec_metrics_level(value: str | None) -> str | None:
    """vLLM's --per-request-spec-decode-metrics: "summary" or None (off)."""
    if value == "detailed":
        logger.warning(
            "--per-request-spec-decode-metrics detailed: per-step lists are not kept; "
            "responses carry the summary"
        )
    return None if value in (None, "none") else "summary"


def _given(args: argparse.Namespace, name: str, parse: Any) -> bool:
    """A vLLM server flag was given a value other than its default."""
    value = getattr(args, name)
    default = (name in _ON_BY_DEFAULT) if parse is bool else None
    return value is not None and value != default


def _check_server_flags(args: argparse.Namespace) -> None:
    """One line naming the flag for a value specdec cannot honour (before anything loads)."""
    for name, _, accepted, why in REFUSED_SERVER_FLAGS:
        value = getattr(args, name)
        if value not in accepted:
            shown = " ".join(value) if isinstance(value, list) else value
            raise ConfigError(f"--{name.replace('_', '-')} {shown}: {why}")
    if args.api_key is not None and len(args.api_key) > 1:
        raise ConfigError("--api-key: specdec takes one key, got several")
    for flag in ("responses_store_size", "responses_store_bytes"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0")


def _uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's socket, TLS and access-log flags as uvicorn.Config arguments (those given)."""
    from specdec.entrypoints.openai.connection import guarded_protocol

    options = {name: getattr(args, name) for name in (
        "root_path", "uds", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs",
        "ssl_ciphers", "h11_max_incomplete_event_size",
    ) if getattr(args, name) is not None}  # fmt: skip
    options["http"] = guarded_protocol(head_limits(args))
    if args.disable_uvicorn_access_log:
        options["access_log"] = False
    return options


def _apply_app_flags(app: Any, args: argparse.Namespace) -> None:
    """--middleware (import paths: a class is added as ASGI middleware, a function as HTTP
    middleware, as vLLM does) and --disable-fastapi-docs."""
    import importlib
    import inspect

    for path in args.middleware or []:
        module, _, attr = path.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"--middleware {path}: cannot import it ({e})") from None
        if inspect.isclass(obj):
            app.add_middleware(obj)
        else:
            app.middleware("http")(obj)
    if args.disable_fastapi_docs:
        docs = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
        app.router.routes[:] = [
            r for r in app.router.routes if getattr(r, "path", None) not in docs
        ]


def _address(args: argparse.Namespace) -> str:
    if args.uds:
        return f"unix:{args.uds}"
    scheme = "https" if args.ssl_certfile else "http"
    return f"{scheme}://{args.host}:{args.port}"


def main(argv: list[str] | None = None) -> int:
    from specdec.entrypoints.arg_parser import ArgumentParser, expand_dotted, help_query, json_flags

    parser = ArgumentParser(
        prog="python -m specdec.entrypoints.openai.api_server", usage="%(prog)s [options]"
    )
    parser.sectioned = True
    make_arg_parser(parser)
    argv, parser.help_query = help_query(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(expand_dotted(argv, json_flags([parser])))
    return run_command(cmd_serve, args)


if __name__ == "__main__":
    sys.exit(main())
