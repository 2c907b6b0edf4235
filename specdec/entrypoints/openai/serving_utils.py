"""What the generation endpoints share besides the engine: error answers and JSON encoding."""

from __future__ import annotations

import json
import logging
from typing import Any

from specdec.engine.async_llm import EngineDeadError, EngineError, RequestFailed
from specdec.entrypoints.openai.protocol import RequestError, SamplingRequest, one_line
from specdec.entrypoints.openai.safety import for_log

# NOTE: the endpoints' one logger, named as before they were split
logger = logging.getLogger("specdec.entrypoints.openai.serving")

DONE = "data: [DONE]\n\n"
MAX_REASON_CHARS = 200  # of an engine's error message, in a response


def engine_error(e: EngineError, req_id: str, req: SamplingRequest | None = None) -> RequestError:
    """The response for a request the engine could not finish: the engine's reason cut to one
    short line, with the request id (and one log line). A failure the request's own constraint
    caused (its grammar over a limit) is a 400 naming the field."""
    reason = one_line(str(e), MAX_REASON_CHARS)
    if isinstance(e, RequestFailed) and reason.startswith("structured_outputs"):
        if req is not None:
            return req.error_for(reason)
        return RequestError(reason, param=reason.partition(":")[0])
    if isinstance(e, EngineDeadError):
        logger.warning("request %s ended: %s", req_id, for_log(reason))
        return RequestError(reason, status=503, code=None, type="service_unavailable")
    if not isinstance(e, RequestFailed):  # NOTE: the engine logs its per-request failures
        logger.error("request %s failed: %s", req_id, for_log(reason))
    return RequestError(
        f"request {req_id} failed: {reason}", status=500, code=None, type="internal_server_error"
    )


def shutting_down_error() -> RequestError:
    """The answer to a request the server will not admit: it is shutting down."""
    return RequestError(
        "the server is shutting down", status=503, code=None, type="service_unavailable"
    )


def internal_error(e: Exception, req_id: str) -> RequestError:
    """An unexpected exception: one log line with the request id (the traceback at debug)."""
    logger.error("request %s failed: %s: %s", req_id, type(e).__name__, for_log(e))
    logger.debug("request %s traceback", req_id, exc_info=e)
    return RequestError(
        f"internal server error ({type(e).__name__}); request id {req_id}",
        status=500,
        code=None,
        type="internal_server_error",
    )


_ITEMS_PER_DUMP = 64  # list items per json.dumps() call in encode_json
_MAX_NESTING = 4  # response.choices[i].logprobs.content: where the long lists are


def encode_json(content: Any) -> bytes:
    """A JSON body exactly as Starlette's JSONResponse encodes it, written in pieces.

    NOTE: one json.dumps() call holds the GIL throughout: a 5 MB reply in one call stopped the
    event loop for ~0.15 s. Containers near the top are written key by key and long lists
    ``_ITEMS_PER_DUMP`` items at a time, which joins to the same bytes."""
    parts: list[str] = []
    _encode_into(content, parts, 0)
    return "".join(parts).encode("utf-8")


def _dumps(value: Any) -> str:
    return json.dumps(
        value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    )


def _encode_into(value: Any, parts: list[str], depth: int) -> None:
    if isinstance(value, list) and len(value) > _ITEMS_PER_DUMP:
        pieces = (
            _dumps(value[i : i + _ITEMS_PER_DUMP])[1:-1]
            for i in range(0, len(value), _ITEMS_PER_DUMP)
        )
        parts.append(f"[{','.join(pieces)}]")
    elif isinstance(value, list) and value and depth < _MAX_NESTING:
        for i, item in enumerate(value):
            parts.append("," if i else "[")
            _encode_into(item, parts, depth + 1)
        parts.append("]")
    elif (
        isinstance(value, dict)
        and value
        and depth < _MAX_NESTING
        and all(isinstance(key, str) for key in value)  # json.dumps writes 5 as "5"
    ):
        for i, (key, item) in enumerate(value.items()):
            parts.append(("," if i else "{") + _dumps(key) + ":")
            _encode_into(item, parts, depth + 1)
        parts.append("}")
    else:
        parts.append(_dumps(value))


def error_event(err: RequestError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"
