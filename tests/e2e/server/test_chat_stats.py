"""Streamed token provenance, llama.cpp's ``timings`` and vLLM's per-request metrics, end to end
on the real default model with a speculative method (issue 35)."""

from __future__ import annotations

import json

import httpx
import pytest

from specdec.config import EngineConfig, SpeculativeConfig
from specdec.engine.async_llm import AsyncLLM
from specdec.entrypoints.openai.api_server import BackgroundServer, build_app
from specdec.entrypoints.openai.chat_page import CONTENT_SECURITY_POLICY

# NOTE: a fixed k: the adaptive controller, timing a loaded machine, may decline every draft,
# and the fields under test appear only for requests that verified drafts
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
# a prompt the model copies from: n-gram drafts get accepted
ECHO = "Repeat exactly: <script>alert(1)</script> <img src=x onerror=alert(2)> the end. " * 2


@pytest.fixture(scope="module")
def srv():
    config = EngineConfig(
        model="smollm2-135m", speculative=SpeculativeConfig.from_any(SPEC), max_model_len=512
    )
    llm = AsyncLLM.from_config(config, log_stats=False)
    app = build_app(llm, ["smollm2"], per_request_spec_decode_metrics="summary")
    server = BackgroundServer(app).start()
    yield server
    server.stop()


def _stream(srv: BackgroundServer, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _body(**kw) -> dict:
    messages = [{"role": "user", "content": ECHO}]
    # NOTE: ignore_eos: 60 tokens, most of them copied, whatever the kernels' greedy choice
    return {"messages": messages, "max_tokens": 60, "temperature": 0, "stream": True,
            "ignore_eos": True, **kw}  # fmt: skip


def test_provenance_matches_text_and_counts(srv):
    chunks = _stream(srv, _body(return_token_provenance=True))
    text, tokens, drafts = "", 0, 0
    for c in chunks:
        for choice in c["choices"]:
            content = choice["delta"].get("content") or ""
            spans = choice.get("token_provenance") or []
            assert sum(n for n, _ in spans) == len(content)  # aligned with the chunk's text
            text += content
            tokens += len(spans)
            drafts += sum(d for _, d in spans)
    last = chunks[-1]
    timings, spec = last["timings"], last["spec_decode"]
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert tokens == timings["predicted_n"]
    assert drafts > 0
    assert drafts == timings["draft_n_accepted"] == spec["num_accepted_tokens"]
    assert timings["draft_n"] == spec["num_draft_tokens"]
    sd = last["metrics"]["speculative_decoding"]
    assert sd["num_accepted_draft_tokens"] == drafts
    assert sum(sd["acceptance_histogram"]) == sd["num_spec_steps"] == spec["num_drafts"]
    # the same text as without provenance
    plain = _stream(srv, _body())
    assert text == "".join(
        c["choices"][0]["delta"].get("content") or "" for c in plain if c["choices"]
    )
    assert all("token_provenance" not in ch for c in plain for ch in c["choices"])


def test_timings_on_last_chunk_with_usage(srv):
    chunks = _stream(
        srv, _body(return_token_provenance=True, stream_options={"include_usage": True})
    )
    assert all("timings" not in c for c in chunks[:-1])
    last = chunks[-1]
    assert (
        last["choices"] == []
        and last["usage"]["completion_tokens"] == last["timings"]["predicted_n"]
    )


def test_llama_cpp_client_reads_timings(srv):
    """Read the way llama.cpp's web UI and clients read it: response.timings, numbers."""
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={**_body(), "stream": False},
        timeout=60,
    )
    body = r.json()
    t = body["timings"]
    for name in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
                 "prompt_per_second", "draft_n", "draft_n_accepted"):  # fmt: skip
        assert isinstance(t[name], (int, float)), name
    assert t["predicted_n"] == body["usage"]["completion_tokens"]
    assert t["prompt_n"] + t["cache_n"] == body["usage"]["prompt_tokens"]
    assert t["draft_n_accepted"] == body["spec_decode"]["num_accepted_tokens"] > 0
    assert t["predicted_per_second"] > 0


def test_provenance_needs_stream(srv):
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={**_body(return_token_provenance=True), "stream": False},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_provenance"


def test_page_headers(srv):
    r = httpx.get(f"{srv.url}/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in r.text and "style=" not in r.text  # no inline script or style
    css = httpx.get(f"{srv.url}/static/app.css")
    assert css.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    js = httpx.get(f"{srv.url}/static/app.js").text
    assert len(js.encode()) + len(css.content) <= 30 * 1024  # the page stays small
    assert "innerHTML" not in js and "http" not in js.replace("HTTP ", "")
