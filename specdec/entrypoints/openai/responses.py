"""``/v1/responses``: OpenAI's Responses API (what newer clients and agent SDKs call; vLLM
serves it) on the chat completions path.

A request's ``input`` (a string, or items: messages whose content is a string or text parts,
``function_call`` and ``function_call_output``) and ``instructions`` (a system message first)
become a chat; sampling fields map to the chat's (``max_output_tokens`` to ``max_tokens``),
``tools`` (function tools) and ``tool_choice`` to the chat's tool calling, so calls are read out
of the model's text as the chat endpoint reads them. The answer is a ``response`` object whose
``output`` holds an assistant message of ``output_text`` and / or ``function_call`` items;
streamed, the Responses events (``response.created`` ... ``response.output_text.delta`` /
``response.function_call_arguments.delta`` ... ``response.completed``).

Responses created with ``store`` (the default) are kept in memory (``ResponseStore``: bounded
in count and bytes, least recently used out first) under their client's tenant, so
``previous_response_id`` continues a conversation (the stored input and output items, then the
new input; the earlier ``instructions`` are not carried over, as OpenAI) and
``GET`` / ``DELETE /v1/responses/{id}`` find them; another client's id reads as unknown.
Reasoning items, background responses and conversations are refused with a 400.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, StrictBool

from specdec.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    PositiveInt,
    RequestError,
    Seed,
    Temperature,
    TopP,
)
from specdec.entrypoints.openai.response_store import ResponseStore, StoredResponse

MAX_METADATA_KEYS = 16  # OpenAI's limits on ``metadata``
MAX_METADATA_CHARS = 512

_REFUSED = {
    "reasoning": "reasoning options are not supported",
    "background": "background responses are not supported",
    "conversation": "conversations are not stored: use previous_response_id or send the whole "
    "conversation as input",
}
_CHAT_FIELDS = (
    ("model", "model"), ("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
    ("top_p", "top_p"), ("seed", "seed"), ("user", "user"), ("cache_salt", "cache_salt"),
)  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")
_CALL_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces


class ResponsesRequest(OpenAIBaseModel):
    model: Annotated[str, Field(max_length=4096)] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stream: StrictBool = False
    store: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    metadata: dict[str, Annotated[str, Field(max_length=MAX_METADATA_CHARS)]] | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    _client: str = PrivateAttr("host:?")  # the tenant: api_server.client_lane

    def check_supported(self) -> None:
        for key, why in _REFUSED.items():
            if (self.model_extra or {}).get(key) not in (None, False, [], {}, ""):
                raise RequestError(why, param=key, code="unsupported_parameter")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise RequestError(f"metadata holds at most {MAX_METADATA_KEYS} keys", "metadata")


# ---- the store -----------------------------------------------------------------------------


def not_found(rid: str, param: str | None = None) -> RequestError:
    """The one answer for an id that is unknown, evicted, deleted or another client's."""
    what = "previous response" if param == "previous_response_id" else "response"
    return RequestError(f"{what} {rid!r:.300} not found", param=param, status=404, code="not_found")


def deleted(rid: str) -> dict[str, Any]:
    return {"id": rid, "object": "response.deleted", "deleted": True}


# ---- input items -----------------------------------------------------------------------------


def input_items(req: ResponsesRequest, known_call_ids: set[str]) -> list[dict[str, Any]]:
    """``input`` as canonical items (400s name ``input[i]...``); ``known_call_ids``: the calls
    earlier in the conversation, which a ``function_call_output`` must answer."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    items, call_ids = [], set(known_call_ids)
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            items.append(_message(item, where))
        elif kind == "function_call":
            items.append(_function_call(item, where))
            call_ids.add(items[-1]["call_id"])
        elif kind == "function_call_output":
            items.append(_function_call_output(item, where, call_ids))
        else:
            shown = kind if isinstance(item, dict) else type(item).__name__
            raise RequestError(
                f"{where}: only message, function_call and function_call_output items are "
                f"supported, got {shown!r:.60}",
                param=where,
            )
    return items


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A message item with its text: string content or text parts."""
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise RequestError(
            f"{where}.role must be user, assistant, system or developer", param=f"{where}.role"
        )
    return {"type": "message", "role": role, "content": _text(item.get("content"), where)}


def _text(content: Any, where: str, key: str = "content") -> str:
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                raise RequestError(
                    f"{where}.{key}[{j}]: only text parts are supported",
                    param=f"{where}.{key}[{j}]",
                )
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(f"{where}.{key} must be a string or text parts", param=f"{where}.{key}")
    return content


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A call the model made earlier (sent back inline)."""
    call = {"type": "function_call"}
    for key in ("call_id", "name", "arguments"):
        value = item.get(key)
        if not isinstance(value, str) or (key != "arguments" and not _CALL_ID.fullmatch(value)):
            raise RequestError(
                f"{where}.{key} must be a string"
                + ("" if key == "arguments" else " of 1-256 printable characters"),
                param=f"{where}.{key}",
            )
        call[key] = value
    return call


def _function_call_output(item: dict[str, Any], where: str, call_ids: set[str]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or call_id not in call_ids:
        raise RequestError(
            f"{where}.call_id: no function_call with this call_id earlier in the conversation",
            param=f"{where}.call_id",
        )
    output = _text(item.get("output"), where, "output")
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def chat_messages(
    items: list[dict[str, Any]], sources: list[str] | None = None
) -> tuple[list[dict[str, Any]], list[tuple[str, bool]]]:
    """Canonical items as chat messages: calls join the assistant message before them (one
    message, as the chat endpoint writes a reply with calls), outputs become ``tool`` messages.
    Also, per message, the field it came from (``sources[i]`` for item i) and whether the
    message's own fields are that item's (an ``input[i]`` message's are; calls' are not)."""
    messages: list[dict[str, Any]] = []
    origins: list[tuple[str, bool]] = []
    for i, item in enumerate(items):
        kind, source = item["type"], sources[i] if sources else "input"
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if messages and messages[-1]["role"] == "assistant":
                origins[-1] = (origins[-1][0], False)
            else:
                messages.append({"role": "assistant", "content": ""})
                origins.append((source, False))
            messages[-1].setdefault("tool_calls", []).append(call)
            continue
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
        else:
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        origins.append((source, kind == "message" and source.startswith("input[")))
    return messages, origins


def history(stored: StoredResponse) -> list[dict[str, Any]]:
    """The conversation up to and including a stored response, as input items."""
    out = []
    for item in stored.response["output"]:
        if item["type"] == "message":
            out.append(_message(item, "output"))
        elif item["type"] == "function_call":
            out.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return [*stored.items, *out]


# ---- tools -----------------------------------------------------------------------------------


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "parameters", ...}``) in the
    chat's shape; other tool types are a 400 naming ``tools[i].type``."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise RequestError(
                f'tools[{i}].type: only "function" tools are supported, got '
                f"{tool.get('type')!r:.40}",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``{"type": "function", "name": ...}`` in the chat's shape; strings as they are."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError(
            'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _echo_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    keys = ("type", "name", "description", "parameters", "strict")
    return [{k: t.get(k) for k in keys} for t in tools or []]


# ---- one request -----------------------------------------------------------------------------


@dataclass
class ResponseTurn:
    """One ``POST /v1/responses``: its conversation, the chat request it makes, and the
    response (streamed or not) built from the chat's answer and kept in the store."""

    rid: str
    req: ResponsesRequest
    model: str
    store: ResponseStore
    items: list[dict[str, Any]]  # the conversation's input items (history, then this input)
    num_history: int  # how many of them came from previous_response_id
    created: float = field(default_factory=time.time)

    @classmethod
    def begin(
        cls, rid: str, req: ResponsesRequest, model: str, store: ResponseStore
    ) -> ResponseTurn:
        """Check the request and resolve ``previous_response_id`` in the client's tenant."""
        req.check_supported()
        past: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = store.get(req._client, req.previous_response_id)
            if stored is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            past = history(stored)
        known = {it["call_id"] for it in past if it["type"] == "function_call"}
        items = [*past, *input_items(req, known)]
        if not items and not req.instructions:
            raise RequestError("input holds no item", param="input")
        return cls(rid, req, req.model or model, store, items, len(past))

    def chat_body(self) -> dict[str, Any]:
        """The chat completions request this one asks for."""
        req = self.req
        body: dict[str, Any] = {"messages": self._chat_messages()[0], "stream": req.stream}
        for src, dst in _CHAT_FIELDS:
            value = getattr(req, src)
            if value is not None:
                body[dst] = value
        if req.tools is not None:
            body["tools"] = _tools(req.tools)
        if req.tool_choice is not None:
            body["tool_choice"] = _tool_choice(req.tool_choice)
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def renamed(self, e: RequestError) -> RequestError:
        """A chat error as this endpoint's: the field named as this request names it."""
        if not e.param:
            return e
        e.param = re.sub(r"^tools(\[\d+\])\.function\.", r"tools\1.", e.param)
        e.param = re.sub(r"^tool_choice\.function\.", "tool_choice.", e.param)
        e.param = re.sub(r"^max_tokens\b", "max_output_tokens", e.param)
        found = re.match(r"messages(?:\[(\d+)\](.*))?$", e.param)
        if found:
            _, sources = self._chat_messages()
            k = int(found[1]) if found[1] is not None else -1
            source, exact = sources[k] if 0 <= k < len(sources) else ("input", False)
            e.param = source + (found[2] if exact else "")
        return e

    def _chat_messages(self) -> tuple[list[dict[str, Any]], list[tuple[str, bool]]]:
        """The chat's messages, and what each came from (``chat_messages``)."""
        sources = ["previous_response_id"] * self.num_history
        if isinstance(self.req.input, str):
            sources.append("input")
        else:
            sources += [f"input[{i}]" for i in range(len(self.items) - self.num_history)]
        messages, origins = chat_messages(self.items, sources)
        if self.req.instructions:
            messages.insert(0, {"role": "system", "content": self.req.instructions})
            origins.insert(0, ("instructions", False))
        return messages, origins

    # ---- the answer ------------------------------------------------------------------------

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
        incomplete: dict[str, str] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The ``response`` object."""
        req = self.req
        return {
            "id": self.rid,
            "object": "response",
            "created_at": int(self.created),
            "model": self.model,
            "status": status,
            "incomplete_details": incomplete,
            "error": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": _echo_tools(req.tools),
            "text": {"format": {"type": "text"}},
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _done(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.req.store and response["status"] in ("completed", "incomplete"):
            self.store.put(self.req._client, response, self.items)
        return response

    def finish(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response for a finished chat completion's JSON (stored where asked)."""
        choice = chat["choices"][0]
        message = choice["message"]
        calls = self._calls(message.get("tool_calls") or [])
        output = [self._call_item(c, "completed") for c in calls]
        content = message.get("content") or ""
        if content or not calls:
            output.insert(0, _message_item(self.rid, content, "completed"))
        status, incomplete = _status(choice.get("finish_reason"))
        return self._done(self.response(status, output, _usage(chat.get("usage")), incomplete))

    def _calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return calls[:1] if not self.req.parallel_tool_calls else calls

    @staticmethod
    def _call_item(
        call: dict[str, Any], status: str, arguments: str | None = None
    ) -> dict[str, Any]:
        fn = call["function"]
        return {
            "type": "function_call",
            "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments,
            "status": status,
        }

    async def stream(self, chat_events: AsyncIterator[str]) -> AsyncIterator[str]:
        """The Responses stream of a chat completion's SSE stream."""
        out = _StreamWriter(self)
        yield out.event("response.created", response=self.response("in_progress", [], None))
        yield out.event("response.in_progress", response=self.response("in_progress", [], None))
        usage, finish, error, calls = None, None, None, []
        try:
            async for raw in chat_events:
                for ev in _chat_chunks(raw):
                    if "error" in ev:
                        error = ev["error"]
                        continue
                    usage = ev.get("usage") or usage
                    for choice in ev.get("choices") or []:
                        delta = choice.get("delta") or {}
                        for text in out.text(delta.get("content") or ""):
                            yield text
                        calls += delta.get("tool_calls") or []
                        finish = choice.get("finish_reason") or finish
        finally:
            await chat_events.aclose()  # type: ignore[attr-defined]
        if error is not None:
            yield out.failed(str(error.get("message", "")), _usage(usage))
            return
        for ev in out.close_text(force=not calls):
            yield ev
        for call in self._calls(calls):
            for ev in out.call(call):
                yield ev
        status, incomplete = _status(finish)
        done = self._done(self.response(status, out.output, _usage(usage), incomplete))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield out.event(kind, response=done)


class _StreamWriter:
    """The events of one streamed response, numbered, and the output items they add up to."""

    def __init__(self, turn: ResponseTurn) -> None:
        self.turn = turn
        self.seq = -1
        self.output: list[dict[str, Any]] = []
        self.texts: list[str] | None = None  # the open message's text, None: no message yet

    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        body = json.dumps({"type": kind, "sequence_number": self.seq, **data}, ensure_ascii=False)
        return f"event: {kind}\ndata: {body}\n\n"

    def _part(self, **data: Any) -> dict[str, Any]:
        return {"item_id": f"msg_{self.turn.rid}", "output_index": len(self.output), **data}

    def text(self, delta: str) -> list[str]:
        """A text delta, opening the message item first."""
        if not delta:
            return []
        events = []
        if self.texts is None:
            self.texts = []
            item = {**_message_item(self.turn.rid, "", "in_progress"), "content": []}
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.output), item=item))  # fmt: skip
            events.append(self.event("response.content_part.added",
                                     **self._part(content_index=0, part=_text_part(""))))  # fmt: skip
        self.texts.append(delta)
        events.append(self.event("response.output_text.delta",
                                 **self._part(content_index=0, delta=delta, logprobs=[])))  # fmt: skip
        return events

    def close_text(self, force: bool) -> list[str]:
        """Close the message item (``force``: an empty one where none was opened)."""
        if self.texts is None and not force:
            return []
        events = [] if self.texts is not None else self._empty_message()
        full = "".join(self.texts or [])
        part = self._part(content_index=0)
        events.append(self.event("response.output_text.done", **part, text=full, logprobs=[]))
        events.append(self.event("response.content_part.done", **part, part=_text_part(full)))
        item = _message_item(self.turn.rid, full, "completed")
        events.append(self.event("response.output_item.done",
                                 output_index=len(self.output), item=item))  # fmt: skip
        self.output.append(item)
        self.texts = None
        return events

    def _empty_message(self) -> list[str]:
        item = {**_message_item(self.turn.rid, "", "in_progress"), "content": []}
        return [
            self.event("response.output_item.added", output_index=len(self.output), item=item),
            self.event("response.content_part.added",
                       **self._part(content_index=0, part=_text_part(""))),
        ]  # fmt: skip

    def call(self, call: dict[str, Any]) -> list[str]:
        """One function call's events (its arguments arrive whole, in one delta)."""
        index, done = len(self.output), self.turn._call_item(call, "completed")
        added = self.turn._call_item(call, "in_progress", arguments="")
        where = {"item_id": done["id"], "output_index": index}
        self.output.append(done)
        return [
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", **where,
                       delta=done["arguments"]),
            self.event("response.function_call_arguments.done", **where,
                       arguments=done["arguments"], name=done["name"]),
            self.event("response.output_item.done", output_index=index, item=done),
        ]  # fmt: skip

    def failed(self, message: str, usage: dict[str, Any] | None) -> str:
        output = list(self.output)
        if self.texts is not None:
            output.append(_message_item(self.turn.rid, "".join(self.texts), "incomplete"))
        failed = self.turn.response("failed", output, usage)
        failed["error"] = {"code": "server_error", "message": message}
        return self.event("response.failed", response=failed)


# ---- shapes ----------------------------------------------------------------------------------


def _chat_chunks(raw: str) -> list[dict[str, Any]]:
    """The JSON chunks of one chat SSE event ("data: {...}"; [DONE] and blank lines skipped)."""
    return [
        json.loads(line[len("data: ") :])
        for line in raw.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat_usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage.get("total_tokens", 0),
    }


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{rid}",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }
