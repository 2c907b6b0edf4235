"""Property-based fuzzing of the HTTP protocol (hypothesis) against an in-process server on the
tiny model, with a good greedy client running beside it the whole time.

For every generated request: never a 500, never a hang (each request has a 10 s limit), an error
is an OpenAI-style body, a stream always ends with [DONE], and /health answers. The good client's
greedy text never changes. Bounded in examples and derandomized, so it takes the same ~20 s on
every run; SPECDEC_FUZZ_EXAMPLES scales it.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.server import _start, _wait_idle

NUM_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "150"))
REQUEST_TIMEOUT_S = 10.0
FUZZ_SETTINGS = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,  # NOTE: the per-request timeout is the hang check; a loaded CI is slow
    derandomize=True,  # the same examples on every run: a failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
GOOD = {"prompt": "the cat sat on the mat", "max_tokens": 16, "temperature": 0, "ignore_eos": True}

# ---- strategies --------------------------------------------------------------------------------

_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(st.characters() | _surrogates, max_size=40) | st.sampled_from(
    ["", "tiny", "user", "assistant", "system", "text", "\n", "<|im_end|>", "a" * 5000]
)
numbers = st.one_of(
    st.integers(-5, 300),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.5, 1e-300, 1e300, 2**31, 2**63, 2**64, 2**70, -(2**63) - 1]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]) | texts},
        optional={
            "content": texts
            | json_values
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3),
            "name": texts,
        },
    ),
    max_size=3,
)
FIELDS = {
    "model": st.sampled_from(["tiny", None]) | texts,
    "messages": messages | json_values,
    "prompt": texts | st.lists(st.integers(-3, 300), max_size=8) | json_values,
    "max_tokens": st.integers(-2, 24) | numbers,
    "max_completion_tokens": st.integers(-2, 24) | numbers,
    "min_tokens": st.integers(0, 8) | numbers,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "min_p": numbers,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "seed": numbers,
    "stop": texts | st.lists(texts, max_size=3) | json_values,
    "stop_token_ids": st.lists(numbers, max_size=3) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    )
    | json_values,  # fmt: skip
    "logprobs": st.booleans() | numbers,
    "top_logprobs": numbers,
    "n": numbers,
    "ignore_eos": st.booleans() | json_values,
    "echo": st.booleans(),
    "best_of": numbers,
    "logit_bias": json_values,
    "user": texts,
    "cache_salt": texts | json_values,
    "chat_template": texts,
    "chat_template_kwargs": json_values,
    "add_generation_prompt": st.booleans() | json_values,
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "response_format": json_values,
    "tools": json_values,
    "tool_choice": json_values,
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(path, body, content type): mostly a valid request with a few hostile fields, sometimes
    arbitrary JSON or bytes."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    content_type = draw(
        st.sampled_from(
            ["application/json"] * 8 + ["text/plain", "application/json; charset=utf-8"]
        )
    )
    kind = draw(st.sampled_from(["mutated"] * 6 + ["json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=200)), content_type
    if kind == "json":
        body: object = draw(json_values)
    else:
        body = {"max_tokens": 8, "temperature": 0}
        if path == "/v1/completions":
            body["prompt"] = "hello there"
        else:
            body["messages"] = [{"role": "user", "content": "hello there"}]
        for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
            body[name] = draw(FIELDS[name])
        if draw(st.booleans()):
            body[draw(texts)] = draw(json_values)  # an unknown field, maybe with a hostile name
    raw = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity / lone surrogates included
    return path, raw, content_type


# ---- the test --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = _start(str(tiny_llama), app={"allowed_hosts": ["127.0.0.1"]})
    yield srv
    srv.stop()


class _GoodClient:
    """Sends the same greedy request again and again; every answer must be the first one's."""

    def __init__(self, url: str, want: str) -> None:
        self.url, self.want = url, want
        self.texts: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S * 3) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(f"{self.url}/v1/completions", json=GOOD)
                    self.texts.append(r.json()["choices"][0]["text"])
                except Exception as e:  # noqa: BLE001 - reported by the test
                    self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)

    def __enter__(self) -> _GoodClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _check_response(r: httpx.Response, lines: list[str]) -> None:
    assert r.status_code < 500, (r.status_code, lines[:3])
    if r.status_code != 200:
        err = json.loads("".join(lines))["error"]
        assert isinstance(err["message"], str) and err["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]", events[-3:]
        for event in events[:-1]:
            assert "error" not in json.loads(event[6:]), event
    else:
        assert json.loads("".join(lines))["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzzed_requests_never_500_or_hang(server) -> None:
    url = server.url
    want = httpx.post(f"{url}/v1/completions", json=GOOD).json()["choices"][0]["text"]
    statuses: dict[int, int] = {}
    client = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    @FUZZ_SETTINGS
    @given(requests())
    def one(request: tuple[str, bytes, str]) -> None:
        path, raw, content_type = request
        headers = {"content-type": content_type}
        with client.stream("POST", url + path, content=raw, headers=headers) as r:
            lines = list(r.iter_lines())
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        _check_response(r, lines)
        assert client.get(f"{url}/health", timeout=2).status_code == 200

    with _GoodClient(url, want) as good:
        one()
    client.close()
    assert good.errors == [] and good.texts, good.errors[:3]
    assert set(good.texts) == {want}
    assert statuses.get(200, 0) >= NUM_EXAMPLES // 10 and statuses.get(400, 0) >= NUM_EXAMPLES // 4, statuses  # fmt: skip
    _wait_idle(server)
    engine = server.server.config.app.state.llm.engine
    assert engine.kv.num_used_slots == 0 and engine.requests == {}
