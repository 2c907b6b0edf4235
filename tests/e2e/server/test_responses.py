"""POST /v1/responses (OpenAI's Responses API) through the official client: the same text as the
chat endpoint for the same greedy request, streamed and not, usage, and 400s naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec.entrypoints.openai.response_store import ResponseStore
from tests.fixtures.server import _start


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = _start(str(tiny_llama))
    yield srv
    srv.stop()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_a_response_says_what_the_chat_says(server) -> None:
    client = _client(server)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        max_tokens=12, temperature=0,
    )  # fmt: skip
    resp = client.responses.create(
        model="tiny", instructions="Be brief.", input="hi", max_output_tokens=12, temperature=0
    )
    assert resp.object == "response" and resp.output_text == chat.choices[0].message.content
    assert resp.output[0].role == "assistant" and resp.output[0].content[0].type == "output_text"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    finish = chat.choices[0].finish_reason
    assert resp.status == ("incomplete" if finish == "length" else "completed")
    # message items, text parts included, give the same conversation
    items = client.responses.create(
        model="tiny", max_output_tokens=12, temperature=0,
        input=[{"role": "system", "content": "Be brief."},
               {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    )  # fmt: skip
    assert items.output_text == resp.output_text


def test_a_streamed_response_adds_up_to_the_whole(server) -> None:
    client = _client(server)
    whole = client.responses.create(
        model="tiny", input="tell me", max_output_tokens=10, temperature=0
    )
    kinds, deltas, final = [], [], None
    with client.responses.create(
        model="tiny", input="tell me", max_output_tokens=10, temperature=0, stream=True
    ) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "stream": "yes"}, "stream"),
        ({"input": "hi", "store": "no"}, "store"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
            "input[0].call_id",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({}, "input"),
        ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_refusals_name_the_field(server, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.text[:300]


def test_an_unknown_previous_response_is_a_404_naming_it(server) -> None:
    r = httpx.post(
        f"{server.url}/v1/responses",
        json={"model": "tiny", "input": "hi", "previous_response_id": "resp-nope"},
        timeout=30,
    )
    assert r.status_code == 404, r.text[:300]
    assert r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["code"] == "not_found"


def test_the_store_evicts_the_least_recently_used(tiny_llama) -> None:
    """Two responses kept: a third evicts the least recently used (reading one counts as use);
    store false keeps nothing; a response alone over the byte cap is not kept."""
    srv = _start(str(tiny_llama), app={"responses_store": ResponseStore(max_entries=2)})
    try:
        client = _client(srv)

        def create(**kw):
            return client.responses.create(
                model="tiny", input="hi", max_output_tokens=4, temperature=0, **kw
            )

        a, b = create(), create()
        client.responses.retrieve(a.id)  # b is now the least recently used
        c = create()
        assert client.responses.retrieve(a.id).id == a.id
        assert client.responses.retrieve(c.id).id == c.id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(b.id)
        with pytest.raises(openai.NotFoundError) as e:
            create(previous_response_id=b.id)
        assert e.value.body["param"] == "previous_response_id"
        unkept = create(store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unkept.id)
        # a turn may read a stored response without storing itself
        assert create(previous_response_id=a.id, store=False).previous_response_id == a.id
        store = srv.server.config.app.state.responses_store
        assert store.num_entries == 2 and store.num_bytes > 0
    finally:
        srv.stop()
