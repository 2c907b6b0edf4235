"""Costs a request causes are its own (issue 30, item 4), through the server: bad_words are
tokenized and indexed on the preparation pool (never on the engine thread) and bounded with a
400 naming the field."""

from __future__ import annotations

import threading

import httpx
import pytest

from specdec.config import EngineConfig
from specdec.engine.async_llm import AsyncLLM
from specdec.entrypoints.openai.api_server import BackgroundServer, build_app
from specdec.sample.bad_words import MAX_BAD_WORD_TOKENS, BadWords
from specdec.sampling_params import MAX_BAD_WORD_CHARS


@pytest.fixture(scope="module")
def served(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), max_model_len=256, max_num_batched_tokens=64)
    llm = AsyncLLM.from_config(config, log_stats=False)
    srv = BackgroundServer(build_app(llm, ["tiny"], model_root=str(tiny_llama))).start()
    yield srv, llm
    srv.stop()


def _complete(url: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "the cat sat on the mat and the cat", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, **body}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_bad_words_are_built_on_the_preparation_pool(served, monkeypatch) -> None:
    srv, _ = served
    threads: list[str] = []
    build = BadWords.build.__func__  # type: ignore[attr-defined]

    def spy(cls, words, encode):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread().name)
        return build(cls, words, encode)

    monkeypatch.setattr(BadWords, "build", classmethod(spy))
    r = _complete(srv.url, bad_words=["e", "a b"], n=2)
    assert r.status_code == 200, r.text
    assert threads and all(t.startswith("specdec-prepare") for t in threads), threads
    assert len(threads) == 1  # the samples share it
    # NOTE: what is banned, with and without speculation: test_bad_words.py (offline)


def test_a_bad_word_over_the_token_limit_is_a_400(served) -> None:
    srv, _ = served
    r = _complete(srv.url, bad_words=["fine", "ab" * 4 * MAX_BAD_WORD_TOKENS])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "bad_words" and str(MAX_BAD_WORD_TOKENS) in error["message"]
    assert "ab" * 8 not in error["message"]  # the client's text is not echoed
    assert _complete(srv.url, bad_words=["fine"]).status_code == 200
    r = _complete(srv.url, bad_words=["x" * (MAX_BAD_WORD_CHARS + 1)])
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
    assert str(MAX_BAD_WORD_CHARS) in r.json()["error"]["message"]
