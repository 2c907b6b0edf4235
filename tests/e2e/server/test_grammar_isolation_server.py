"""Hostile grammars against a live in-process server (tiny model): constraints that crash the
grammar library (deep $ref / Lark / GBNF chains, a deep tool schema) or are too slow to compile
or to mask are a 400 naming the request's field, in one short line; the grammar workers are
replaced and the server goes on (/health, a normal request, a normal constraint). Requests
waiting for a grammar worker hold nothing that other requests need."""

from __future__ import annotations

import glob
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdec.config import EngineConfig
from specdec.engine.async_llm import AsyncLLM
from specdec.entrypoints.openai.api_server import BackgroundServer, build_app
from tests.fixtures.hostile import (
    anchor_chain,
    gbnf_alternatives,
    gbnf_chain,
    lark_chain,
    ref_chain,
    schema_format,
)
from tests.fixtures.models import with_chat_template
from tests.fixtures.prompts import TEMPLATE

TIMEOUT_S = 60


DEEP_TOOL = {"type": "function", "function": {"name": "f", "parameters": ref_chain(1000)}}


class _Live:
    def __init__(self, model: str) -> None:
        config = EngineConfig(model=model, max_model_len=256, max_num_seqs=4)
        self.llm = AsyncLLM.from_config(config, log_stats=False)
        self.compiler = self.llm.engine.grammar_compiler
        self.srv = BackgroundServer(build_app(self.llm, ["tiny"], model_root=model)).start()
        self.url = self.srv.url

    def post(self, path: str, body: dict) -> httpx.Response:
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, **body}
        if path == "completions":
            body.setdefault("prompt", "hello")
        else:
            body.setdefault("messages", [{"role": "user", "content": "Give me JSON."}])
        return httpx.post(f"{self.url}/v1/{path}", json=body, timeout=TIMEOUT_S)

    def assert_healthy(self) -> None:
        assert httpx.get(f"{self.url}/health", timeout=TIMEOUT_S).status_code == 200
        plain = self.post("completions", {"max_tokens": 4})
        assert plain.status_code == 200, plain.text
        ok = self.post("completions", {"guided_regex": "[a-c]{3}", "max_tokens": 8})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def live(tiny_llama, tmp_path_factory):
    model = with_chat_template(tiny_llama, tmp_path_factory.mktemp("tiny_tools"), TEMPLATE)
    server = _Live(str(model))
    yield server
    server.srv.stop()


def _assert_one_line_400(r: httpx.Response, param: str, words: str, secret: str) -> None:
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    assert "\n" not in err["message"] and len(err["message"]) < 300, err
    assert secret not in err["message"]  # never the client's grammar or the parser's state


@pytest.mark.parametrize(
    ("path", "extra", "param", "words", "secret"),
    [
        # refused by the structure checks, before the library sees them
        ("chat/completions", schema_format(ref_chain(1000)),
         "response_format.json_schema.schema", "the limit is 1000", "d999"),
        ("completions", {"guided_grammar": lark_chain(3000)}, "guided_grammar",
         "rules nest 3002 deep; the limit is 1000", "r2999"),
        ("chat/completions", {"grammar": gbnf_chain(3000)}, "grammar",
         "rules nest 3002 deep; the limit is 1000", "rule2999"),
        ("chat/completions", {"tools": [DEEP_TOOL], "tool_choice": "auto"}, "tools",
         "the limit is 1000", "d999"),
        # a chain the checks do not follow ($anchor links): the worker crashes, is replaced
        ("chat/completions", schema_format(anchor_chain(1000)),
         "response_format.json_schema.schema", "nested or chained too deeply", "a999"),
        ("completions", {"guided_regex": "a{1000000}"}, "guided_regex", "lexer error",
         "1000000"),
        ("completions", {"guided_regex": "(" + "secret" * 50}, "guided_regex", "invalid regex",
         "secret" * 5),
        ("completions", {"guided_json": {"type": "nonsense" + "z" * 300}}, "guided_json",
         "Invalid type", "z" * 30),
    ],
)  # fmt: skip
def test_a_constraint_that_crashes_or_stalls_the_library_is_a_400(
    live, path, extra, param, words, secret
) -> None:
    """(Each of these killed the server with SIGSEGV, or cost ~1 s of the engine's thread.)"""
    restarts = live.compiler.checker.num_restarts
    _assert_one_line_400(live.post(path, extra), param, words, secret)
    # the worker died and was replaced, or never saw the constraint
    assert live.compiler.checker.num_restarts == restarts + ("deeply" in words)
    live.assert_healthy()


def _worker_pids() -> list[int]:
    me, pids = str(os.getpid()), []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                ppid = f.read().rpartition(")")[2].split()[1]
            with open(stat.replace("stat", "cmdline"), "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == me and b"compile_worker.py" in cmd:
            pids.append(int(stat.split("/")[2]))
    return pids


def test_a_worker_killed_mid_job_is_replaced(live) -> None:
    """A crash while a job runs (SIGSEGV sent to every worker while one converts a slow GBNF
    grammar): that request is a 400 naming its field, the next ones are served normally."""
    slow = gbnf_alternatives(8000)  # ~1-2 s in gbnf_to_lark
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(live.post, "chat/completions", {"grammar": slow})
        while not answer.done() and len(_worker_pids()) < 1:
            pass
        for pid in _worker_pids():
            os.kill(pid, signal.SIGSEGV)
        r = answer.result()
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text[:300]
    live.assert_healthy()
    live.assert_healthy()  # both worker slots (one died idle) serve again


def test_requests_waiting_for_a_grammar_worker_hold_no_one_else(live, monkeypatch) -> None:
    """While a client's grammar compiles are held (here: until released), a plain request and a
    chat are answered: waiting constraints sit in the compiler's own queue, not in the
    preparation pool (two slow GBNF grammars once held both its threads for 22 s), and the
    client's lane holds one of the compiler's two threads, never both."""
    release, entered = threading.Event(), threading.Semaphore(0)
    check = live.compiler.checker.check

    def held(spec: dict) -> str:
        entered.release()
        release.wait(TIMEOUT_S)
        return check(spec)

    monkeypatch.setattr(live.compiler.checker, "check", held)
    with ThreadPoolExecutor(3) as pool:
        waiting = [
            pool.submit(live.post, "completions", {"guided_regex": f"x{i}"}) for i in range(3)
        ]
        assert entered.acquire(timeout=TIMEOUT_S)
        assert not entered.acquire(timeout=1.0)  # its other two wait in its lane
        try:
            assert live.post("completions", {"max_tokens": 2}).status_code == 200
            assert live.post("chat/completions", {"max_tokens": 2}).status_code == 200
            assert httpx.get(f"{live.url}/health", timeout=TIMEOUT_S).status_code == 200
            assert not any(w.done() for w in waiting)
        finally:
            release.set()
        assert [w.result().status_code for w in waiting] == [200, 200, 200]
