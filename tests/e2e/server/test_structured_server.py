"""Structured output through the OpenAI server: response_format (json_object, json_schema),
vLLM's structured_outputs and guided_* fields, their 400s naming the field, and the same output
with speculation as without."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.fixtures.prompts import INSTRUCTOR_RETRY, SCHEMA
from tests.fixtures.server import _client, _start

CHAT = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def servers(tiny_llama):
    plain = _start(str(tiny_llama))
    spec = _start(str(tiny_llama), spec={"method": "suffix", "num_speculative_tokens": 8})
    yield plain, spec
    plain.stop()
    spec.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/{path}", json=body, timeout=60)


@pytest.mark.parametrize(
    ("path", "extra", "check"),
    [
        ("chat/completions", {"response_format": {"type": "json_schema",
         "json_schema": {"name": "pet", "schema": SCHEMA}}}, "json"),
        ("chat/completions", {"response_format": {"type": "json_object"}}, "object"),
        ("completions", {"guided_regex": r"[a-c]{3}-[0-9]{2}"}, r"[a-c]{3}-[0-9]{2}"),
        ("completions", {"guided_choice": ["red", "green", "blue"]}, "choice"),
        ("completions", {"structured_outputs": {"choice": ["up", "down"]}}, "choice2"),
        ("completions", {"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, r"x[0-9]{2}"),
        ("completions", {"guided_json": json.dumps(SCHEMA)}, "json"),
        ("completions", {"json_schema": SCHEMA}, "json"),  # llama.cpp server's fields
        ("chat/completions", {"grammar": 'root ::= "x" [0-9] [0-9]'}, r"x[0-9]{2}"),
    ],
)  # fmt: skip
def test_constraints_hold_and_speculation_changes_nothing(servers, path, extra, check) -> None:
    plain, spec = servers
    body = {"model": "tiny", "max_tokens": 60, "temperature": 0, **extra}
    if path == "completions":
        body["prompt"] = "hello there"
    else:
        body["messages"] = CHAT
    texts = []
    for srv in (plain, spec):
        r = _post(srv, path, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if path == "completions" else choice["message"]["content"]
        texts.append((text, choice["finish_reason"]))
    assert texts[0] == texts[1]
    text, finish = texts[0]
    if check == "json":
        assert text.startswith("{")
        if finish == "stop":
            assert json.loads(text)["kind"] in ("cat", "dog", "bird")
    elif check == "object":
        assert text.lstrip().startswith("{")
    elif check == "choice":
        assert finish == "stop" and text in ("red", "green", "blue")
    elif check == "choice2":
        assert finish == "stop" and text in ("up", "down")
    else:
        assert finish == "stop" and re.fullmatch(check, text), text


def test_openai_client_json_schema_streams(servers) -> None:
    plain, _ = servers
    client = _client(plain)
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    full = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=40, temperature=0, response_format=fmt
    )
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=40, temperature=0, response_format=fmt,
        stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content and text.startswith("{")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
         "response_format.json_schema.schema", ""),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"guided_regex": "(oops"}, "guided_regex", ""),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_grammar": "start: missing_rule\n"}, "guided_grammar", ""),
        ({"structured_outputs": {"regex": "(x"}}, "structured_outputs.regex", ""),
        ({"structured_outputs": {"regexp": "x"}}, "structured_outputs", "unknown field"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
    ],
)  # fmt: skip
def test_bad_constraints_get_400_naming_the_field(servers, extra, param, words) -> None:
    plain, _ = servers
    r = _post(plain, "chat/completions", {"model": "tiny", "messages": CHAT, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"]
    # the server goes on
    ok = _post(plain, "completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_samples_of_one_request_each_follow_the_grammar(servers) -> None:
    """n=3: the server compiles the constraint once (off the engine's thread) and each sample
    follows its own copy."""
    plain, _ = servers
    body = {"model": "tiny", "prompt": "hi", "n": 3, "temperature": 1.0, "seed": 5,
            "max_tokens": 12, "guided_regex": "[a-z]{2,4}(-[0-9])?"}  # fmt: skip
    r = _post(plain, "completions", body)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 3 and all(re.fullmatch("[a-z]{2,4}(-[0-9])?", t) for t in texts)
    assert len(set(texts)) > 1


def test_grammar_drafts_are_counted_in_metrics(servers) -> None:
    _, spec = servers
    body = {"model": "tiny", "prompt": "pick", "max_tokens": 40, "temperature": 0,
            "guided_choice": ["a long answer here", "another long answer"]}  # fmt: skip
    r = _post(spec, "completions", body)
    assert r.status_code == 200
    stats = r.json()["spec_decode"]
    assert stats["num_grammar_draft_tokens"] > 0 and stats["num_grammar_accepted_tokens"] > 0
    text = httpx.get(f"{spec.url}/metrics").text
    m = re.search(
        r"^specdec:spec_decode_num_grammar_draft_tokens_total\{[^}]*\} (\S+)$", text, re.M
    )
    assert m and float(m.group(1)) >= stats["num_grammar_draft_tokens"]


def test_json_mode_retry_is_the_same_on_plain_ngram_and_suffix_servers() -> None:
    """instructor's JSON-mode retry through the openai client on the real model: 200 and the
    same JSON from a plain, an n-gram (k = 8, the length that used to fail with a 500) and a
    suffix server."""
    answers = []
    for spec in (
        None,
        {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False},
        {"method": "suffix", "num_speculative_tokens": 8},
    ):
        srv = _start("smollm2-135m", spec=spec, max_model_len=512, max_num_batched_tokens=256)
        try:
            r = _client(srv).chat.completions.create(
                model="tiny", messages=INSTRUCTOR_RETRY, temperature=0, max_tokens=96,
                response_format={"type": "json_object"},
            )  # fmt: skip
        finally:
            srv.stop()
        answers.append((r.choices[0].message.content, r.choices[0].finish_reason))
    assert answers[0][1] == "stop" and isinstance(json.loads(answers[0][0]), dict)
    assert answers[1] == answers[0] and answers[2] == answers[0]
