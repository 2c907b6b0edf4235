"""The OpenAI-compatible server, end to end: real uvicorn on 127.0.0.1, the official client, httpx."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import httpx
import openai
import pytest

from specdec import cli
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.engine.async_llm import AsyncLLM
from specdec.entrypoints.openai.api_server import BackgroundServer, build_app
from tests.fixtures.models import with_chat_template
from tests.fixtures.server import (
    API_KEY,
    MAX_MODEL_LEN,
    _client,
    _engine,
    _metric,
    _SlowSteps,
    _start,
    _wait_idle,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = _start(str(tiny_llama))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_server(tiny_llama):
    srv = _start(str(tiny_llama), spec=NGRAM)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_llama, tmp_path_factory):
    """A copy of the tiny model without a chat template, behind an API key."""
    folder = with_chat_template(tiny_llama, tmp_path_factory.mktemp("tiny_no_template"), None)
    srv = _start(str(folder), api_key=API_KEY)
    yield srv
    srv.stop()


CHAT = [{"role": "user", "content": "Say something about the cat."}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


# ---- happy paths ---------------------------------------------------------------------------------


def test_models_health_metrics(server) -> None:
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "specdec:spec_decode_num_drafts_total",
        "specdec:spec_decode_num_draft_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_per_pos_total",
        "specdec:prompt_tokens_total",
        "specdec:generation_tokens_total",
        "specdec:num_requests_running",
        "specdec:num_requests_waiting",
        "specdec:kv_cache_usage_perc",
        "specdec:prefix_cache_queries_total",
        "specdec:prefix_cache_hits_total",
        "specdec:request_failure_total",
        "specdec:time_to_first_token_seconds",
        "specdec:time_per_output_token_seconds",
    ):
        assert f"# TYPE {name}" in text, name


def test_chat_stream_and_not(server) -> None:
    client = _client(server)
    before = _metric(server, "specdec:generation_tokens_total")
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert full.usage.completion_tokens == 20 and full.usage.prompt_tokens > 5
    assert full.model_extra["spec_decode"]["num_drafts"] == 0
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert "spec_decode" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert _metric(server, "specdec:generation_tokens_total") >= before + 40
    assert _metric(server, "specdec:time_to_first_token_seconds_count") >= 2


def test_prefix_cache_cached_tokens_and_metrics(server) -> None:
    """A repeated prompt reports its cached prompt tokens, as OpenAI does, and the counters move."""
    client = _client(server)
    queries = _metric(server, "specdec:prefix_cache_queries_total")
    hits = _metric(server, "specdec:prefix_cache_hits_total")
    messages = [{"role": "user", "content": "Count the prefix cache hits: seven, eight, nine."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    second = chunks[-1].usage
    n = first.usage.prompt_tokens
    assert second.prompt_tokens == n and second.prompt_tokens_details.cached_tokens == n - 1
    assert first.usage.prompt_tokens_details.cached_tokens < n - 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    _wait_idle(server)
    assert _metric(server, "specdec:prefix_cache_queries_total") == queries + 2 * n
    hit_tokens = first.usage.prompt_tokens_details.cached_tokens + n - 1
    assert _metric(server, "specdec:prefix_cache_hits_total") == hits + hit_tokens
    assert _metric(server, "specdec:kv_cache_usage_perc") == 0


def test_completions_stream_and_not(server) -> None:
    client = _client(server)
    full = client.completions.create(
        model="tiny", prompt="the cat sat on the", max_tokens=24, **GREEDY
    )
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24
    assert full.model_extra["spec_decode"]["mean_acceptance_length"] == 1.0
    stream = client.completions.create(
        model="tiny", prompt="the cat sat on the", max_tokens=24, stream=True, **GREEDY
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert (
        chunks[-1].choices[0].finish_reason == "length" and "spec_decode" in chunks[-1].model_extra
    )
    # token ids as the prompt, and the model name may be left out (raw httpx)
    ids = _engine(server).tokenizer.encode("the cat sat on the")
    body = {"prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == full.choices[0].text


def test_raw_sse_format(server) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["object"] == "text_completion"


def test_stop_strings(server) -> None:
    client = _client(server)
    prompt = "a b c a b c"
    base = (
        client.completions.create(model="tiny", prompt=prompt, max_tokens=40, **GREEDY)
        .choices[0]
        .text
    )
    stop = base[12:15]
    expected = base[: base.find(stop)]
    for stops in (stop, ["<never>", stop]):
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, stop=stops, **GREEDY
        )
        assert got.choices[0].text == expected
        assert got.choices[0].finish_reason == "stop"
        assert got.choices[0].model_extra["stop_reason"] == stop
        chunks = list(
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=40, stop=stops, stream=True, **GREEDY
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_and_max_completion_tokens(server) -> None:
    client = _client(server)
    base = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=30, logprobs=0, **GREEDY
    )
    first = base.choices[0].logprobs.tokens[3]
    tok_id = _engine(server).tokenizer.encode(first)[0]
    got = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=30, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [tok_id]},
    )  # fmt: skip
    assert (
        got.choices[0].finish_reason == "stop"
        and got.choices[0].model_extra["stop_reason"] == tok_id
    )
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=7, **GREEDY
    )
    assert chat.usage.completion_tokens == 7


def test_seed_reproducible(server) -> None:
    client = _client(server)

    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].message.content

    assert sample(123) == sample(123)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_sampling_extras_accepted(server) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
            "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
            "seed": 7, "ignore_eos": True, "user": "u1", "some_unknown_field": 1,
        },
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def test_logprobs(server) -> None:
    client = _client(server)
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=0, **GREEDY
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(t.logprob <= 0 for t in content)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=6, logprobs=True, stream=True, **GREEDY
        )
    )
    streamed = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert streamed == pytest.approx([t.logprob for t in content])
    comp = client.completions.create(
        model="tiny", prompt="hello", max_tokens=6, logprobs=0, **GREEDY
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6


def test_speculative_server_same_greedy_text(server, spec_server) -> None:
    prompt = "the cat sat on the mat and the cat sat on the mat and the cat"
    plain = _client(server).completions.create(model="tiny", prompt=prompt, max_tokens=48, **GREEDY)
    spec = _client(spec_server).completions.create(
        model="tiny", prompt=prompt, max_tokens=48, **GREEDY
    )
    assert spec.choices[0].text == plain.choices[0].text
    stats = spec.model_extra["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_accepted_tokens"]
    chunks = list(
        _client(spec_server).chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=24, stream=True, **GREEDY
        )
    )
    plain_chat = _client(server).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=24, **GREEDY
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == plain_chat.choices[0].message.content
    )
    assert _metric(spec_server, "specdec:spec_decode_num_drafts_total") >= stats["num_drafts"]
    assert (
        _metric(
            spec_server, "specdec:spec_decode_num_accepted_tokens_per_pos_total", 'position="0"'
        )
        >= 0
    )


# ---- bad input -------------------------------------------------------------------------------------

_BAD = [
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    ("chat", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("chat", {"messages": CHAT, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("chat", {"messages": CHAT, "temperature": -0.5}, "temperature"),
    ("chat", {"messages": CHAT, "temperature": "hot"}, "temperature"),
    ("chat", {"messages": CHAT, "top_p": 0}, "top_p"),
    ("chat", {"messages": CHAT, "top_p": 1.5}, "top_p"),
    ("chat", {"messages": CHAT, "n": 0}, "n"),
    ("chat", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ("chat", {"messages": CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"messages": CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"messages": CHAT, "logit_bias": {"1": 101}}, "logit_bias"),
    ("chat", {"messages": CHAT, "logit_bias": {"99999": 1}}, "logit_bias"),
    ("chat", {"messages": CHAT, "echo": True}, "echo"),
    (
        "chat",
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
    ),
    ("chat", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    (
        "chat",
        {"messages": CHAT, "guided_json": {"type": "object", "minProperties": "x"}},
        "guided_json",
    ),
    ("chat", {"messages": CHAT, "stop": 5}, "stop"),
    ("chat", {"messages": CHAT, "presence_penalty": 3}, "presence_penalty"),
    ("chat", {"messages": CHAT, "top_k": -5}, "top_k"),
    ("completions", {"prompt": "x" * 300}, "prompt"),
    ("completions", {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 1}, "max_tokens"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": ["a", ""]}, "prompt"),
    ("completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("completions", {"prompt": "hello", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hello", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt": "hello", "n": 3, "best_of": 2}, "best_of"),
    ("completions", {"prompt": "hello", "best_of": 3, "stream": True}, "best_of"),
    ("completions", {"prompt": "hello", "bad_words": [""]}, "bad_words[0]"),
    ("completions", {"prompt": "hello", "max_tokens": 1.5}, "max_tokens"),
    ("completions", {"prompt": "hello", "stream": "maybe"}, "stream"),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"), _BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(_BAD)]
)
def test_bad_request_is_400_naming_the_param(server, endpoint: str, body: dict, param: str) -> None:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"]


def test_malformed_and_oversized_bodies(server) -> None:
    url = f"{server.url}/v1/chat/completions"
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    )
    r = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(model="tiny", messages=CHAT, temperature=-1)
    assert e.value.param == "temperature"
    # everyone else is still served
    ok = _client(server).completions.create(model="tiny", prompt="hi", max_tokens=3, **GREEDY)
    assert ok.usage.completion_tokens == 3
    _wait_idle(server)


def test_api_key_and_missing_chat_template(keyed_server) -> None:
    url = keyed_server.url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    r = httpx.post(
        f"{url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(keyed_server, "wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert httpx.get(f"{url}/health").status_code == 200
    client = _client(keyed_server, API_KEY)
    assert (
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, **GREEDY
        ).usage.completion_tokens
        == 2
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert e.value.param == "messages" and "chat template" in e.value.message


# ---- disconnects and failures ----------------------------------------------------------------------


def test_client_disconnect_mid_stream_frees_kv(server) -> None:
    aborted = _metric(server, "specdec:request_success_total", 'finished_reason="abort"')
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with _SlowSteps(server):
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        _wait_idle(server, timeout=3.0)
        assert _metric(server, "specdec:num_requests_running") == 0
        assert _metric(server, "specdec:kv_cache_usage_perc") == 0
        assert (
            _metric(server, "specdec:request_success_total", 'finished_reason="abort"')
            == aborted + 1
        )
        # a non-streaming client that gives up is aborted too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
        _wait_idle(server, timeout=3.0)
        assert (
            _metric(server, "specdec:request_success_total", 'finished_reason="abort"')
            == aborted + 2
        )


def test_engine_step_error_fails_requests_and_keeps_serving(server) -> None:
    engine = _engine(server)
    real = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real()

    engine.step = flaky_step
    try:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 20, "ignore_eos": True},
        )
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        body = {"prompt": "hi", "max_tokens": 20, "ignore_eos": True, "stream": True}
        calls["n"] = 0
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as s:
            events = [line for line in s.iter_lines() if line]
        assert "boom" in events[-2] and events[-1] == "data: [DONE]"
    finally:
        del engine.step
    _wait_idle(server)
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    assert httpx.get(f"{server.url}/health").status_code == 200


BAD_SEED = 666


def test_one_failed_request_ends_alone(server, monkeypatch, caplog) -> None:
    """A request the engine fails (NaN logits here) gets a 500, or an error event and [DONE]; a
    concurrent request's greedy text is unchanged; one log line names each failed request."""
    import concurrent.futures

    from specdec.sample import rejection_sampler

    body = {"prompt": "the cat sat", "max_tokens": 24, "ignore_eos": True, "temperature": 0.8}
    good = {**body, "temperature": 0.0, "max_tokens": 40}
    url = f"{server.url}/v1/completions"
    want = httpx.post(url, json=good).json()["choices"][0]["text"]
    failures = _metric(server, "specdec:request_failure_total")
    real = rejection_sampler.processed_logits

    def poisoned(logits, sp, mask, counts):
        out = real(logits, sp, mask, counts)
        return out * float("nan") if sp.seed == BAD_SEED else out

    monkeypatch.setattr(rejection_sampler, "processed_logits", poisoned)
    caplog.set_level(logging.INFO)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(httpx.post, url, json=good, timeout=30)
        bad = httpx.post(url, json={**body, "seed": BAD_SEED})
        with httpx.stream("POST", url, json={**body, "seed": BAD_SEED, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert other.result().json()["choices"][0]["text"] == want
    monkeypatch.undo()
    assert bad.status_code == 500 and "not finite" in bad.json()["error"]["message"]
    assert (
        events[-1] == "data: [DONE]"
        and "not finite" in json.loads(events[-2][6:])["error"]["message"]
    )
    _wait_idle(server)
    assert _metric(server, "specdec:request_failure_total") == failures + 2
    failed_lines = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed_lines) == 2 and not any(r.exc_info for r in caplog.records)
    assert all("'cmpl-" in r.getMessage() for r in failed_lines)  # the request id
    assert httpx.post(url, json=good).json()["choices"][0]["text"] == want


def test_async_llm_generate_cancel_and_errors(tiny_llama) -> None:
    """AsyncLLM without HTTP: outputs stream per step, closing the iterator frees the KV at once,
    a bad request fails only its caller, and a stopped engine refuses work."""
    import asyncio

    from specdec.engine.async_llm import EngineDeadError
    from specdec.sampling_params import SamplingParams

    llm = AsyncLLM.from_config(
        EngineConfig(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN), log_stats=False
    )
    llm.start()

    async def scenario() -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = [o async for o in llm.generate("hello", sp)]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
        assert sum(len(o.delta_token_ids) for o in outs) == 12
        with pytest.raises(ValueError, match="empty"):
            await llm.add_request([], sp)
        gen = llm.generate("hello", SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(gen)
        assert await llm.call(lambda e: e.kv.num_used_slots) == 1
        await gen.aclose()
        assert await llm.call(lambda e: (e.kv.num_used_slots, len(e.requests))) == (0, 0)
        again = [o async for o in llm.generate("hello", sp)]
        assert again[-1].outputs[0].text == outs[-1].outputs[0].text

    try:
        asyncio.run(scenario())
    finally:
        llm.shutdown()

    async def after_shutdown() -> None:
        with pytest.raises(EngineDeadError):
            await llm.add_request("hello", SamplingParams())

    asyncio.run(after_shutdown())


# ---- start-up --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--speculative-config", "{not json"], "not valid JSON"),
        (["--speculative-config", '{"method": "telepathy"}'], "telepathy"),
        (["--pipeline-parallel-size", "2"], "pipeline-parallel-size"),
    ],
)
def test_serve_bad_flags_exit_2(tiny_llama, capsys, flags: list[str], needle: str) -> None:
    assert cli.main(["serve", str(tiny_llama), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("specdec: error:")


def test_module_entry_point(tiny_llama, server_process) -> None:
    """``python -m specdec.entrypoints.openai.api_server``: a bad flag, then a real start and stop."""
    exe = [
        sys.executable,
        "-m",
        "specdec.entrypoints.openai.api_server",
        "--model",
        str(tiny_llama),
    ]
    bad = subprocess.run(
        [*exe, "--speculative-config", '{"method": "nope"}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "nope" in bad.stderr
    flags = ["--served-model-name", "t1", "t2", "--max-model-len", "128",
             "--speculative-config", json.dumps(NGRAM), "--uvicorn-log-level", "warning"]  # fmt: skip
    srv = server_process(None, *flags, command=exe, timeout=60)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["t1", "t2"]
    r = client.completions.create(model="t2", prompt="a b a b a b", max_tokens=8, **GREEDY)
    assert r.usage.completion_tokens == 8 and "num_drafts" in r.model_extra["spec_decode"]


# ---- the real default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_chat_stream_ngram() -> None:
    from specdec.model.registry import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    msgs = [{"role": "user", "content": "List the days of the week, separated by commas."}]
    texts = {}
    for spec in (None, NGRAM):
        llm = AsyncLLM.from_config(
            EngineConfig(
                model="smollm2-135m",
                max_model_len=512,
                speculative=SpeculativeConfig.from_any(spec),
            ),
            log_stats=False,
        )
        with BackgroundServer(build_app(llm, ["smollm2-135m"])) as srv:
            stream = _client(srv).chat.completions.create(
                model="smollm2-135m", messages=msgs, max_tokens=32, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = list(stream)
        texts[spec is not None] = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices
        )
        assert chunks[-1].usage.completion_tokens <= 32
        if spec is not None:
            assert chunks[-1].model_extra["spec_decode"]["num_drafts"] > 0
    assert texts[True] == texts[False] and "Monday" in texts[True]
