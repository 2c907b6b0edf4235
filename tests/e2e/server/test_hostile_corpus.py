"""The hostile corpus against a live `specdec serve` of the real model with suffix speculation.

Each case is a request (or a few at once) that once crashed the server, stalled it or leaked
through an error: grammars deep or slow enough to overflow or busy the grammar library, costly
logprobs and bad words, odd logit_bias keys, control characters, wrong types. For each one:
never a 5xx, every error an OpenAI-style body naming its field, the process alive afterwards,
and `/health` answering with no gap over 200 ms while the case runs (polled every ~10 ms from
another client). The server is a subprocess so that a crash is seen, not suffered.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.hostile import (
    gbnf_chain,
    lark_chain,
    nested_schema,
    ref_chain,
    schema_format,
    unique_text,
)
from tests.fixtures.prompts import INSTRUCTOR_RETRY
from tests.fixtures.server import serve

MAX_HEALTH_GAP_S = 0.2
CASE_TIMEOUT_S = 30.0


def _chat(extra: dict, content: str = "Give me JSON.") -> tuple[str, dict]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, **extra}
    return "chat/completions", body


def _completion(extra: dict, prompt: str = "hello") -> tuple[str, dict]:
    return "completions", {"prompt": prompt, "max_tokens": 24, **extra}


LONG_PROMPT = " ".join(f"word{i % 97}" for i in range(930))  # ~2,700 tokens
TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "a tool", "parameters": ref_chain(1000)},
}

# name -> requests sent at once: (path, body)
CASES: dict[str, list[tuple[str, dict]]] = {
    "ref_chain_1000": [_chat(schema_format(ref_chain(1000)))],
    "ref_chain_3000": [_chat(schema_format(ref_chain(3000)))],
    "nested_schema_200": [_chat(schema_format(nested_schema(200)))],
    "lark_chain_3000": [_completion({"guided_grammar": lark_chain(3000)})],
    "gbnf_chain_3000": [_chat({"grammar": gbnf_chain(3000)})],
    "tool_ref_chain": [_chat({"tools": [TOOL], "tool_choice": "required"})],
    "ambiguous_grammar": [
        _completion({"guided_grammar": 'start: s\ns: s s | "a"', "max_tokens": 400})
    ],
    "lazy_regex": [_completion({"guided_regex": "a{1000000}", "max_tokens": 64})],
    "two_80kb_gbnf": [_chat({"grammar": gbnf_chain(5000, f"r{k}x")}) for k in range(2)],
    "alternation_5000": [
        _completion({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(5000))})
    ],
    "prompt_logprobs": [_completion({"prompt_logprobs": 20, "max_tokens": 1}, LONG_PROMPT)],
    # two clients with long prompts nothing cached shares: prefill beside the others' decoding
    "two_long_prompts": [_completion({"max_tokens": 8}, unique_text(k, 250)) for k in range(2)],
    "bad_words_256": [
        _completion({"bad_words": [f"forbidden phrase number {i} " * 8 for i in range(256)]})
    ],
    "top_logprobs_big": [
        _completion({"logprobs": 20, "max_tokens": 600, "ignore_eos": True, "temperature": 0})
    ],
    "logit_bias_keys": [
        _completion({"logit_bias": {"²": 1}}),
        _completion({"logit_bias": {"9" * 5000: 1}}),
        _completion({"logit_bias": {"٣": 5}}),
    ],
    "control_chars": [_completion({}, "hi\x14there"), _chat({}, "a\x00b\x1bc")],
    "stop_wrong_type": [_completion({"stop": 5}), _completion({"stop": [5, {"a": 1}]})],
    "json_mode_retry": [
        (
            "chat/completions",
            {
                "messages": INSTRUCTOR_RETRY,
                "response_format": {"type": "json_object"},
                "temperature": 0,
                "max_tokens": 96,
            },
        )
    ],
}


@pytest.fixture(scope="module")
def live():
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": 8})
    with serve(
        "smollm2-135m", "--max-model-len", "4096", "--speculative-config", spec,
        "--shutdown-timeout", "1", "--uvicorn-log-level", "warning", timeout=60, grace=15,
    ) as srv:  # fmt: skip
        yield srv
    log = srv.log()
    assert "Traceback" not in log, log[-3000:]


class _HealthWatch:
    """Polls /health from its own client; ``max_gap`` is the longest time between answers."""

    def __init__(self, url: str) -> None:
        self.url, self.max_gap, self.failures = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            last = time.perf_counter()
            while not self._stop.is_set():
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                now = time.perf_counter()
                if ok:
                    self.max_gap, last = max(self.max_gap, now - last), now
                else:
                    self.failures += 1
                time.sleep(0.01)

    def __enter__(self) -> _HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def _send(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/{path}", json={"model": "smollm2-135m", **body}, timeout=CASE_TIMEOUT_S
    )


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_case_never_5xx_never_stalls(live, name: str) -> None:
    requests = CASES[name]
    with _HealthWatch(live.url) as watch, ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda pb: _send(live.url, *pb), requests))
    assert live.proc.poll() is None, live.stop()[-3000:]
    for r in answers:
        assert r.status_code < 500, (name, r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["param"] and "\n" not in err["message"], (name, err)
            assert len(err["message"]) < 400, (name, err["message"][:400])
        else:
            assert all(c["finish_reason"] != "error" for c in r.json()["choices"]), name
    assert watch.failures == 0, name
    assert watch.max_gap < MAX_HEALTH_GAP_S, (name, watch.max_gap)
    ok = _send(live.url, *_completion({"max_tokens": 4}))
    assert ok.status_code == 200


def test_model_cards_show_no_local_path(live) -> None:
    """The model as the operator named it (vLLM's root), never where its file lies."""
    for path in ("/v1/models", "/v1/models/smollm2-135m"):
        r = httpx.get(f"{live.url}{path}", timeout=10)
        assert r.status_code == 200 and ".gguf" not in r.text and "site-packages" not in r.text
    assert httpx.get(f"{live.url}/v1/models/smollm2-135m", timeout=10).json()["root"] == (
        "smollm2-135m"
    )
