"""Tool calling through the OpenAI server: tool_choice named / required / auto / none on a tiny
model whose template lists tools (Hermes style), the calls' arguments held to each tool's schema
by the grammar, the OpenAI client reading them, and the 400s."""

from __future__ import annotations

import json

import httpx
import pytest

from specdec.entrypoints.openai.tools import ToolPlan, plan_tools
from tests.fixtures.models import with_chat_template
from tests.fixtures.prompts import TEMPLATE
from tests.fixtures.server import _client, _start

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_weather(args: dict) -> None:
    assert set(args) == {"city", "unit", "days"}
    assert args["city"] in ("Paris", "Oslo", "Lima") and args["unit"] in ("c", "f")
    assert 1 <= args["days"] <= 9


@pytest.fixture(scope="module")
def tool_model(tiny_llama, tmp_path_factory):
    return with_chat_template(tiny_llama, tmp_path_factory.mktemp("tiny_tools"), TEMPLATE)


@pytest.fixture(scope="module")
def servers(tool_model, tiny_llama):
    tools = _start(str(tool_model))
    spec = _start(str(tool_model), spec={"method": "ngram", "num_speculative_tokens": 4})
    plain_template = _start(str(tiny_llama))
    yield tools, spec, plain_template
    for srv in (tools, spec, plain_template):
        srv.stop()


def _post(srv, body: dict) -> httpx.Response:
    body = {"model": "tiny", "messages": CHAT, "temperature": 0, "max_tokens": 80, **body}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)


def test_named_tool_choice_returns_a_call_of_its_schema(servers) -> None:
    tools, spec, _ = servers
    body = {
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    replies = [_post(srv, body).json() for srv in (tools, spec)]
    # the same calls with speculation as without (call ids are random)
    functions = [[t["function"] for t in r["choices"][0]["message"]["tool_calls"]] for r in replies]
    assert functions[0] and functions[0] == functions[1]
    choice = replies[0]["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    _check_weather(json.loads(call["function"]["arguments"]))
    assert choice["message"]["content"] is None


def test_required_with_the_openai_client(servers) -> None:
    tools, _, _ = servers
    client = _client(tools)
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=100,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        args = json.loads(c.function.arguments)
        if c.function.name == "get_weather":
            _check_weather(args)
        else:
            assert args["zone"] in ("UTC", "CET")
    # streamed: the same calls, in one delta at the end
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=100, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert deltas[-1].finish_reason == "tool_calls"
    # the conversation goes on with the call and its result in the history
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
    ]
    again = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], temperature=0, max_tokens=8
    )
    assert again.choices[0].message.content is not None


def test_auto_leaves_text_free(servers) -> None:
    tools, _, _ = servers
    r = _post(tools, {"tools": [WEATHER]})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["message"]["content"]
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] in ("stop", "length")


def test_auto_grammar_holds_calls_to_the_schema(servers) -> None:
    """After the model writes <tool_call>, only a call of a listed tool may follow."""
    tools, _, _ = servers
    engine = tools.server.config.app.state.llm.engine
    plan = ToolPlan([WEATHER, TIME], "auto")
    grammar = engine.grammar_compiler.compile(plan.constraint())
    tok = engine.tokenizer
    for t in tok.encode("Let me check. <tool_call>", add_special_tokens=False):
        assert grammar.accept(t)
    ok = tok.encode('\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', False)
    assert grammar.valid_prefix(ok) == len(ok)
    bad = tok.encode('\n{"name": "get_stock", "arguments": {}}', False)
    assert grammar.valid_prefix(bad) < len(bad)
    wrong_args = tok.encode('\n{"name": "get_time", "arguments": {"zone": "PST"}}', False)
    assert grammar.valid_prefix(wrong_args) < len(wrong_args)
    content, calls = plan.parse('Sure. <tool_call>\n{"name": "get_time", "arguments": '
                                '{"zone": "UTC"}}\n</tool_call>')  # fmt: skip
    assert content == "Sure." and calls[0].name == "get_time"
    assert json.loads(calls[0].arguments) == {"zone": "UTC"}


@pytest.mark.parametrize(
    ("body", "param", "which"),
    [
        ({"tools": [WEATHER]}, "tools", 2),  # the template never reads tools
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name", 0),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", 0),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", 0),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", 0),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", 0),
        ({"tool_choice": "required"}, "tool_choice", 0),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "response_format", 0),
    ],
)  # fmt: skip
def test_bad_tool_requests_get_400(servers, body, param, which) -> None:
    r = _post(servers[which], body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tool_choice_none_is_plain_chat(servers) -> None:
    """Tools with tool_choice none: not shown, not constrained; any template works."""
    _, _, plain_template = servers
    with_tools = _post(plain_template, {"tools": [WEATHER], "tool_choice": "none"}).json()
    without = _post(plain_template, {}).json()
    assert with_tools["choices"][0]["message"] == without["choices"][0]["message"]


def test_auto_needs_a_template_that_writes_tool_call_tags() -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"
    assert plan_tools([WEATHER], "required", template).mode == "required"
    with pytest.raises(ValueError, match="<tool_call>"):
        plan_tools([WEATHER], "auto", template)


def test_chat_template_flag(tiny_llama, tmp_path, capsys) -> None:
    """--chat-template (vLLM's): a file or the template itself; a broken one is one line on the
    CLI, before the model loads."""
    from specdec import cli
    from specdec.entrypoints.utils import read_chat_template

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert read_chat_template(str(f)) == TEMPLATE == read_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    argv = ["generate", "--model", str(tiny_llama), "--chat", "-p", "hi", "-n", "2", "--quiet"]
    assert cli.main([*argv, "--chat-template", "{% for m in messages %}{{ m.content }}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: --chat-template: line 1:") and err.count("\n") == 1
    assert cli.main(["serve", str(tiny_llama), "--chat-template", "{{ oops"]) == 2
    assert cli.main([*argv, "--chat-template", str(f)]) == 0


def test_required_cut_by_max_tokens_keeps_the_complete_calls() -> None:
    plan = ToolPlan([WEATHER, TIME], "required")
    done = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    content, calls = plan.parse(f'[{done}, {done}, {{"name": "get_ti')
    assert [c.name for c in calls] == ["get_time", "get_time"] and content is None
    content, calls = plan.parse(f"[ {done} ,\n{done} ]")
    assert len(calls) == 2 and content is None
    content, calls = plan.parse('[{"name": "get_')
    assert calls == [] and content == '[{"name": "get_'


def test_default_model_tools_with_the_shipped_template() -> None:
    """The stock smollm2-135m server: a tools request is a 400 that names --chat-template
    chatml-tools; served with it, required and auto calls come back through the openai client."""
    from specdec.entrypoints.utils import read_chat_template

    stock = _start("smollm2-135m", max_model_len=1024, max_num_batched_tokens=256)
    try:
        r = _post(stock, {"tools": [WEATHER]})
    finally:
        stock.stop()
    assert r.status_code == 400 and "--chat-template chatml-tools" in r.json()["error"]["message"]
    llm_template = read_chat_template("chatml-tools")
    srv = _start("smollm2-135m", max_model_len=1024, max_num_batched_tokens=256)
    srv.server.config.app.state.llm.engine.tokenizer.chat_template = llm_template
    try:
        client = _client(srv)
        ask = [{"role": "user", "content": "What is the weather in Paris for the next 2 days?"}]
        r = client.chat.completions.create(
            model="tiny", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
            temperature=0, max_tokens=200,
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name in ("get_weather", "get_time")
        json.loads(calls[0].function.arguments)
        r = client.chat.completions.create(
            model="tiny", messages=ask, tools=[WEATHER], temperature=0, max_tokens=120
        )
        assert r.choices[0].finish_reason in ("tool_calls", "stop", "length")
    finally:
        srv.stop()


def test_required_tools_with_pydantic_defs_compile_and_hold(servers) -> None:
    """Tools whose parameters refer to their own $defs (what pydantic writes) nest inside the
    required-calls schema: each tool's definitions are hoisted under its own names."""
    import re as _re

    from specdec.entrypoints.openai.tools import _hoisted_defs

    person = {
        "type": "object",
        "properties": {"who": {"$ref": "#/$defs/Person"}},
        "required": ["who"],
        "$defs": {
            "Person": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}},
                "required": ["name"],
            }
        },
    }
    body, defs = _hoisted_defs(person, "tool0_")
    assert body["properties"]["who"]["$ref"] == "#/$defs/tool0_Person" and "$defs" not in body
    assert set(defs) == {"tool0_Person", "tool0_root"}
    tool = {"type": "function", "function": {"name": "greet", "parameters": person}}
    r = _post(servers[0], {"tools": [tool, TIME], "tool_choice": "required", "max_tokens": 60})
    assert r.status_code == 200, r.text
    for call in r.json()["choices"][0]["message"]["tool_calls"]:
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "greet":
            assert _re.fullmatch(r".{0,8}", args["who"]["name"], _re.S)
