"""``POST /v1/responses``: OpenAI's Responses API (what newer clients and agent SDKs call; vLLM
serves it), text in and text out, on the chat completions path.

A request's ``input`` (a string, or message items whose content is a string or ``input_text``
/ ``output_text`` parts) and ``instructions`` (a system message first) become a chat; sampling
fields map to the chat's (``max_output_tokens`` to ``max_tokens``). The answer is a ``response``
object with one assistant message of ``output_text``; streamed, the Responses events
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``). Stored
responses (``previous_response_id``), tools and reasoning items are refused with a 400.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import Field, StrictBool

from specdec.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    PositiveInt,
    RequestError,
    Seed,
    Temperature,
    TopP,
)

# the chat fields whose errors name another field here
_PARAMS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
}
_REFUSED = {
    "previous_response_id": "stored responses are not kept: send the whole conversation as input",
    "tools": "tools are not supported on /v1/responses (use /v1/chat/completions)",
    "reasoning": "reasoning options are not supported",
    "background": "background responses are not supported",
    "conversation": "conversations are not stored: send the whole conversation as input",
}


class ResponsesRequest(OpenAIBaseModel):
    model: Annotated[str, Field(max_length=4096)] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stream: StrictBool = False
    store: StrictBool = True  # accepted: nothing is stored
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completions request this one asks for (RequestError naming the field)."""
        for key, why in _REFUSED.items():
            if (self.model_extra or {}).get(key) not in (None, False, [], {}, ""):
                raise RequestError(why, param=key, code="unsupported_parameter")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [_message(item, i) for i, item in enumerate(self.input)]
        if not messages:
            raise RequestError("input holds no message", param="input")
        body: dict[str, Any] = {"messages": messages, "stream": self.stream}
        for src, dst in (("model", "model"), ("max_output_tokens", "max_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                         ("user", "user"), ("cache_salt", "cache_salt")):  # fmt: skip
            value = getattr(self, src)
            if value is not None:
                body[dst] = value
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def _message(item: Any, i: int) -> dict[str, Any]:
    """An input item as a chat message: a message with string content or text parts."""
    where = f"input[{i}]"
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise RequestError(f"{where}: only message items are supported, got {kind!r}", param=where)
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise RequestError(
            f"{where}.role must be user, assistant, system or developer", param=f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text",
                "output_text",
                "text",
            ):
                raise RequestError(
                    f"{where}.content[{j}]: only text parts are supported",
                    param=f"{where}.content[{j}]",
                )
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(
            f"{where}.content must be a string or text parts", param=f"{where}.content"
        )
    return {"role": "system" if role == "developer" else role, "content": content}


def _chat_chunks(raw: str) -> list[dict[str, Any]]:
    """The JSON chunks of one chat SSE event ("data: {...}"; [DONE] and blank lines skipped)."""
    return [
        json.loads(line[len("data: ") :])
        for line in raw.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def renamed(e: RequestError) -> RequestError:
    """A chat error as this endpoint's: the field named as a Responses request names it."""
    if e.param:
        head, dot, rest = e.param.partition(".")
        base = head.split("[", 1)[0]
        if base in _PARAMS:
            e.param = _PARAMS[base] + head[len(base) :] + dot + rest
    return e


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat_usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage.get("total_tokens", 0),
    }


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{rid}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def response_object(
    rid: str, req: ResponsesRequest, model: str, created: float, status: str,
    text: str | None, usage: dict[str, Any] | None, incomplete: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The ``response`` object (``text`` None: no output yet)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(created),
        "model": model,
        "status": status,
        "incomplete_details": incomplete,
        "error": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "output": [] if text is None else [_message_item(rid, text, "completed")],
        "parallel_tool_calls": False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "usage": usage,
        "metadata": {},
    }


def from_chat(rid: str, req: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """The response for a finished chat completion's JSON."""
    choice = chat["choices"][0]
    status, incomplete = _status(choice.get("finish_reason"))
    return response_object(
        rid, req, chat.get("model", req.model or ""), chat.get("created", time.time()), status,
        choice["message"].get("content") or "", _usage(chat.get("usage")), incomplete,
    )  # fmt: skip


async def stream_events(
    rid: str, req: ResponsesRequest, model: str, chat_events: AsyncIterator[str]
) -> AsyncIterator[str]:
    """The Responses stream of a chat completion's SSE stream."""
    created, seq, text = time.time(), 0, []
    usage, finish, error = None, None, None

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return (
            f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n"
        )

    item = {"item_id": f"msg_{rid}", "output_index": 0, "content_index": 0}
    yield event(
        "response.created",
        response=response_object(rid, req, model, created, "in_progress", None, None),
    )
    yield event(
        "response.in_progress",
        response=response_object(rid, req, model, created, "in_progress", None, None),
    )
    yield event(
        "response.output_item.added",
        output_index=0,
        item={**_message_item(rid, "", "in_progress"), "content": []},
    )
    yield event("response.content_part.added", item_id=item["item_id"], output_index=0, content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})  # fmt: skip
    try:
        async for raw in chat_events:
            for ev in _chat_chunks(raw):
                if "error" in ev:
                    error = ev["error"]
                    continue
                usage = ev.get("usage") or usage
                for choice in ev.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        text.append(delta)
                        yield event("response.output_text.delta", **item, delta=delta, logprobs=[])
                    finish = choice.get("finish_reason") or finish
    finally:
        await chat_events.aclose()  # type: ignore[attr-defined]
    full = "".join(text)
    if error is not None:
        failed = response_object(rid, req, model, created, "failed", full, _usage(usage))
        failed["error"] = {"code": "server_error", "message": str(error.get("message", ""))}
        yield event("response.failed", response=failed)
        return
    yield event("response.output_text.done", **item, text=full, logprobs=[])
    yield event("response.content_part.done", item_id=item["item_id"], output_index=0, content_index=0,
                part={"type": "output_text", "text": full, "annotations": [], "logprobs": []})  # fmt: skip
    yield event(
        "response.output_item.done", output_index=0, item=_message_item(rid, full, "completed")
    )
    status, incomplete = _status(finish)
    done = response_object(rid, req, model, created, status, full, _usage(usage), incomplete)
    yield event(
        "response.completed" if status == "completed" else "response.incomplete", response=done
    )
