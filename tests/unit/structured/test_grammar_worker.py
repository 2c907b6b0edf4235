"""Constraints are checked in worker processes before the engine's process compiles them: a
grammar deep enough to overflow the grammar library's stack, or slow to compile or to mask, is a
one-line error naming the field and the limit, and the process (and the next request) goes on.
A grammar that costs more engine time than its budget fails its request alone."""

from __future__ import annotations

import json
import time

import pytest

from specdec import LLM, SamplingParams
from specdec.structured import compile_worker, grammar
from specdec.structured.grammar import GrammarError
from tests.fixtures.hostile import (
    anchor_chain,
    gbnf_alternatives,
    gbnf_chain,
    lark_chain,
    nested_schema,
    ref_chain,
)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), max_model_len=512)


def _sp(constraint: dict, n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, structured_outputs=constraint)


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        # refused before the library sees them (the structure checks)
        (
            {"json": ref_chain(3000)},
            "the schema nests 3003 objects deep, following $ref; the limit is 1000",
        ),
        ({"grammar": lark_chain(3000)}, "rules nest 3002 deep; the limit is 1000"),
        ({"grammar": gbnf_chain(3000)}, "rules nest 3002 deep; the limit is 1000"),
        # a tool call's schema in a grammar (tool_choice auto)
        ({"grammar": "start: %json " + json.dumps(ref_chain(1200))}, "the limit is 1000"),
        # a chain the checks do not follow: the worker crashes (and is replaced)
        ({"json": anchor_chain(1000)}, "nested or chained too deeply"),
        ({"json": nested_schema(100)}, "nested deeper than 64 levels"),
    ],
)
def test_deep_constraints_are_one_line_errors_and_the_process_lives(llm, constraint, words):
    """(In the engine's process these crash it with SIGSEGV: a $ref chain of 3,000, a Lark or
    GBNF chain of 3,000 rules.)"""
    kind = next(iter(constraint))
    with pytest.raises(ValueError) as e:
        llm.generate(["hi"], _sp(constraint))
    msg = str(e.value)
    assert f"structured_outputs.{kind}" in msg and words in msg and "\n" not in msg
    ok = llm.generate(["hi"], _sp({"regex": "[a-z]{3}"}))[0].outputs[0]
    assert ok.finish_reason in ("stop", "length")


def test_chains_within_the_checks_limits_compile(llm) -> None:
    """The worker's stack holds what the structure checks let through (1 MiB held a Lark chain
    of ~310 rules, a $ref chain of ~290)."""
    for constraint in ({"grammar": lark_chain(900)}, {"json": ref_chain(900)}):
        assert llm.engine.grammar_compiler.compile(constraint).valid_prefix([]) == 0


def test_a_worker_that_dies_or_overruns_is_replaced(llm, monkeypatch) -> None:
    checker = llm.engine.grammar_compiler.checker
    restarts = checker.num_restarts
    with pytest.raises(GrammarError, match="nested or chained too deeply"):
        llm.engine.grammar_compiler.compile({"json": anchor_chain(1000)})
    assert checker.num_restarts == restarts + 1
    monkeypatch.setattr(checker, "deadline_s", 0.05)
    with pytest.raises(GrammarError, match=r"longer than the 0.05 s limit"):
        llm.engine.grammar_compiler.compile({"grammar": gbnf_alternatives(4000)})
    assert checker.num_restarts == restarts + 2
    monkeypatch.undo()
    assert llm.engine.grammar_compiler.compile({"choice": ["yes", "no"]}).valid_prefix([]) == 0


def test_a_regex_past_the_lexer_limits_is_refused(llm) -> None:
    """a{1000000}: its first mask takes ~1 s and shows no error; a token fed to a copy does (the
    lexer's limit): it never reaches the engine, on a machine however fast."""
    with pytest.raises(GrammarError) as e:
        llm.engine.grammar_compiler.compile({"regex": "a{1000000}"})
    assert str(e.value) == "structured_outputs.regex: lexer error: too many expressions constructed"


def test_library_errors_are_one_short_line() -> None:
    long = "Parser Error: bad\n<state>\nsecret grammar text\n</state>"
    assert compile_worker.one_line(long) == "Parser Error: bad"
    assert len(compile_worker.one_line("word " * 1000)) == 200
    # a regex error keeps its reason (under the source it echoes), not the source
    message = (
        'at 1(8): invalid regex "(oops" (in regex): regex parse error:\n    (oops\n    ^\n'
        "error: unclosed group\n   1 | start: /(oops/\n              ^\n"
    )
    assert compile_worker.one_line(message) == (
        'at 1(8): invalid regex "(oops" (in regex): regex parse error:; error: unclosed group'
    )


def test_a_grammar_over_its_budget_fails_its_request_alone(llm, monkeypatch) -> None:
    """The engine time a grammar costs (masks, draft checks) is charged to its request; past the
    budget the request fails with one line naming the field and the limit, the other request in
    the same batch finishes."""
    monkeypatch.setattr(grammar, "MASK_BUDGET_S", 0.0)
    monkeypatch.setattr(grammar, "MASK_BUDGET_PER_TOKEN_S", 0.0)
    costly, free = llm.generate(
        ["hi", "hello"],
        [_sp({"regex": "[a-z]+"}, 16), SamplingParams(max_tokens=16, ignore_eos=True)],
    )
    assert costly.outputs[0].finish_reason == "error"
    assert costly.error.startswith("structured_outputs.regex: the grammar costs more engine time")
    assert free.outputs[0].finish_reason == "length"
    monkeypatch.undo()
    again = llm.generate(["hi"], _sp({"regex": "[a-z]+"}, 16))[0]
    assert again.outputs[0].finish_reason in ("stop", "length")


def test_library_errors_quote_little_of_the_clients_text() -> None:
    """The library quotes the offending source (a whole regex, a schema's value): at most a
    short head of each quoted or unbroken run reaches the client."""
    msg = compile_worker.one_line('at 1(8): invalid regex "(' + "secret" * 50 + '" (in regex)')
    assert msg.startswith('at 1(8): invalid regex "(secret') and msg.endswith("(in regex)")
    assert "secret" * 5 not in msg
    spaced = compile_worker.one_line('unknown name: "' + "my secret " * 20 + '"')
    assert spaced.count("secret") <= 3, spaced
    assert "z" * 30 not in compile_worker.one_line("Invalid type: nonsense" + "z" * 300)
    assert compile_worker.one_line("unknown name: 'short'") == "unknown name: 'short'"


def test_the_budget_charges_cpu_time_not_waiting(llm) -> None:
    """A mask computed while the engine's thread waits for a core (a busy machine) charges
    the request only what it computed: here the matcher sleeps 0.2 s in each mask."""
    g = llm.engine.grammar_compiler.compile({"regex": "[a-z]+"})

    class Sleepy:
        def __init__(self, matcher) -> None:
            self._m = matcher

        def compute_bitmask(self) -> bytes:
            time.sleep(0.2)
            return self._m.compute_bitmask()

        def __getattr__(self, name: str):
            return getattr(self._m, name)

    g._m = Sleepy(g._m)
    g.masks([])
    assert 0 < g.spent_s < 0.1


def test_one_clients_slow_jobs_leave_a_thread_for_the_others() -> None:
    """StackPool's lanes: four blocked jobs of one client hold one of two threads; another
    client's job runs at once, and the blocked client's next job waits its turn."""
    import threading

    pool = compile_worker.StackPool(2, "lanes-test")
    release = threading.Event()
    try:
        slow = [pool.submit(lambda: release.wait(10), lane="a") for _ in range(4)]
        quick = pool.submit(lambda: "b done", lane="b")
        assert quick.result(timeout=5) == "b done"
        assert sum(f.running() for f in slow) == 1 and not any(f.done() for f in slow)
        release.set()
        assert all(f.result(timeout=10) for f in slow)
        # jobs without a lane (offline) take every thread
        both = threading.Barrier(2, timeout=5)
        assert [f.result(timeout=10) for f in [pool.submit(both.wait) for _ in range(2)]]
    finally:
        release.set()
        pool.close()


def test_lane_caps() -> None:
    from specdec.lanes import LaneCaps

    caps = LaneCaps(3)
    for _ in range(2):
        assert caps.may_start("a")
        caps.started("a")
    assert not caps.may_start("a") and caps.may_start("b")  # a slot left for another client
    for _ in range(3):
        assert caps.may_start(None)
        caps.started(None)
    assert not caps.may_start(None)
    caps.finished("a")
    assert caps.may_start("a")
    assert LaneCaps(1).may_start("a")  # one slot: a client may still use it
