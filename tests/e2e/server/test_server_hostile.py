"""Client mistakes and hostile values against a live in-process server (issue 30, items 4-5):
each is a 4xx with a one-line message naming the field (never a 5xx), /health answers while
each runs, a request that fails while generating says so in one short line, and large replies
are built off the event loop, byte for byte as before."""

from __future__ import annotations

import json
import logging
import shutil
import threading

import httpx
import pytest
from starlette.responses import JSONResponse

from specdec.entrypoints.openai.protocol import ChatCompletionResponse, CompletionResponse
from tests.fixtures.server import _engine, _HealthProbe, _start, _wait_idle

CHAT = [{"role": "user", "content": "Say something about the cat."}]
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = _start(str(tiny_llama))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gappy_server(tiny_llama, tmp_path_factory):
    """The tiny model with no token for the byte 0x14, as SmolLM2's vocabulary has none (nor
    for 0x04, 0x06, 0x13, 0x16, 0x1d): its tokenizer drops that character without a trace."""
    folder = tmp_path_factory.mktemp("tiny_gappy")
    for f in tiny_llama.iterdir():
        shutil.copy(f, folder / f.name)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["<|no-0x14|>"] = vocab.pop("\u0114")  # bytes_to_unicode()[0x14]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    srv = _start(str(folder))
    yield srv
    srv.stop()


# ---- the corpus: every one a 4xx naming its field ------------------------------------------------

_CORPUS = [
    # logit_bias keys: ASCII token ids of at most 10 digits; values finite in [-100, 100]
    ("bias-superscript", CHAT_PATH, {"messages": CHAT, "logit_bias": {"²": 1}}, "logit_bias"),
    ("bias-arabic-indic", CHAT_PATH, {"messages": CHAT, "logit_bias": {"٣": 1}}, "logit_bias"),
    ("bias-5000-digits", CHAT_PATH, {"messages": CHAT, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("bias-11-digits", CHAT_PATH, {"messages": CHAT, "logit_bias": {"12345678901": 1}}, "logit_bias"),
    ("bias-newline-key", CHAT_PATH, {"messages": CHAT, "logit_bias": {"1\nx": 1}}, "logit_bias"),
    ("bias-negative", CHAT_PATH, {"messages": CHAT, "logit_bias": {"-1": 1}}, "logit_bias"),
    ("bias-101", CHAT_PATH, {"messages": CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ("bias-string-value", CHAT_PATH, {"messages": CHAT, "logit_bias": {"5": "1"}}, "logit_bias"),
    ("bias-list-value", CHAT_PATH, {"messages": CHAT, "logit_bias": {"5": [1]}}, "logit_bias"),
    ("bias-not-in-vocab", COMPLETIONS_PATH, {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("bias-list", COMPLETIONS_PATH, {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
    # wrong types
    ("stop-int", CHAT_PATH, {"messages": CHAT, "stop": 5}, "stop"),
    ("stop-ints", COMPLETIONS_PATH, {"prompt": "x", "stop": [1, 2]}, "stop"),
    ("stop-ids-string", COMPLETIONS_PATH, {"prompt": "x", "stop_token_ids": "12"}, "stop_token_ids"),
    ("bad-words-string", COMPLETIONS_PATH, {"prompt": "x", "bad_words": "word"}, "bad_words"),
    ("seed-string", COMPLETIONS_PATH, {"prompt": "x", "seed": "abc"}, "seed"),
    ("n-float", COMPLETIONS_PATH, {"prompt": "x", "n": 1.5}, "n"),
    ("ignore-eos-list", COMPLETIONS_PATH, {"prompt": "x", "ignore_eos": [True]}, "ignore_eos"),
    ("temperature-dict", CHAT_PATH, {"messages": CHAT, "temperature": {}}, "temperature"),
    ("structured-keys", CHAT_PATH, {"messages": CHAT, "structured_outputs": {"x": 1}}, "structured_outputs"),
    ("structured-list", CHAT_PATH, {"messages": CHAT, "structured_outputs": [1]}, "structured_outputs"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in _CORPUS], ids=[c[0] for c in _CORPUS]
)
def test_hostile_values_are_one_line_400s_naming_the_field(server, path, body, param) -> None:
    with _HealthProbe(server) as probe:
        r = httpx.post(f"{server.url}{path}", json={"max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "\n" not in err["message"] and len(err["message"]) < 300, err
    assert "9999999999999" not in err["message"] and "٣" not in err["message"]
    assert set(probe.codes) == {200}


# ---- text the tokenizer cannot represent ----------------------------------------------------------


def test_a_character_without_a_token_is_a_400_naming_the_field(server, gappy_server) -> None:
    """The tokenizer would drop U+0014 ("hi\\x14there" read as "hithere"): the request is refused,
    naming the field; a tokenizer with a token for it takes the text as it is."""
    cases = [
        (COMPLETIONS_PATH, {"prompt": "hi\x14there"}, "prompt"),
        (COMPLETIONS_PATH, {"prompt": ["fine", "hi\x14there"]}, "prompt"),
        (CHAT_PATH, {"messages": [CHAT[0], {"role": "user", "content": "a\x14b"}]}, "messages[1].content"),
    ]  # fmt: skip
    for path, body, param in cases:
        r = httpx.post(f"{gappy_server.url}{path}", json={"max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "U+0014" in err["message"], err
        r = httpx.post(f"{server.url}{path}", json={"max_tokens": 2, **body})
        assert r.status_code == 200, r.text
    # the characters it has tokens for go through, controls included, and come back whole
    text = "hi\x13\x15\x00 there \U0001f600"
    ok = httpx.post(f"{gappy_server.url}{COMPLETIONS_PATH}", json={"prompt": text, "max_tokens": 2})
    tokenizer = _engine(gappy_server).tokenizer
    ids = tokenizer.encode(text, True)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len(ids), ok.text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


# ---- a request that fails while generating --------------------------------------------------------


def test_a_failure_while_generating_is_one_short_line(server, monkeypatch, caplog) -> None:
    """The engine's reason reaches the client cut to one line of bounded length, with the
    request id; the log holds one line per failure, no traceback."""
    sched = _engine(server).scheduler
    secret = "client text: " + "x" * 3000 + "\nTraceback (most recent call last):\n  dump"

    def broken(req, result):
        raise RuntimeError(secret)

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(sched, "_commit", broken)
    try:
        plain = httpx.post(
            f"{server.url}{COMPLETIONS_PATH}", json={"prompt": "hi", "max_tokens": 4}
        )
        body = {"prompt": "hi", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{server.url}{COMPLETIONS_PATH}", json=body) as r:
            events = [line for line in r.iter_lines() if line]
    finally:
        monkeypatch.undo()
    _wait_idle(server)
    assert plain.status_code == 500
    streamed = json.loads(events[-2][6:])
    assert events[-1] == "data: [DONE]"
    for err in (plain.json()["error"], streamed["error"]):
        message = err["message"]
        assert err["type"] == "internal_server_error" and "cmpl-" in message, err
        assert "\n" not in message and len(message) < 300 and "Traceback" not in message, err
    for record in caplog.records:
        text = record.getMessage()
        assert "\n" not in text and record.exc_info is None and len(text) < 1200, text


# ---- large replies off the event loop -------------------------------------------------------------

_REPLIES = [
    (CHAT_PATH, {"messages": CHAT, "max_tokens": 24, "temperature": 0, "logprobs": True,
                 "top_logprobs": 20, "prompt_logprobs": 3}),
    (CHAT_PATH, {"messages": CHAT, "max_tokens": 8, "seed": 1, "n": 2, "logprobs": True}),
    (COMPLETIONS_PATH, {"prompt": "héllo 日本 \u2028 x", "max_tokens": 24, "temperature": 0,
                        "logprobs": 5, "echo": True, "prompt_logprobs": 2}),
    (COMPLETIONS_PATH, {"prompt": ["a b", "c d"], "max_tokens": 6, "seed": 3, "n": 2,
                        "best_of": 3, "logprobs": 2}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), _REPLIES, ids=range(len(_REPLIES)))
def test_replies_are_what_the_response_models_and_starlette_write(server, path, body) -> None:
    """A reply built off the loop (dicts spliced in, encoded in pieces) has the bytes Starlette
    writes for it, and the content model_dump() of its response model writes, key order too."""
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    content = r.json()
    assert r.content == JSONResponse(content).body
    model = ChatCompletionResponse if path == CHAT_PATH else CompletionResponse
    dumped = model.model_validate(content).model_dump()
    # vLLM's per-request ``metrics`` appear only when the server was started to send them
    assert "metrics" not in content and dumped.pop("metrics") is None
    assert json.dumps(dumped) == json.dumps(content)


def test_health_answers_while_a_reply_is_built(server, monkeypatch) -> None:
    """The reply's builder is held until /health has answered: were it on the event loop,
    /health would wait for it (and time out)."""
    serving = server.server.config.app.state.serving
    entered, released, built = threading.Event(), threading.Event(), threading.Event()
    real = serving._chat_body

    def held(*args):
        entered.set()
        released.wait(20)
        out = real(*args)
        built.set()
        return out

    monkeypatch.setattr(serving, "_chat_body", held)
    result: list[httpx.Response] = []
    body = {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 5}
    client = threading.Thread(
        target=lambda: result.append(httpx.post(f"{server.url}{CHAT_PATH}", json=body, timeout=30))
    )
    client.start()
    try:
        assert entered.wait(20)
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200 and not built.is_set()
    finally:
        released.set()
        client.join(30)
    assert result[0].status_code == 200 and built.is_set()
