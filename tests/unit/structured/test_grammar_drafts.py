"""Exploring drafts never changes a grammar's committed state.

Each step the speculator and the scheduler ask a request's grammar about its drafts (how many it
allows, the tokens it forces after them, one mask per verification row), then the verified
tokens are committed. Whatever drafts were asked about (right, wrong, cut, an end token in the
middle, of any length), the committed state must equal that of a grammar that only ever saw the
committed tokens: the same mask at every step, the same verdicts, the same end. Hypothesis draws
the constraint, the committed path (a random walk through each mask) and the drafts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import LLM
from specdec.structured.grammar import Grammar, GrammarCompiler

CONSTRAINTS = [
    {"json_object": True},
    {
        "json": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "n": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
            },
            "required": ["name", "n"],
        }
    },
    {"regex": r"(yes|no): [a-c]{1,5}( [0-9]+)*\.?"},
    {"choice": ["the cat", "the dog", "then"]},
    {"grammar": 'start: expr\nexpr: term (("+" | "-") term)*\nterm: /[0-9]{1,2}/ | "(" expr ")"\n'},
    {"grammar": 'root ::= item ("," item)*\nitem ::= [a-c]+ | "[" root "]"\n'},
]


@pytest.fixture(scope="module")
def compiler(tiny_llama) -> GrammarCompiler:
    return LLM(str(tiny_llama), max_model_len=64).engine.grammar_compiler


def _allowed(grammar: Grammar) -> np.ndarray:
    """The token ids the committed state allows next."""
    row = grammar.masks([]).rows[0]
    bits = np.unpackbits(np.frombuffer(row, dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits[: grammar.vocab_size])


def _walk(compiler: GrammarCompiler, constraint: dict, data, eos: set[int]) -> list[int]:
    """A random committed path: each token drawn from what the grammar allows, an end token
    when drawn (it finishes the path), at most 24 tokens."""
    walker = compiler.compile(dict(constraint))
    path: list[int] = []
    while len(path) < 24 and not walker.is_finished:
        allowed = _allowed(walker)
        if not len(allowed):
            break
        ends = [int(t) for t in allowed if int(t) in eos]
        if ends and data.draw(st.integers(0, 3)) == 0:
            path.append(ends[0])
            break
        tok = int(allowed[data.draw(st.integers(0, len(allowed) - 1))])
        path.append(tok)
        assert walker.accept(tok)
    return path


def _drafts(data, path: list[int], done: int, vocab: int, eos: list[int]) -> list[int]:
    """The right continuation for a while, then maybe a wrong token (any, or an end token),
    then anything; any length from 0 to 10."""
    length = data.draw(st.integers(0, 10))
    drafts = list(path[done : done + length])
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(drafts)))
        wrong = st.sampled_from(eos) | st.integers(0, vocab - 1)
        drafts[at:] = data.draw(st.lists(wrong, min_size=1, max_size=length + 1))
    return drafts


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), which=st.integers(0, len(CONSTRAINTS) - 1))
def test_draft_exploration_leaves_the_committed_state_alone(compiler, data, which) -> None:
    constraint = CONSTRAINTS[which]
    eos = sorted(compiler._eos)
    path = _walk(compiler, constraint, data, set(eos))
    grammar = compiler.compile(dict(constraint))
    ref = compiler.compile(dict(constraint))  # sees the committed tokens only
    for done, tok in enumerate(path):
        drafts = _drafts(data, path, done, compiler.vocab_size, eos)
        # NOTE: the engine's order: the speculator cuts and extends, the scheduler masks
        n = grammar.valid_prefix(drafts)
        forced = grammar.forced_after(drafts[:n], data.draw(st.integers(0, 4)))
        verified = drafts[:n] + forced
        mask = grammar.masks(verified)
        assert len(mask.rows) == 1 + len(verified)  # every draft kept is one the grammar allows
        for r, t in enumerate(verified):
            assert mask.allows(r, t)
        assert np.array_equal(_allowed(grammar), _allowed(ref)), (constraint, path, done)
        assert grammar.accept(tok), (constraint, path, done, drafts, grammar.error[:200])
        assert ref.accept(tok)
        assert grammar.is_finished == ref.is_finished


def test_an_end_token_draft_then_the_same_output(compiler) -> None:
    """The smallest case of the llguidance rollback fault: a complete JSON object, an end-token
    draft verified (its mask computed) and rejected; the committed output then goes on."""
    eos = sorted(compiler._eos)[0]
    grammar = compiler.compile({"grammar": 'start: "a"+'})
    assert grammar.accept(compiler.llg_tokenizer.tokenize_str("a")[0])
    mask = grammar.masks([eos])
    assert len(mask.rows) == 2 and mask.allows(0, eos)
    a = compiler.llg_tokenizer.tokenize_str("a")[0]
    assert grammar.accept(a) and grammar.accept(eos)
    assert grammar.is_finished
