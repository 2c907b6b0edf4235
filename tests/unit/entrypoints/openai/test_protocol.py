"""OpenAI request/response models: validation errors name the field, unsupported fields are refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.responses import JSONResponse

from specdec.entrypoints.openai.protocol import (
    MAX_ERROR_CHARS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatStreamChoice,
    CompletionRequest,
    DeltaMessage,
    RequestError,
    UsageInfo,
    dump_chunk,
    one_line,
    validation_error,
)
from specdec.entrypoints.openai.serving import encode_json

CHAT = [{"role": "user", "content": "hi"}]


def _error(model, body: dict) -> RequestError:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(e.value)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": CHAT, "temperature": -1}, "temperature", "invalid_value"),
        ({"messages": CHAT, "temperature": "warm"}, "temperature", "invalid_type"),
        ({"messages": CHAT, "top_p": 0}, "top_p", "invalid_value"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"messages": []}, "messages", "invalid_value"),
        ({}, "messages", "missing_required_parameter"),
        (
            {"messages": [{"role": "user"}, {"content": "x"}]},
            "messages[1].role",
            "missing_required_parameter",
        ),
        ({"messages": CHAT, "stop": [1, 2]}, "stop", "invalid_type"),
        (
            {"messages": CHAT, "stream_options": {"include_usage": "x"}},
            "stream_options.include_usage",
            "invalid_type",
        ),
        ({"messages": CHAT, "top_k": -7}, "top_k", "invalid_value"),
        # every float in range, every integer in range (issue 16)
        ({"messages": CHAT, "repetition_penalty": 1e-300}, "repetition_penalty", "invalid_value"),
        ({"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"messages": CHAT, "repetition_penalty": 1e6}, "repetition_penalty", "invalid_value"),
        ({"messages": CHAT, "temperature": 1e300}, "temperature", "invalid_value"),
        ({"messages": CHAT, "temperature": float("inf")}, "temperature", "invalid_value"),
        ({"messages": CHAT, "top_p": float("nan")}, "top_p", "invalid_value"),
        ({"messages": CHAT, "min_p": 1.5}, "min_p", "invalid_value"),
        ({"messages": CHAT, "frequency_penalty": -2.5}, "frequency_penalty", "invalid_value"),
        ({"messages": CHAT, "seed": 2**70}, "seed", "invalid_value"),
        ({"messages": CHAT, "seed": -(2**63) - 1}, "seed", "invalid_value"),
        ({"messages": CHAT, "max_tokens": 2**40}, "max_tokens", "invalid_value"),
        ({"messages": CHAT, "min_tokens": -1}, "min_tokens", "invalid_value"),
        ({"messages": CHAT, "stop_token_ids": [-1]}, "stop_token_ids[0]", "invalid_value"),
        ({"messages": CHAT, "stop": "x" * 5000}, "stop", "invalid_value"),
        ({"messages": CHAT, "stop": ["a", "x" * 5000]}, "stop[1]", "invalid_value"),
        ({"messages": CHAT, "stop": ["s"] * 1000}, "stop", "invalid_value"),
        ({"messages": CHAT, "cache_salt": ""}, "cache_salt", "invalid_value"),
        ({"messages": CHAT, "cache_salt": "s" * 1000}, "cache_salt", "invalid_value"),
        ({"messages": CHAT, "cache_salt": 5}, "cache_salt", "invalid_type"),
        # strict integers and booleans: refused, not coerced
        ({"messages": CHAT, "n": True}, "n", "invalid_type"),
        ({"messages": CHAT, "n": "2"}, "n", "invalid_type"),
        ({"messages": CHAT, "stream": "yes"}, "stream", "invalid_type"),
        ({"messages": CHAT, "stream": 1}, "stream", "invalid_type"),
        ({"messages": CHAT, "max_tokens": "16"}, "max_tokens", "invalid_type"),
        ({"messages": CHAT, "max_tokens": 16.0}, "max_tokens", "invalid_type"),
        ({"messages": CHAT, "logprobs": "true"}, "logprobs", "invalid_type"),
        ({"messages": CHAT, "seed": False}, "seed", "invalid_type"),
    ],
)
def test_validation_error_names_the_field(body: dict, param: str, code: str) -> None:
    err = _error(ChatCompletionRequest, body)
    assert (err.param, err.code, err.status) == (param, code, 400)
    assert err.message.startswith(param)
    assert err.body()["error"]["param"] == param


def test_union_errors_list_the_accepted_shapes() -> None:
    err = _error(CompletionRequest, {"prompt": 3.5})
    assert err.param == "prompt" and "str" in err.message and "list[int]" in err.message
    assert "constrained" not in err.message
    # the branch of the right type failed a bound: that bound is the message
    err = _error(CompletionRequest, {"prompt": [1, 2, -5]})
    assert err.param == "prompt[2]" and "greater than or equal to 0" in err.message


def test_sampling_params_errors_name_the_field() -> None:
    """SamplingParams' own checks (the one source of the bounds) come back as a 400 on the field."""
    req = ChatCompletionRequest.model_validate({"messages": CHAT, "min_tokens": 50})
    req.min_tokens = 10**30  # past pydantic: SamplingParams still refuses it, naming the field
    with pytest.raises(RequestError) as e:
        req.to_sampling_params(8)
    assert (e.value.param, e.value.status) == ("min_tokens", 400)
    assert ChatCompletionRequest.field_named_by("stop: at most 256 strings") == "stop"
    assert ChatCompletionRequest.field_named_by("prompt has 300 tokens") is None


def test_cache_salt_is_a_field() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "cache_salt": "tenant-a"})
    assert req.cache_salt == "tenant-a" and req.ignored_fields == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": True}, "echo"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"use_beam_search": True}, "use_beam_search"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "a", "guided_json": {}}, "guided_regex"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_fields_are_refused(body: dict, param: str) -> None:
    req = ChatCompletionRequest.model_validate({"messages": CHAT, **body})
    with pytest.raises(RequestError) as e:
        req.check_supported()
        req.to_sampling_params(8)
    assert e.value.param == param and e.value.status == 400


def test_harmless_unknown_fields_are_ignored_and_listed() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": CHAT,
            "frobnicate": 1,
            "use_beam_search": False,
            "response_format": {"type": "text"},
        }
    )
    req.check_supported()
    assert req.ignored_fields == ["frobnicate", "use_beam_search"]


def test_sampling_params_mapping() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": CHAT, "seed": 5, "stop": "END", "top_k": 0, "logprobs": True, "ignore_eos": True,
         "max_completion_tokens": 9, "max_tokens": 100, "stop_token_ids": [7], "repetition_penalty": 1.2}
    )  # fmt: skip
    assert req.requested_max_tokens == 9
    sp = req.to_sampling_params(9)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop) == (1.0, 1.0, -1, 5, ["END"])
    assert (sp.max_tokens, sp.logprobs, sp.ignore_eos, sp.stop_token_ids) == (9, 0, True, [7])
    assert sp.repetition_penalty == 1.2 and sp.has_penalties
    plain = CompletionRequest.model_validate({"prompt": "x", "temperature": 0})
    sp = plain.to_sampling_params(16)
    assert sp.is_greedy and sp.logprobs is None and sp.max_tokens == 16
    assert plain.max_tokens == 16  # vLLM's (and OpenAI's) completions default


def test_prompt_shapes() -> None:
    assert CompletionRequest.model_validate({"prompt": ["one"]}).prompts() == ["one"]
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [3, 4]}).prompts() == [[3, 4]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    for prompt in ("", [], ["a", ""], [[1], []], ["a"] * 129):
        with pytest.raises(RequestError) as e:
            CompletionRequest.model_validate({"prompt": prompt}).prompts()
        assert e.value.param == "prompt"


def test_chat_content_parts() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                      {"role": "assistant", "content": None, "reasoning_content": "hmm"}]}
    )  # fmt: skip
    msgs = req.template_messages()
    assert msgs[0] == {"role": "user", "content": "ab"}
    assert msgs[1]["reasoning_content"] == "hmm" and msgs[1]["content"] is None
    bad = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        }
    )
    with pytest.raises(RequestError) as e:
        bad.template_messages()
    assert e.value.param == "messages[0].content[0].type"


def test_dump_chunk() -> None:
    chunk = ChatCompletionChunk(
        id="c1", created=1, model="m", choices=[ChatStreamChoice(delta=DeltaMessage(content="hé"))]
    )
    event = dump_chunk(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    d = json.loads(event[6:])
    assert "usage" not in d and "spec_decode" not in d
    assert d["choices"][0] == {
        "index": 0, "delta": {"role": None, "content": "hé"}, "logprobs": None,
        "finish_reason": None, "stop_reason": None,
    }  # fmt: skip
    chunk.usage = UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    chunk.spec_decode = {"num_drafts": 0}
    d = json.loads(dump_chunk(chunk)[6:])
    assert d["usage"]["total_tokens"] == 3 and d["spec_decode"] == {"num_drafts": 0}


def test_sse_event_is_one_line_whatever_the_text() -> None:
    text = "a\u2028b\x85c\u2029d\ne\rf\x1cg"
    chunk = ChatCompletionChunk(
        id="c", created=1, model="m", choices=[ChatStreamChoice(delta=DeltaMessage(content=text))]
    )
    event = dump_chunk(chunk)
    assert len(event[:-2].splitlines()) == 1 and event.isascii()
    assert json.loads(event[6:])["choices"][0]["delta"]["content"] == text


# ---- errors are one line; bodies encoded in pieces -----------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("short", "short"),
        ("first\nsecond", "first..."),
        ("a\r\nb", "a..."),
        ("a\u2028b", "a..."),
        ("a\x1cb", "a..."),
        ("x" * 50, "x" * 10 + "..."),
        ("", ""),
    ],
)
def test_one_line(text: str, want: str) -> None:
    assert one_line(text, 10) == want
    assert len(one_line(text, 10).splitlines()) <= 1


def test_request_error_messages_are_one_bounded_line() -> None:
    err = RequestError("bad value\n<parser state>\n" + "x" * 5000, "grammar")
    assert err.message == "bad value..." and err.body()["error"]["message"] == "bad value..."
    assert len(RequestError("y" * 5000).message) == MAX_ERROR_CHARS + 3


_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, min_size=60, max_size=140),  # around _ITEMS_PER_DUMP and past it
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), inner, max_size=5),
    ),
    max_leaves=300,
)


@settings(max_examples=60, deadline=None)
@given(value=_json_values)
def test_encode_json_writes_what_starlette_writes(value) -> None:
    """Long lists in pieces, containers near the top key by key: the same bytes as one call."""
    assert encode_json(value) == JSONResponse(value).body


def test_encode_json_refuses_what_starlette_refuses() -> None:
    for bad in ({"a": [0.0] * 100 + [float("nan")]}, [float("inf")]):
        with pytest.raises(ValueError):
            JSONResponse(bad)
        with pytest.raises(ValueError):
            encode_json(bad)
