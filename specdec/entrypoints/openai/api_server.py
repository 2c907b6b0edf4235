"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), started like vLLM's.

    specdec serve smollm2-135m --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
    python -m specdec.entrypoints.openai.api_server --model smollm2-135m --port 8000

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus). FastAPI and uvicorn are imported only when a server is built, so the
``specdec`` command stays quick for its other subcommands.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations, and the
# handlers are defined inside build_app next to the lazily imported classes they name.

import argparse
import asyncio
import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import Any

from specdec.config import ConfigError
from specdec.entrypoints.cli import add_engine_args, build_llm, run_command, speculative_from_args

logger = logging.getLogger("specdec.entrypoints.openai.api_server")

MAX_BODY_BYTES = 4 * 1024 * 1024
API_KEY_ENV = "SPECDEC_API_KEY"


# ---- the app ---------------------------------------------------------------------------------


def build_app(
    llm: Any,
    served_model_names: list[str],
    api_key: str | None = None,
    model_root: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> Any:
    """A FastAPI app serving ``llm`` (an AsyncLLM); its lifespan starts and stops the engine thread."""
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import ValidationError

    from specdec.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        RequestError,
        validation_error,
    )
    from specdec.entrypoints.openai.serving import EventStream, OpenAIServing
    from specdec.metrics import CONTENT_TYPE, EngineMetrics

    if llm.metrics is None:
        llm.metrics = EngineMetrics(served_model_names[0])
    serving = OpenAIServing(llm, served_model_names, model_root)

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
        try:
            yield
        finally:
            llm.shutdown()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.llm = llm
    app.state.serving = serving

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

    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        err = RequestError(
            f"internal server error: {type(exc).__name__}",
            status=500,
            code=None,
            type="internal_server_error",
        )
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(Exception, internal_error)

    async def read_body(request: Request, model: Any) -> Any:
        data = await _read_json(request, max_body_bytes, RequestError)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from e

    def respond(result: Any) -> Any:
        if result is _DISCONNECTED:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        if isinstance(result, EventStream):
            return SSEResponse(result)
        return JSONResponse(result)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> Any:
        return JSONResponse(serving.models().model_dump())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = await read_body(request, ChatCompletionRequest)
        return respond(await _with_cancellation(serving.create_chat_completion(req), request))

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        req = await read_body(request, CompletionRequest)
        return respond(await _with_cancellation(serving.create_completion(req), request))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Any:
        if llm.is_running:
            return Response(status_code=200)
        return JSONResponse(
            {"error": {"message": f"engine is not running: {llm.dead_error}"}}, status_code=503
        )

    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _read_json(request: Any, limit: int, error: type) -> Any:
    """The body as JSON, refusing bodies over ``limit`` bytes (413) and malformed JSON (400)."""
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
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise error("request body must be a JSON object", code="invalid_json")
    return data


_DISCONNECTED = object()


async def _with_cancellation(coro: Awaitable[Any], request: Any) -> Any:
    """Run ``coro`` until done or until the client disconnects (then cancel it, which aborts the
    request and frees its KV, and return ``_DISCONNECTED``)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        await asyncio.wait({task})  # let the cancellation run its clean-up
    if task.cancelled():
        return _DISCONNECTED
    return task.result()


async def _wait_disconnect(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- running it --------------------------------------------------------------------------------


class BackgroundServer:
    """uvicorn on a daemon thread, bound to ``host:port`` (port 0: a free one). For tests/benches."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
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

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_arg_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine flags of ``specdec generate`` plus vLLM's server flags."""
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use; default: the model",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})",
    )
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="only 1 (one CPU device)"
    )
    p.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic throughput log line"
    )
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])  # fmt: skip
    return p


def add_serve_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM-style)")
    p.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    make_arg_parser(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate the flags, load the model, serve until interrupted."""
    if args.tensor_parallel_size != 1:
        raise ConfigError(
            f"--tensor-parallel-size must be 1 (got {args.tensor_parallel_size}): specdec runs on one CPU device"
        )
    args.model = getattr(args, "model_tag", None) or args.model
    spec = speculative_from_args(args)  # bad JSON / method: exit 2 before loading anything
    from specdec.model.registry import resolve_model_path

    root = str(resolve_model_path(args.model))
    import prometheus_client

    prometheus_client.disable_created_metrics()  # as vLLM: no *_created series
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    import uvicorn

    from specdec.engine.async_llm import AsyncLLM

    # NOTE: the same engine construction as `specdec generate`, so every engine flag applies here.
    llm = AsyncLLM(build_llm(args, spec).engine, log_stats=not args.disable_log_stats)
    names = args.served_model_name or [args.model]
    app = build_app(
        llm, names, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, model_root=root
    )
    logger.info(
        "serving %s (%s) on http://%s:%d/v1, max_model_len %d, KV slots %d (%d running), "
        "prefix caching: %s, speculation: %s",
        names[0], root, args.host, args.port, llm.engine.max_model_len, llm.engine.kv.num_slots,
        llm.engine.scheduler.max_num_seqs, "on" if args.enable_prefix_caching else "off",
        f"{spec.method} k={spec.num_speculative_tokens}" if spec else "off",
    )  # fmt: skip
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = make_arg_parser(
        argparse.ArgumentParser(prog="python -m specdec.entrypoints.openai.api_server")
    )
    args = parser.parse_args(argv)
    return run_command(cmd_serve, args)


if __name__ == "__main__":
    sys.exit(main())
