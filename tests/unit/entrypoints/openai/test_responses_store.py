"""The responses store (caps, LRU, tenants) and how Responses input items become a chat."""

from __future__ import annotations

import pytest

from specdec.entrypoints.openai.protocol import RequestError
from specdec.entrypoints.openai.response_store import ResponseStore
from specdec.entrypoints.openai.responses import ResponsesRequest, ResponseTurn, chat_messages


def _response(rid: str, text: str = "hi") -> dict:
    return {"id": rid, "output": [{"type": "message", "role": "assistant", "content": text}]}


def test_count_cap_evicts_the_least_recently_used() -> None:
    store = ResponseStore(max_entries=2)
    store.put("a", _response("r1"), [])
    store.put("a", _response("r2"), [])
    assert store.get("a", "r1") is not None  # r2 is now the oldest
    store.put("a", _response("r3"), [])
    assert store.get("a", "r2") is None and store.get("a", "r1") and store.get("a", "r3")
    assert store.num_entries == 2


def test_byte_cap_and_an_entry_over_it() -> None:
    one = ResponseStore().put("a", _response("r0", "x" * 100), [])
    store = ResponseStore(max_bytes=250)
    assert one and store.put("a", _response("r1", "x" * 100), [])
    assert store.put("a", _response("r2", "x" * 100), [])
    assert store.get("a", "r1") is None and store.num_bytes <= 250
    assert not store.put("a", _response("big", "x" * 300), [])
    assert not ResponseStore(max_entries=0).put("a", _response("r"), [])


def test_tenants_never_see_each_other_and_a_flood_evicts_its_own() -> None:
    store = ResponseStore(max_entries=3)
    store.put("alice", _response("r1"), [])
    assert store.get("bob", "r1") is None and not store.delete("bob", "r1")
    for i in range(10):
        store.put("bob", _response(f"b{i}"), [])
    assert store.get("alice", "r1") is not None  # bob's flood evicted bob's own first
    assert store.num_entries == 3
    assert store.delete("alice", "r1") and store.get("alice", "r1") is None


def test_items_become_one_chat() -> None:
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
    ]
    messages, origins = chat_messages(items, [f"input[{i}]" for i in range(len(items))])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}
    assert origins == [("input[0]", True), ("input[1]", True), ("input[2]", False),
                       ("input[5]", False)]  # fmt: skip


def test_chat_errors_name_the_responses_field() -> None:
    store = ResponseStore()
    req = ResponsesRequest(input=[{"role": "user", "content": "a"}], instructions="x")
    turn = ResponseTurn.begin("resp-1", req, "m", store)
    for chat, ours in [
        ("messages[1].content", "input[0].content"),
        ("messages[0].content", "instructions"),
        ("messages", "input"),
        ("tools[2].function.name", "tools[2].name"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("max_tokens", "max_output_tokens"),
    ]:
        assert turn.renamed(RequestError("no", chat)).param == ours
    assert turn.finish({"choices": [{"message": {"content": "b"}}]})["status"] == "completed"
    assert store.get("host:?", "resp-1") is not None  # stored under the request's tenant
    later = ResponseTurn.begin(
        "resp-2", ResponsesRequest(input="c", previous_response_id="resp-1"), "m", store
    )
    assert later.num_history == 2
    assert later.renamed(RequestError("no", "messages[0].content")).param == "previous_response_id"
    with pytest.raises(RequestError) as e:
        ResponseTurn.begin("r", ResponsesRequest(input="c", previous_response_id="x"), "m", store)
    assert e.value.status == 404 and e.value.param == "previous_response_id"
