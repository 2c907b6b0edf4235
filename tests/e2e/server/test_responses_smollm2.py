"""/v1/responses on smollm2-135m (served with --chat-template chatml-tools) through the official
client: stored responses continued with previous_response_id (the rendered prompt holds the
earlier turns), GET / DELETE, per-client isolation, the stream's events checked against the
client's own types, and a function-call round trip (call, function_call_output, text)."""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent

from specdec.entrypoints.utils import read_chat_template
from tests.fixtures.server import _start

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
GREEDY = {"model": "tiny", "temperature": 0}
# the client's event classes by their ``type`` (its union discriminates with its own marker)
EVENTS = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


@pytest.fixture(scope="module")
def smol():
    srv = _start("smollm2-135m", max_model_len=1024, max_num_batched_tokens=256)
    srv.server.config.app.state.llm.engine.tokenizer.chat_template = read_chat_template(
        "chatml-tools"
    )
    yield srv
    srv.stop()


def _client(srv, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def _count(srv, messages: list[dict], **kw) -> int:
    r = httpx.post(f"{srv.url}/tokenize", json={"messages": messages, **kw}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.json()["count"]


def _events(srv, body: dict, key: str = "key-a") -> list:
    """The raw stream, each event validated as the client's ResponseStreamEvent union."""
    headers = {"Authorization": f"Bearer {key}"}
    out = []
    with httpx.stream(
        "POST", f"{srv.url}/v1/responses", json={**body, "stream": True}, headers=headers,
        timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == kind
                ev = EVENTS[kind].model_validate(data)  # strict: every required field
                out.append(ev)
    assert [ev.sequence_number for ev in out] == list(range(len(out)))
    return out


def test_previous_response_id_continues_the_conversation(smol) -> None:
    client = _client(smol)
    first = client.responses.create(
        input="My name is Ada. Say hello.", max_output_tokens=12, **GREEDY
    )
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=12, **GREEDY
    )
    assert second.previous_response_id == first.id
    chat = [
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == _count(smol, chat)
    # the same conversation sent inline reads the same, and says the same
    inline = client.responses.create(input=chat, max_output_tokens=12, **GREEDY)
    assert inline.usage.input_tokens == second.usage.input_tokens
    assert inline.output_text == second.output_text
    # a third turn holds both earlier ones; instructions are not carried over
    third = client.responses.create(
        input="Thanks.", previous_response_id=second.id, instructions="Be brief.",
        max_output_tokens=4, **GREEDY,
    )  # fmt: skip
    chat += [{"role": "assistant", "content": second.output_text}]
    chat += [{"role": "user", "content": "Thanks."}]
    system = [{"role": "system", "content": "Be brief."}]
    assert third.usage.input_tokens == _count(smol, system + chat)
    # GET gives back what was answered; DELETE forgets it
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(third.id)


def test_a_client_never_reads_another_clients_responses(smol) -> None:
    """Another API key gets the same 404 for an id it does not own as for one that never
    existed (GET, DELETE, previous_response_id), and the owner keeps its response."""
    mine, theirs = _client(smol, "key-a"), _client(smol, "key-b")
    kept = mine.responses.create(input="A secret: 42.", max_output_tokens=4, **GREEDY)
    never = "resp-" + "0" * (len(kept.id) - len("resp-"))
    for rid in (kept.id, never):
        with pytest.raises(openai.NotFoundError) as got:
            theirs.responses.retrieve(rid)
        assert got.value.body == {
            "message": f"response {rid!r} not found", "type": "invalid_request_error",
            "param": None, "code": "not_found",
        }  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            theirs.responses.delete(rid)
        with pytest.raises(openai.NotFoundError) as got:
            theirs.responses.create(input="Go on.", previous_response_id=rid, **GREEDY)
        assert got.value.body["param"] == "previous_response_id"
        assert got.value.body["message"] == f"previous response {rid!r} not found"
    assert mine.responses.retrieve(kept.id).output_text == kept.output_text


def test_the_stream_is_the_openai_event_sequence(smol) -> None:
    body = {**GREEDY, "input": "Tell me about cats.", "max_output_tokens": 10}
    whole = _client(smol).responses.create(**body)
    events = _events(smol, body)
    kinds = [ev.type for ev in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]  # fmt: skip
    final = events[-1].response
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text == events[-4].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    # a streamed response is stored, and continues like any other
    later = _client(smol).responses.create(
        input="More.", previous_response_id=final.id, max_output_tokens=2, **GREEDY
    )
    assert later.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens


def test_a_function_call_round_trip(smol) -> None:
    """A named tool_choice makes the model call; its function_call_output, fed back with
    previous_response_id or inline, renders the same prompt, and the model answers in text."""
    client = _client(smol)
    ask = "What is the weather in Paris?"
    called = client.responses.create(
        input=ask, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40, **GREEDY,
    )  # fmt: skip
    assert [item.type for item in called.output] == ["function_call"]
    call = called.output[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo", "Lima")
    assert called.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}
    answer = client.responses.create(
        input=[result], previous_response_id=called.id, tools=[WEATHER], tool_choice="none",
        max_output_tokens=16, **GREEDY,
    )  # fmt: skip
    assert answer.output[0].type == "message" and answer.output_text
    chat = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 22 C"},
    ]  # fmt: skip
    assert answer.usage.input_tokens == _count(smol, chat)
    inline = client.responses.create(
        input=[
            {"role": "user", "content": ask},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            result,
        ],
        tools=[WEATHER], tool_choice="none", max_output_tokens=16, **GREEDY,
    )  # fmt: skip
    assert inline.usage.input_tokens == answer.usage.input_tokens
    assert inline.output_text == answer.output_text


def test_a_streamed_function_call(smol) -> None:
    body = {
        **GREEDY, "input": "What is the weather in Oslo?", "tools": [WEATHER],
        "tool_choice": "required", "max_output_tokens": 60,
    }  # fmt: skip
    events = _events(smol, body)
    kinds = [ev.type for ev in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-5:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    added, delta, done, item_done, completed = events[-5:]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert delta.item_id == done.item_id == added.item.id == item_done.item.id
    assert delta.delta == done.arguments == item_done.item.arguments
    assert json.loads(done.arguments)["city"] in ("Paris", "Oslo", "Lima")
    assert completed.response.output[-1].call_id == added.item.call_id
    # its output can be sent back
    again = _client(smol).responses.create(
        input=[{"type": "function_call_output", "call_id": added.item.call_id, "output": "Cold"}],
        previous_response_id=completed.response.id, max_output_tokens=4, **GREEDY,
    )  # fmt: skip
    assert again.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{**WEATHER, "name": "no spaces"}]}, "tools[0].name"),
        ({"tools": [{**WEATHER, "parameters": "x"}]}, "tools[0].parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": 1}]},
         "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}]},
         "input[1].output[0]"),
        ({"max_output_tokens": 2000}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_bad_tool_input_names_the_field(smol, body: dict, param: str) -> None:
    r = httpx.post(
        f"{smol.url}/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=30
    )
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.text[:300]
