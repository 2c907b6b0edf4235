"""The single server's routes, by family: the OpenAI API under /v1 (models, chat, completions,
responses), the tokenizer's (/tokenize, /detokenize), and the server's own (/version, /health,
/metrics, the chat page). ``api_server.build_app`` registers them in this order; this module is
imported only when a server is built (it imports FastAPI)."""

# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import json
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import specdec
from specdec.entrypoints.openai import responses as api
from specdec.entrypoints.openai import utility
from specdec.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    one_line,
    random_id,
)
from specdec.entrypoints.openai.response_store import ResponseStore
from specdec.entrypoints.openai.server_common import (
    DISCONNECTED,
    ServerState,
    add_health_routes,
    client_lane,
    parse_request,
    read_body,
    validated,
    with_cancellation,
)
from specdec.entrypoints.openai.serving import EventStream, OpenAIServing


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


class Endpoints:
    """What the route handlers share: reading a request into its model, answering a result."""

    def __init__(
        self, serving: OpenAIServing, max_body_bytes: int, forwarded_secret: str | None = None
    ) -> None:
        self.serving = serving
        self.max_body_bytes = max_body_bytes
        self.forwarded_secret = forwarded_secret  # a replica's: its front names the caller

    def client(self, request: Request) -> str:
        """The request's client (its tenant): ``server_common.client_lane``."""
        return client_lane(request, self.forwarded_secret)

    async def read(self, request: Request, model: Any, prefix: str) -> tuple[str, Any]:
        request.state.request_id = rid = random_id(prefix)
        body = await read_body(request, self.max_body_bytes, RequestError)
        req = await self.serving.run_blocking(parse_request, body, model)
        req._client = self.client(request)
        return rid, req

    @staticmethod
    def respond(result: Any) -> Any:
        if result is DISCONNECTED:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        if isinstance(result, EventStream):
            return SSEResponse(result)
        return Response(result, media_type="application/json")  # encoded off the event loop


def add_openai_routes(
    app: FastAPI, ep: Endpoints, check_api_key: Any, store: ResponseStore
) -> None:
    """/v1 (models, chat and text completions, responses), then /tokenize and /detokenize."""
    serving = ep.serving
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> Any:
        return JSONResponse(serving.models().model_dump())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        rid, req = await ep.read(request, ChatCompletionRequest, "chatcmpl")
        return ep.respond(
            await with_cancellation(serving.create_chat_completion(req, rid), request)
        )

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        rid, req = await ep.read(request, CompletionRequest, "cmpl")
        return ep.respond(await with_cancellation(serving.create_completion(req, rid), request))

    _add_responses_routes(v1, ep, store)

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Any:
        return JSONResponse(utility.model_card(serving, model_id))

    app.include_router(v1)
    tools = APIRouter(dependencies=[Depends(check_api_key)])

    @tools.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        _, req = await ep.read(request, utility.TokenizeRequest, "tok")
        return JSONResponse(await utility.tokenize(serving, req))

    @tools.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        _, req = await ep.read(request, utility.DetokenizeRequest, "detok")
        return JSONResponse(await utility.detokenize(serving, req))

    app.include_router(tools)


def _add_responses_routes(v1: APIRouter, ep: Endpoints, store: ResponseStore) -> None:
    """POST /v1/responses, and GET / DELETE of a stored response (by its client's lane)."""
    serving = ep.serving

    @v1.post("/responses")
    async def responses(request: Request) -> Any:
        """OpenAI's Responses API on the chat path (entrypoints/openai/responses.py)."""
        rid, req = await ep.read(request, api.ResponsesRequest, "resp")
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
            return ep.respond(result)
        return Response(json.dumps(turn.finish(json.loads(result))), media_type="application/json")

    @v1.get("/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Any:
        stored = store.get(ep.client(request), response_id)
        if stored is None:
            raise api.not_found(response_id)
        return JSONResponse(stored.response)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Any:
        if not store.delete(ep.client(request), response_id):
            raise api.not_found(response_id)
        return JSONResponse(api.deleted(response_id))


def add_server_routes(app: FastAPI, llm: Any, state: ServerState) -> None:
    """/version, /health (and its kin), /metrics and the chat page."""
    from specdec.entrypoints.openai.chat_page import add_chat_page
    from specdec.metrics import CONTENT_TYPE

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

    add_chat_page(app)
