"""Structured output (JSON schema, regex, choice, grammar) with and without speculation, on the
tiny random model: whatever the drafter, the output equals plain constrained decoding token for
token (greedy and seeded sampling), every verified draft is one the grammar allows, and the
output always matches the constraint (a complete match when it stops, a valid prefix at
max_tokens).

A random model wanders through a grammar's every corner (strings full of odd bytes, numbers,
nesting), which is what these tests want; an oracle drafter proposes the plain reference
continuation with some tokens corrupted, so that long accepted runs, rejections, cuts and
grammar-forced drafts after accepted drafts all happen.
"""

from __future__ import annotations

import json
import re

import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.sample import rejection_sampler
from specdec.spec_decode import METHODS, DraftOutput
from specdec.structured import GrammarError, StructuredOutputsParams
from tests.fixtures.heads import drafter_case
from tests.fixtures.prompts import INSTRUCTOR_RETRY, SCHEMA

CONSTRAINTS = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "regex": {"regex": r"(yes|no|maybe): [a-z]{1,8}( [0-9]+)?\."},
    "choice": {"choice": ["the cat", "the dog", "a bird in the hand"]},
    "grammar": {
        "grammar": 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\n'
        "NUMBER: /[0-9]{1,3}/\n"
    },
}
PROMPTS = ["the cat sat on the mat", "In the beginning", "a b c a b c", "hello"]


def _llm(target: str, spec: dict | None) -> LLM:
    return LLM(
        target, speculative_config=spec, max_model_len=256, max_num_seqs=3,
        max_num_batched_tokens=24,
    )  # fmt: skip


def _params(constraint: dict, temperature: float = 0.0, n: int = 40) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=temperature,
            seed=100 + i,
            max_tokens=n + 7 * i,
            structured_outputs=dict(constraint),
        )  # fmt: skip
        for i in range(len(PROMPTS))
    ]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _check_matches(llm: LLM, constraint: dict, outs) -> None:
    """Every output is in the constraint's language: complete when it stopped, a prefix when
    max_tokens cut it (checked with the grammar itself, and with json / re where complete)."""
    compiler = llm.engine.grammar_compiler
    for out in outs:
        o = out.outputs[0]
        grammar = compiler.compile(dict(constraint))
        assert all(grammar.accept(t) for t in o.token_ids), o.text
        assert o.finish_reason in ("stop", "length"), o.finish_reason
        if o.finish_reason == "stop":
            assert grammar.is_finished
            if "json" in constraint:
                value = json.loads(o.text)
                assert set(value) >= {"name", "kind", "age", "home"} and value["kind"] in (
                    "cat", "dog", "bird",
                )  # fmt: skip
            elif "regex" in constraint:
                assert re.fullmatch(constraint["regex"], o.text), o.text
            elif "choice" in constraint:
                assert o.text in constraint["choice"]


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    return _llm(str(tiny_llama), None)


@pytest.fixture(scope="module")
def refs(plain) -> dict[tuple[str, float], list[list[int]]]:
    out = {}
    for name, c in CONSTRAINTS.items():
        for temp in (0.0, 0.8):
            outs = plain.generate(PROMPTS, _params(c, temp))
            _check_matches(plain, c, outs)
            out[name, temp] = _ids(outs)
    return out


def test_plain_constrained_output_matches_and_finishes(plain, refs) -> None:
    """Without speculation: the outputs match; short constraints end with "stop" before
    max_tokens (the grammar finished), and unconstrained output would differ."""
    outs = plain.generate(PROMPTS, _params(CONSTRAINTS["choice"]))
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    free = plain.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=40)] * len(PROMPTS))
    assert _ids(free) != refs["json", 0.0]


class CorruptOracle:
    """Drafts the plain reference continuation, every fourth token replaced by a token the
    grammar forbids (a byte no JSON / regex here allows at most positions) or a wrong one."""

    def __init__(self, llm: LLM, ref: list[list[int]], monkeypatch) -> None:
        tok = llm.get_tokenizer()
        self.ref = {tuple(tok.encode(p)): r for p, r in zip(PROMPTS, ref)}
        self.bad = tok.encode("\x07", add_special_tokens=False)[0]
        self.verified: list[tuple[list[int], object]] = []
        proposer = llm.engine.speculator.proposer
        monkeypatch.setattr(proposer, "propose", self.propose)
        real_verify = rejection_sampler.verify

        def verify(logits, drafts, q, sp, penalty, seed, pos, adjust=None, mask=None):
            self.verified.append((list(drafts), mask))
            return real_verify(logits, drafts, q, sp, penalty, seed, pos, adjust, mask)

        monkeypatch.setattr("specdec.worker.model_runner.verify", verify)

    def propose(self, inp) -> DraftOutput:
        out = []
        for r in inp.requests:
            prompt = tuple(r.token_ids[: r.num_prompt_tokens])
            ref = self.ref.get(prompt, [])
            done = len(r.token_ids) - r.num_prompt_tokens
            drafts = list(ref[done : done + r.max_num_drafts])
            for i in range(len(drafts)):
                if (done + i) % 4 == 3:
                    drafts[i] = self.bad if (done + i) % 8 == 3 else (drafts[i] + 1) % 256
            out.append(drafts)
        return DraftOutput(out)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_oracle_drafts_cut_verified_and_exact(
    name, temperature, tiny_llama, refs, monkeypatch
) -> None:
    """Accepted runs, rejections and grammar cuts: output identical to plain constrained
    decoding; no verified draft is one the grammar forbids at its row; grammar-forced drafts
    are counted."""
    llm = _llm(str(tiny_llama), {"method": "ngram", "num_speculative_tokens": 6, "adaptive": False})
    ref = refs[name, temperature]
    oracle = CorruptOracle(llm, ref, monkeypatch)
    outs = llm.generate(PROMPTS, _params(CONSTRAINTS[name], temperature))
    assert _ids(outs) == ref
    _check_matches(llm, CONSTRAINTS[name], outs)
    assert any(drafts for drafts, _ in oracle.verified)
    for drafts, mask in oracle.verified:
        assert mask is not None
        assert all(mask.allows(r, t) for r, t in enumerate(drafts)), drafts
    assert all(oracle.bad not in drafts for drafts, _ in oracle.verified)
    st = llm.engine.spec_stats
    assert st.num_accepted_tokens > st.num_draft_tokens // 4
    if name in ("json", "choice"):  # fixed keys / strings: the grammar forces bytes
        assert st.num_grammar_draft_tokens > 0
        assert st.num_grammar_accepted_tokens > 0


class RandomDrafter:
    """Drafts drawn by hypothesis: the plain reference continuation for a while (right), then
    maybe wrong tokens (any token, an end token, a byte the grammar forbids), any length up to
    the cap, or none."""

    def __init__(self, llm: LLM, ref: list[list[int]], data, monkeypatch) -> None:
        tok = llm.get_tokenizer()
        self.ref = {tuple(tok.encode(p)): r for p, r in zip(PROMPTS, ref)}
        self.wrong = st.sampled_from(sorted(llm.engine.tokenizer.eog_token_ids)) | st.integers(
            0, llm.engine.model.cfg.vocab_size - 1
        )
        self.data = data
        monkeypatch.setattr(llm.engine.speculator.proposer, "propose", self.propose)

    def propose(self, inp) -> DraftOutput:
        out = []
        for r in inp.requests:
            ref = self.ref.get(tuple(r.token_ids[: r.num_prompt_tokens]), [])
            done = len(r.token_ids) - r.num_prompt_tokens
            n = self.data.draw(st.integers(0, r.max_num_drafts))
            drafts = list(ref[done : done + n])
            if self.data.draw(st.booleans()):
                at = self.data.draw(st.integers(0, len(drafts)))
                drafts[at:] = self.data.draw(st.lists(self.wrong, max_size=n - at))
            out.append(drafts[:n])
        return DraftOutput(out)


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    data=st.data(),
    name=st.sampled_from(list(CONSTRAINTS)),
    temperature=st.sampled_from([0.0, 0.8]),
    k=st.integers(1, 8),
)
def test_random_drafts_under_random_constraints_equal_plain(
    tiny_llama, refs, monkeypatch, data, name, temperature, k
) -> None:
    """Whatever the drafts (right, wrong, end tokens, cut, any length), constrained output is
    plain constrained decoding's, token for token, and never fails."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
    llm = _llm(str(tiny_llama), spec)
    with monkeypatch.context() as m:
        RandomDrafter(llm, refs[name, temperature], data, m)
        outs = llm.generate(PROMPTS, _params(CONSTRAINTS[name], temperature))
    assert [o.outputs[0].finish_reason for o in outs] != ["error"] * len(outs)
    assert _ids(outs) == refs[name, temperature]


def test_json_mode_retry_conversation_under_ngram_equals_plain() -> None:
    """Regression: instructor's JSON-mode retry on the real model, n-gram drafts of every
    length. An n-gram draft ending in the end token used to break the grammar's state (a
    rollback over the end token), failing the request at k = 3, 5 or 8."""
    sp = SamplingParams(temperature=0, max_tokens=96, structured_outputs={"json_object": True})
    ref = LLM("smollm2-135m", max_model_len=512).chat([INSTRUCTOR_RETRY], sp)[0].outputs[0]
    assert ref.finish_reason == "stop"
    for k in range(2, 9):
        spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
        llm = LLM("smollm2-135m", max_model_len=512, speculative_config=spec)
        out = llm.chat([INSTRUCTOR_RETRY], sp)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == (ref.token_ids, "stop"), k


@pytest.mark.parametrize("method", list(METHODS))
def test_every_drafter_exact_under_a_schema(method, heads, tiny_llama, tiny_draft, refs) -> None:  # noqa: F811
    """Each drafter of the method table, greedy and seeded, under the JSON schema."""
    target, spec = drafter_case(method, heads, tiny_llama, tiny_draft)
    # (the MTP target is the tiny model plus its MTP layer: the same plain output)
    ref = {t: refs["json", t] for t in (0.0, 0.8)}
    llm = _llm(target, spec | {"adaptive": False})
    for temp in (0.0, 0.8):
        outs = llm.generate(PROMPTS, _params(CONSTRAINTS["json"], temp))
        assert _ids(outs) == ref[temp], (method, temp)
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_draft_distributions_with_forced_drafts_stay_exact(tiny_llama, tiny_draft, refs) -> None:
    """A drafter that samples its drafts (q): grammar-forced drafts after them verify as
    one-hot q; seeded output is still plain's."""
    spec = {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 4,
            "adaptive": False}  # fmt: skip
    llm = _llm(str(tiny_llama), spec)
    outs = llm.generate(PROMPTS, _params(CONSTRAINTS["choice"], 0.8))
    assert _ids(outs) == refs["choice", 0.8]
    assert llm.engine.spec_stats.num_grammar_draft_tokens > 0


def test_max_tokens_leaves_a_valid_prefix(plain) -> None:
    outs = plain.generate(["hello"], SamplingParams(temperature=0, max_tokens=5,
                                                    structured_outputs={"json": SCHEMA}))  # fmt: skip
    o = outs[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 5
    assert o.text.startswith("{")
    _check_matches(plain, {"json": SCHEMA}, outs)


def test_json_object_and_guided_decoding_alias(plain) -> None:
    sp = SamplingParams(temperature=0, max_tokens=60, guided_decoding={"json_object": True})
    assert sp.structured_outputs == StructuredOutputsParams(json_object=True)
    o = plain.generate(["hello"], sp)[0].outputs[0]
    assert o.text.lstrip().startswith("{")
    if o.finish_reason == "stop":
        assert isinstance(json.loads(o.text), dict)


def test_gbnf_grammar_is_accepted(plain) -> None:
    gbnf = 'root ::= "ab" [0-9] ("x" | "yz")'
    sp = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"grammar": gbnf})
    o = plain.generate(["hello"], sp)[0].outputs[0]
    assert o.finish_reason == "stop" and re.fullmatch(r"ab[0-9](x|yz)", o.text), o.text


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json", ""),
        ({"json": "{not json"}, "json", "not valid JSON"),
        ({"regex": "(unclosed"}, "regex", ""),
        ({"grammar": "start: foo\n"}, "grammar", ""),
        ({"choice": []}, "choice", "non-empty"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs", "exactly one"),
        ({"jsn": {}}, "structured_outputs", "unknown field"),
    ],
)
def test_bad_constraints_name_the_field(plain, constraint, field, words) -> None:
    with pytest.raises(ValueError, match=re.escape(field)) as e:
        plain.generate(["hello"], SamplingParams(structured_outputs=constraint))
    assert words in str(e.value)
    assert isinstance(e.value, (GrammarError, ValueError))
    # the engine goes on
    assert plain.generate(["hello"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_library_matches_our_mask(plain) -> None:
    """The verification rows' masks are llguidance's own masks after the same tokens."""
    compiler = plain.engine.grammar_compiler
    g = compiler.compile({"regex": r"ab+c"})
    tok = plain.get_tokenizer()
    drafts = tok.encode("abb", add_special_tokens=False)
    mask = g.masks(drafts)
    m = llguidance.LLMatcher(
        compiler.llg_tokenizer, llguidance.LLMatcher.grammar_from_regex("ab+c")
    )
    for r in range(len(drafts) + 1):
        assert mask.rows[r] == m.compute_bitmask()
        if r < len(drafts):
            m.consume_token(drafts[r])
    allowed = [t for t in range(tok.vocab_size) if mask.allows(len(drafts), t)]
    assert tok.encode("b", add_special_tokens=False)[0] in allowed
    assert tok.encode("c", add_special_tokens=False)[0] in allowed
    assert tok.encode("a", add_special_tokens=False)[0] not in allowed


def test_generate_cli_takes_llama_cpp_grammar_flags(tiny_llama, tmp_path, capsys) -> None:
    from specdec import cli

    base = ["generate", "--model", str(tiny_llama), "--prompt", "hi", "-n", "12"]
    assert cli.main([*base, "--grammar", 'root ::= "ok" [0-9]']) == 0
    assert re.search(r"^ok[0-9]$", capsys.readouterr().out, re.M)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"enum": ["alpha", "beta"]}))
    assert cli.main([*base, "--json-schema-file", str(schema), "--compare-plain",
                     "--speculative-config", '{"method": "ngram"}']) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(r'^"(alpha|beta)"$', out, re.M) and "output identical to plain: yes" in out
    assert cli.main([*base, "--regex", "(", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: structured_outputs.regex:") and err.count("\n") == 1
    assert cli.main([*base, "-j", "{}", "--regex", "a"]) == 2


def test_a_refused_token_fails_its_request_with_one_short_line(plain, monkeypatch) -> None:
    """Should a committed token ever be outside the grammar (a bug), the request fails alone
    with one line that holds none of the library's dump (parser state, the grammar)."""
    from specdec.structured.grammar import Grammar

    dump = "Parser Error: nope\n<state>\nTokens: secret grammar text\n</state>"
    monkeypatch.setattr(Grammar, "accept", lambda self, tok: False)
    monkeypatch.setattr(Grammar, "error", property(lambda self: dump))
    sp = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[a-z]+"})
    out = plain.generate(["hello"], sp)[0]
    assert out.outputs[0].finish_reason == "error"
    assert "\n" not in out.error and "secret" not in out.error and "state" not in out.error
    monkeypatch.undo()
    assert plain.generate(["hello"], sp)[0].outputs[0].finish_reason in ("stop", "length")
