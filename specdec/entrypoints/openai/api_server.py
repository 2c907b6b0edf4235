"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), started like vLLM's.

    specdec serve smollm2-135m --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
    python -m specdec.entrypoints.openai.api_server --model smollm2-135m --port 8000

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus). FastAPI and uvicorn are imported only when a server is built, so the
``specdec`` command stays quick for its other subcommands.

In front of every route (``RequestGuard``): the Host check (``--allowed-hosts``; DNS rebinding), POST
bodies only as ``application/json`` (a cross-origin "simple" POST from a web page cannot be),
503 while shutting down, the error answers of a client that keeps failing held back while others
are served (``--error-backoff``), and one log line, never a traceback, for an unexpected failure.
CORS is off unless ``--allowed-origins`` is given. On SIGTERM the server stops admitting, lets running
requests finish for ``--shutdown-timeout`` seconds, then ends the rest with an error event and
``[DONE]``.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations, and the
# handlers are defined inside functions next to the lazily imported classes they name (the
# routes themselves: routes.py, imported when an app is built).

import argparse
import asyncio
import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from specdec.config import ConfigError, common, log_ignored, section_group
from specdec.entrypoints.openai import response_store
from specdec.entrypoints.openai.error_backoff import DEFAULT_MAX_DELAY_S as DEFAULT_ERROR_BACKOFF_S
from specdec.entrypoints.openai.error_backoff import ErrorBackoff
from specdec.entrypoints.openai.server_args import (
    API_KEY_ENV,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    HONOURED_SERVER_FLAGS,
    IGNORED_SERVER_FLAGS,
    REFUSED_SERVER_FLAGS,
    api_key_from,
    check_serve_args,
    flatten_names,
    head_limits,
    ignored_flags_given,
    make_arg_parser,
)
from specdec.entrypoints.openai.server_common import (
    FORWARDED_CLIENT_SECRET_ENV,
    RequestGuard,
    ServerState,
    api_key_dependency,
    wait_until,
)
from specdec.entrypoints.utils import LOG_FORMAT, read_chat_template, run_command, sampling_defaults

logger = logging.getLogger("specdec.entrypoints.openai.api_server")

MAX_BODY_BYTES = 4 * 1024 * 1024
FLUSH_TIMEOUT_S = 3.0  # after the drain: for the last events and [DONE] to reach the clients

# NOTE: what moved to server_args.py, named here too (tests and the replicas' front use them)
__all__ = [
    "API_KEY_ENV", "DEFAULT_SHUTDOWN_TIMEOUT_S", "HONOURED_SERVER_FLAGS", "IGNORED_SERVER_FLAGS",
    "REFUSED_SERVER_FLAGS", "BackgroundServer", "add_serve_parser", "api_key_from", "build_app",
    "check_serve_args", "cmd_serve", "head_limits", "main", "make_arg_parser", "make_server",
]  # fmt: skip


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
    forwarded_client_secret: str | None = None,
    error_backoff_s: float = DEFAULT_ERROR_BACKOFF_S,
) -> Any:
    """A FastAPI app serving ``llm`` (an AsyncLLM); its lifespan starts and stops the engine thread.

    ``allowed_hosts`` None accepts any Host header (``specdec serve`` defaults to the loopback
    names when bound to loopback); ``allowed_origins`` None: no CORS. ``app.state.drain`` is the
    graceful shutdown that ``make_server``'s servers run on SIGTERM. ``responses_store`` keeps
    ``/v1/responses`` (default: ``ResponseStore()``; ``app.state.responses_store``).
    ``forwarded_client_secret``: a replica's (its front's secret): the caller a request's signed
    ``x-specdec-client`` header names is its client (``server_common.client_lane``).
    ``error_backoff_s``: the longest a failing client's error answer waits while others are
    served (``error_backoff``; 0: never).
    """
    from fastapi import FastAPI

    from specdec.entrypoints.openai.chat_sandbox import DEFAULT_TIMEOUT_S, TemplateSandbox
    from specdec.entrypoints.openai.routes import Endpoints, add_openai_routes, add_server_routes
    from specdec.entrypoints.openai.serving import OpenAIServing
    from specdec.metrics import METRIC_PREFIXES, EngineMetrics

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
    state = ServerState(
        allowed_hosts=list(allowed_hosts) if allowed_hosts is not None else None,
        error_backoff=ErrorBackoff(error_backoff_s),
        forwarded_secret=forwarded_client_secret,
    )

    async def drain(force_exit: Callable[[], bool] = lambda: False) -> None:
        serving.begin_shutdown()
        await _drain(state, llm, shutdown_timeout, force_exit)

    app = FastAPI(title="specdec", lifespan=_lifespan(llm, sandbox, serving, state))
    app.state.llm = llm
    app.state.serving = serving
    app.state.server_state = state
    app.state.drain = drain
    _install_checks(app, state, allowed_origins)
    store = responses_store if responses_store is not None else response_store.ResponseStore()
    app.state.responses_store = store
    endpoints = Endpoints(serving, max_body_bytes, forwarded_client_secret)
    add_openai_routes(app, endpoints, api_key_dependency(api_key), store)
    add_server_routes(app, llm, state)
    return app


def _lifespan(llm: Any, sandbox: Any, serving: Any, state: ServerState) -> Any:
    """The app's lifespan: the engine thread (and the template sandbox) for as long as it serves."""

    @asynccontextmanager
    async def lifespan(app: Any):
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

    return lifespan


def _install_checks(app: Any, state: ServerState, allowed_origins: list[str] | None) -> None:
    """OpenAI-style errors, ``RequestGuard`` in front of every route, and CORS when asked for."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from specdec.entrypoints.openai.protocol import RequestError

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


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate the flags, load the model, serve until interrupted (one engine)."""
    if args.ray or args.data_parallel_size != 1:
        raise ConfigError("--data-parallel-size / --ray: start replicas with `specdec serve`")
    engine_args, config, allowed_hosts = check_serve_args(args)
    # NOTE: set by the front that started this replica; not passed on to the engine's workers
    forwarded_secret = os.environ.pop(FORWARDED_CLIENT_SECRET_ENV, "") or None
    spec = config.speculative
    # vLLM's --generation-config / --override-generation-config under llama.cpp's --temp ...
    defaults = {**engine_args.generation_defaults(), **sampling_defaults(args)}
    from specdec.sampling_params import SamplingParams

    SamplingParams(**defaults)  # bad sampling defaults: exit 2 before loading anything
    from specdec.model.registry import resolve_model_path

    root = str(resolve_model_path(config.model))  # NOTE: a hub id's files are local by now
    _configure_logging(args)
    import uvicorn

    llm = _start_engine(args, config)
    app = _serving_app(args, llm, allowed_hosts, defaults, forwarded_secret)
    _apply_app_flags(app, args)
    _log_serving(args, app, root, spec, allowed_hosts)
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


def _configure_logging(args: argparse.Namespace) -> None:
    """Prometheus without *_created series (as vLLM), the log format, and one line each for the
    ignored vLLM flags and a tool-call parser other than Hermes."""
    import prometheus_client

    prometheus_client.disable_created_metrics()  # as vLLM: no *_created series
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    log_ignored(ignored_flags_given(args))
    if args.tool_call_parser not in (None, "hermes"):
        logger.warning(
            "--tool-call-parser %s: tool_choice auto reads Hermes <tool_call> blocks only (models "
            "whose template writes them); tool_choice required and named functions work with "
            "any model whose template lists tools",
            args.tool_call_parser,
        )


def _start_engine(args: argparse.Namespace, config: Any) -> Any:
    """The engine (``--chat-template`` instead of the model's) behind an AsyncLLM."""
    from specdec.engine.async_llm import AsyncLLM
    from specdec.engine.llm_engine import LLMEngine

    template = read_chat_template(args.chat_template) if args.chat_template else None
    # NOTE: the same engine construction as `specdec generate`, so every engine flag applies here.
    engine = LLMEngine(config)
    if template is not None:
        engine.tokenizer.chat_template = template
    engine.grammar_compiler.start()  # NOTE: not at the first structured request
    return AsyncLLM(engine, log_stats=not args.disable_log_stats)


def _serving_app(
    args: argparse.Namespace,
    llm: Any,
    allowed_hosts: list[str] | None,
    defaults: dict[str, Any],
    forwarded_secret: str | None = None,
) -> Any:
    """``build_app`` with what the flags say."""
    from specdec.metrics import PREFIX_CHOICES

    return build_app(
        llm,
        args.served_model_name or [args.model],
        api_key=api_key_from(args),
        model_root=args.model,  # NOTE: as given (vLLM's root), never the resolved local path
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_hosts=allowed_hosts,
        allowed_origins=flatten_names(args.allowed_origins),
        shutdown_timeout=args.shutdown_timeout,
        sampling_defaults=defaults,
        metrics_prefixes=PREFIX_CHOICES[args.metrics_prefix],
        per_request_spec_decode_metrics=_spec_metrics_level(args.per_request_spec_decode_metrics),
        special_tokens_in_content=args.special_tokens_in_content,
        responses_store=response_store.ResponseStore(
            args.responses_store_size, args.responses_store_bytes
        ),
        forwarded_client_secret=forwarded_secret,
        error_backoff_s=args.error_backoff,
    )


def _log_serving(
    args: argparse.Namespace, app: Any, root: str, spec: Any, allowed_hosts: list[str] | None
) -> None:
    """Where it serves, what, and who may call it."""
    llm, names = app.state.llm, app.state.serving.served_model_names
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
        "required" if api_key_from(args) else "none (anyone who can connect may use the server)",
        ", ".join(allowed_hosts) if allowed_hosts is not None else "any",
        ", ".join(flatten_names(args.allowed_origins) or []) or "none",
        "trusted (sandboxed)" if args.trust_request_chat_template else "refused",
        args.special_tokens_in_content,
    )


def _spec_metrics_level(value: str | None) -> str | None:
    """vLLM's --per-request-spec-decode-metrics: "summary" or None (off)."""
    if value == "detailed":
        logger.warning(
            "--per-request-spec-decode-metrics detailed: per-step lists are not kept; "
            "responses carry the summary"
        )
    return None if value in (None, "none") else "summary"


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
