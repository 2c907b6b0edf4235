"""Drop-in for vLLM and llama.cpp users: the commands and snippets they paste run as pasted (the
model name aside), per-request speculation control through the official client, and the
sampling API they expect, exact under speculation."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.config import EngineArgs
from specdec.engine.async_llm import AsyncLLM
from specdec.entrypoints.openai import api_server
from specdec.entrypoints.openai.api_server import BackgroundServer, build_app
from tests.fixtures.server import SPECDEC_SERVE, serve

REPO = Path(__file__).resolve().parents[3]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SERVE_MODULE = (sys.executable, "-m", "specdec.entrypoints.openai.api_server")


def _serve(*argv: str, command: tuple[str, ...] = SERVE_MODULE):
    """A pasted server command, healthy (its log: ``srv.log()``, whole once stopped)."""
    return serve(None, *argv, "--uvicorn-log-level", "warning", command=command, grace=30)


def _curl_chat(url: str) -> dict:
    """The seed's curl: a chat completion with the model's name."""
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 16,
            "temperature": 0,
        },  # fmt: skip
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


# ---- the pasted commands ----------------------------------------------------------------------


@pytest.mark.slow
def test_pasted_vllm_server_command() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    with _serve(
        "--model=smollm2-135m", "--max-num-seqs=256", "--max-model-len=8192",
        "--max-num-batched-tokens=8192", "--dtype=bfloat16", "--tensor-parallel-size=1",
        "--gpu-memory-utilization=0.8", "--trust-remote-code", "--speculative-config",
        json.dumps(spec),
    ) as srv:  # fmt: skip
        body = _curl_chat(srv.url)
    log = srv.log()
    assert body["choices"][0]["message"]["content"] and "num_drafts" in body["spec_decode"]
    assert "ignored on CPU: trust_remote_code" in log
    assert "dtype bfloat16: kept the native kernels" in log
    start = re.search(r"engine: smollm2-135m; dtype float32, kernels native.*KV cache float16; "
                      r"max_model_len 8192; KV slots: (\d+) running", log)  # fmt: skip
    assert start, log
    if int(start.group(1)) < 256:  # the budget held fewer sequences: said so
        assert f"max_num_seqs 256 lowered to {start.group(1)}" in log


def test_pasted_legacy_speculative_server_flags(tiny_llama) -> None:
    with _serve(
        str(tiny_llama), "--served-model-name", "smollm2-135m", "--max-model-len", "128",
        "--speculative-model", "[ngram]", "--num-speculative-tokens", "5",
        "--speculative-draft-tensor-parallel-size", "1", "-ngl", "99", "-c", "128",
        command=SPECDEC_SERVE,
    ) as srv:  # fmt: skip
        body = _curl_chat(srv.url)
    log = srv.log()
    assert body["spec_decode"]["num_speculative_tokens"] == 5
    assert "speculation: ngram k=5" in log and "ignored on CPU: n_gpu_layers" in log


@pytest.mark.slow
def test_pasted_vllm_offline_snippets() -> None:
    plain = LLM("smollm2-135m", max_model_len=512)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    del plain
    for kwargs in (
        dict(tensor_parallel_size=1, enforce_eager=True, async_scheduling=True,
             distributed_executor_backend="mp", gpu_memory_utilization=0.8,
             trust_remote_code=True, speculative_config={
                 "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}),
        dict(speculative_model="[ngram]", num_speculative_tokens=5, ngram_prompt_lookup_max=4,
             speculative_draft_tensor_parallel_size=1, use_v2_block_manager=True),
    ):  # fmt: skip
        llm = LLM("smollm2-135m", max_model_len=512, **kwargs)
        assert llm.engine.spec.method == "ngram"
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert got == want
        del llm


# ---- per-request speculation through the official client -------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama):
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 4,
            "adaptive": False}  # fmt: skip
    args = EngineArgs(model=str(tiny_llama), max_model_len=256, speculative_config=spec)
    llm = AsyncLLM.from_config(args.create_engine_config(), log_stats=False)
    with BackgroundServer(build_app(llm, ["tiny"])) as srv:
        yield srv


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)


def test_request_turns_speculation_off_or_caps_it(server) -> None:
    client = _client(server)

    def complete(**extra) -> openai.types.Completion:
        return client.completions.create(
            model="tiny", prompt="hello there", max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )  # fmt: skip

    default, off, capped, llama = (
        complete(),
        complete(num_speculative_tokens=0),
        complete(num_speculative_tokens=2),
        complete(**{"speculative.n_max": 1, "speculative.n_min": 1}),
    )
    texts = {r.choices[0].text for r in (default, off, capped, llama)}
    assert len(texts) == 1  # the same text whatever the speculation
    stats = [r.model_extra["spec_decode"] for r in (default, off, capped, llama)]
    assert [s["num_speculative_tokens"] for s in stats] == [4, 0, 2, 1]
    assert stats[0]["num_drafts"] > 0 and len(stats[0]["accepted_per_pos"]) == 4
    assert stats[1]["num_drafts"] == 0
    assert len(stats[2]["accepted_per_pos"]) == 2 and len(stats[3]["accepted_per_pos"]) == 1
    with pytest.raises(openai.BadRequestError, match="disagree"):
        complete(num_speculative_tokens=2, **{"speculative.n_max": 3})
    with pytest.raises(openai.BadRequestError, match="speculative.p_min"):
        complete(**{"speculative.p_min": 1.5})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
    ],
)
def test_empty_or_malformed_prompts_get_a_400(server, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


# ---- metrics: vllm:* aliases and the Grafana dashboard ---------------------------------------

DASHBOARD = REPO / "docs" / "grafana" / "specdec_dashboard.json"


def _exposed(text: str) -> dict[str, set[str]]:
    """Sample name -> label names, from Prometheus' text format."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? ", line)
        if m and not line.startswith("#"):
            labels = {kv.split("=", 1)[0] for kv in (m.group(3) or "").split(",") if kv}
            out.setdefault(m.group(1), set()).update(labels)
    return out


def test_dashboard_queries_only_metrics_the_server_exposes(server) -> None:
    _client(server).completions.create(
        model="tiny", prompt="hello there", max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    exposed = _exposed(httpx.get(f"{server.url}/metrics", timeout=30).text)
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert len(panels) >= 10 and exprs
    used = set()
    for expr in exprs:
        for name in re.findall(r"(vllm:[a-z0-9_]+)", expr):
            used.add(name)
            assert name in exposed, f"{name} (in {expr!r}) is not on /metrics"
            assert "model_name" in exposed[name]
        for group in re.findall(r"by \(([a-z_, ]+)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert any(label in exposed[n] for n in re.findall(r"(vllm:[a-z0-9_]+)", expr))
    assert {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_draft_tokens_total"} <= used  # fmt: skip
    # every vllm:* series has its specdec:* twin with the same value
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("vllm:") and "_created" not in line:
            assert "specdec:" + line[len("vllm:") :] in text, line


def test_metrics_prefix_choice(tiny_llama) -> None:
    from specdec.metrics import PREFIX_CHOICES, EngineMetrics

    only_vllm = EngineMetrics("t", prefixes=PREFIX_CHOICES["vllm"]).render().decode()
    only_ours = EngineMetrics("t", prefixes=PREFIX_CHOICES["specdec"]).render().decode()
    assert "vllm:prompt_tokens" in only_vllm and "specdec:" not in only_vllm
    assert "specdec:prompt_tokens" in only_ours and "vllm:" not in only_ours
    parser = api_server.make_arg_parser(argparse.ArgumentParser())
    assert parser.parse_args(["--metrics-prefix", "vllm"]).metrics_prefix == "vllm"
    assert parser.parse_args([]).metrics_prefix == "both"


# ---- the sampling API through the official client ---------------------------------------------


def test_n_logprobs_echo_and_batched_prompts_through_the_client(server, tiny_llama) -> None:
    client = _client(server)
    kw = {"model": "tiny", "max_tokens": 8, "temperature": 0.9, "seed": 5}
    extra = {"ignore_eos": True}
    r = client.completions.create(prompt="hello there", n=2, logprobs=3, extra_body=extra, **kw)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 16
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        # top-3 and the chosen one (tokens that decode alike, as U+FFFD, share a key)
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
        assert max(len(top) for top in lp.top_logprobs) >= 3
    # the same samples offline, plain decoding: sample i is seeded seed + i
    plain = LLM(str(tiny_llama), max_model_len=256)
    want = plain.generate(
        "hello there", SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True,
                                      n=2, logprobs=3),
    )[0]  # fmt: skip
    assert [c.text for c in r.choices] == [c.text for c in want.outputs]
    for c, w in zip(r.choices, want.outputs):
        assert c.logprobs.token_logprobs == [d[t].logprob for d, t in zip(w.logprobs, w.token_ids)]
    # streamed: the same text per choice
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(
        prompt="hello there", n=2, stream=True, extra_body=extra, **kw
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in r.choices]
    # batched prompts with n: prompt-major choice indices, each prompt counted once
    b = client.completions.create(prompt=["hello there", "a b a b"], n=2, extra_body=extra, **kw)
    assert [c.index for c in b.choices] == [0, 1, 2, 3]
    assert b.choices[0].text == r.choices[0].text and b.usage.completion_tokens == 32
    # best_of: one returned, three generated
    best = client.completions.create(prompt="hello there", best_of=3, extra_body=extra, **kw)
    assert len(best.choices) == 1 and best.usage.completion_tokens == 24
    # echo with logprobs: the prompt first, its first token without a log-probability
    e = client.completions.create(prompt="hello there", echo=True, logprobs=1, extra_body=extra,
                                  **kw)  # fmt: skip
    assert e.choices[0].text.startswith("hello there")
    assert e.choices[0].logprobs.token_logprobs[0] is None
    num_prompt = e.usage.prompt_tokens
    assert len(e.choices[0].logprobs.tokens) == num_prompt + 8
    assert "".join(e.choices[0].logprobs.tokens[:num_prompt]) == "hello there"
    # chat: n and top_logprobs
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], n=2, logprobs=True, top_logprobs=3,
        extra_body=extra, **kw,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].logprob >= (
        chat.choices[0].logprobs.content[0].top_logprobs[1].logprob
    )


def test_logit_bias_bad_words_and_prompt_logprobs_through_the_client(server, tiny_llama) -> None:
    client = _client(server)
    kw = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    forced = client.completions.create(
        prompt="hello there", logit_bias={"5": 100}, extra_body={"ignore_eos": True}, **kw
    )
    tok = LLM(str(tiny_llama), max_model_len=64).get_tokenizer()
    assert set(tok.encode(forced.choices[0].text, False)) == {5}
    plain = client.completions.create(prompt="hello there", extra_body={"ignore_eos": True}, **kw)
    first = plain.choices[0].text[0]
    banned = client.completions.create(
        prompt="hello there", extra_body={"ignore_eos": True, "bad_words": [first]}, **kw
    )
    assert first not in banned.choices[0].text
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hello there", "prompt_logprobs": 2, **kw},
        timeout=30,
    ).json()
    prompt_lp = r["choices"][0]["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == r["usage"]["prompt_tokens"]
    assert all(2 <= len(d) <= 3 for d in prompt_lp[1:])
    assert {"logprob", "rank", "decoded_token"} == set(next(iter(prompt_lp[1].values())))
