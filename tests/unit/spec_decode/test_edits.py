"""Edit rules (spec_decode/edits.py): replacements learnt from a response against its prompt, and
suffix decoding's drafts with them."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams
from specdec.spec_decode.base import DraftInput, DraftRequest, accepted_prefix
from specdec.spec_decode.edits import GUESS_CONFIDENCE, EditRules
from specdec.spec_decode.suffix import SuffixProposer

OLD, NEW = 7, 8  # the token the response renames, and its new name
A, B, C = 900, 901, 902  # a two-token name (A B) that becomes three (C C C)


def _code(seed: int, n: int, names: list[list[int]]) -> list[int]:
    """Random tokens (100-599) with the names spliced in every ~20 tokens."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out += [rng.randrange(100, 600) for _ in range(rng.randrange(12, 28))]
        out += rng.choice(names)
    return out


def _replace(seq: list[int], old: list[int], new: list[int]) -> list[int]:
    out, i = [], 0
    while i < len(seq):
        if seq[i : i + len(old)] == old:
            out += new
            i += len(old)
        else:
            out.append(seq[i])
            i += 1
    return out


def test_a_rename_is_learnt_at_its_first_occurrence_and_drafted_at_the_next() -> None:
    prompt = _code(1, 200, [[OLD]])
    response = _replace(prompt, [OLD], [NEW])
    first = prompt.index(OLD)
    rules = EditRules(prompt)
    rules.update(response[: first + 4])  # past the change and three tokens back on the prompt
    assert [(o, n) for o, n, _, _ in rules.rules()] == [((OLD,), (NEW,))]
    second = prompt.index(OLD, first + 1)
    draft = prompt[first + 4 : second + 3]  # what a copying drafter proposes
    assert rules.rewrite(draft, 99)[0] == response[first + 4 : second + 3]
    assert rules.rewrite(draft, 5)[0] == response[first + 4 : first + 9]  # cut to the limit


def test_a_longer_replacement_is_one_rule_applied_before_its_parts() -> None:
    prompt = _code(2, 300, [[A, B], [OLD]])
    response = _replace(_replace(prompt, [A, B], [C, C, C]), [OLD], [NEW])
    rules = EditRules(prompt)
    rules.update(response)
    learnt = {(o, n) for o, n, seen, passed in rules.rules() if seen > passed}
    assert ((A, B), (C, C, C)) in learnt and ((OLD,), (NEW,)) in learnt
    draft = [5, A, B, 6, OLD, 9]
    tokens, src = rules.rewrite(draft, 99)
    assert tokens == [5, C, C, C, 6, NEW, 9]
    assert src == [0, 1, 1, 1, 3, 4, 5]  # each new token stands for the draft token it replaced


def test_a_change_made_once_is_not_forced_on_the_rest() -> None:
    prompt = _code(3, 300, [[OLD]])
    first = prompt.index(OLD)
    response = prompt[:first] + [NEW] + prompt[first + 1 :]  # only the first occurrence changes
    rules = EditRules(prompt)
    rules.update(response[: first + 4])
    assert rules.rewrite([OLD], 9)[0] == [NEW]
    rules.update(response)  # then copies the later ones unchanged: passed over
    assert rules.rewrite([OLD], 9)[0] == [OLD]


def test_partway_through_a_rule_the_draft_finishes_it_and_copies_on() -> None:
    prompt = _code(4, 300, [[A, B]])
    response = _replace(prompt, [A, B], [C, C, C])
    first = prompt.index(A)
    second = prompt.index(A, first + 1)
    at = response.index(C, response.index(C) + 3)
    rules = EditRules(prompt)
    rules.update(response[: at + 1])  # the first C of the second occurrence written
    assert rules.pending(6) == ([C, C] + prompt[second + 2 : second + 6], 0.5)  # seen once
    rules.update(response[: at + 3])  # all three written: the copy goes on after the old name
    assert rules.pending(4) == (prompt[second + 2 : second + 6], 0.5)


def test_a_guess_only_where_the_response_copies_its_prompt() -> None:
    prompt = _code(5, 200, [[OLD]])
    first = prompt.index(OLD)
    rules = EditRules(prompt)
    rules.update(prompt[:first] + [NEW])  # a change never seen before
    assert rules.pending(4) is None  # no rule: nothing without a guess
    assert rules.pending(4, guess=True) == (prompt[first + 1 : first + 5], GUESS_CONFIDENCE)
    chat = EditRules(prompt)
    chat.update([1, 2, 3, 4, 5, 6] + prompt[10:13] + [NEW])  # three prompt tokens in a chat
    assert chat.pending(4, guess=True) is None


def test_a_response_that_is_not_an_extension_starts_over() -> None:
    prompt = _code(6, 200, [[OLD]])
    response = _replace(prompt, [OLD], [NEW])
    rules = EditRules(prompt)
    rules.update(response[:150])
    assert rules.num_rules == 1
    rules.update([999] + response[1:10])  # before the first name
    assert rules.num_rules == 0 and rules.output == [999] + response[1:10]


def _steps(prompt: list[int], response: list[int], edit_rules: bool) -> int:
    proposer = SuffixProposer(8, edit_rules=edit_rules)
    i = steps = 0
    while i < len(response):
        req = DraftRequest(
            "r",
            prompt + response[:i],
            8,
            SamplingParams(temperature=0),
            num_prompt_tokens=len(prompt),
        )
        draft = proposer.propose(DraftInput([req])).draft_token_ids[0]
        i += accepted_prefix(draft, response[i:]) + 1
        steps += 1
    return steps


def test_suffix_decoding_writes_a_renaming_response_in_fewer_steps() -> None:
    prompt = _code(7, 600, [[OLD], [A, B]])
    response = _replace(_replace(prompt, [OLD], [NEW]), [A, B], [C, C, C])
    without, with_rules = _steps(prompt, response, False), _steps(prompt, response, True)
    assert with_rules < 0.85 * without, (with_rules, without)
    copy = _steps(prompt, prompt, True)  # nothing to learn: the same as without rules
    assert copy == _steps(prompt, prompt, False)


def test_the_config_key_turns_the_rules_off_and_is_checked() -> None:
    from specdec.config import ConfigError, SpeculativeConfig
    from specdec.spec_decode import make_proposer

    on = make_proposer(SpeculativeConfig.from_dict({"method": "suffix"}), None, None, 4, 256)
    off_cfg = SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_edit_rules": False})
    off = make_proposer(off_cfg, None, None, 4, 256)
    assert on.edit_rules is True and off.edit_rules is False
    with pytest.raises(ConfigError, match="suffix_decoding_edit_rules"):
        SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_edit_rules": "yes"})


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 6), max_size=40),
    output=st.lists(st.integers(0, 6), max_size=60),
    draft=st.lists(st.integers(0, 6), max_size=12),
    limit=st.integers(0, 10),
)
def test_any_sequences_give_drafts_within_the_limit(prompt, output, draft, limit) -> None:
    """Small alphabets make every path happen: leaving and rejoining, rules learnt and passed
    over, restarts. Nothing raises, and no draft is longer than asked."""
    rules = EditRules(prompt)
    for n in range(0, len(output) + 1, 7):
        rules.update(output[:n])
    rules.update(output)
    tokens, src = rules.rewrite(draft, limit)
    assert len(tokens) == len(src) <= limit and all(0 <= k < len(draft) for k in src)
    for guess in (False, True):
        got = rules.pending(limit, guess)
        assert got is None or (len(got[0]) <= limit and 0.0 < got[1] <= 1.0)
    rules.update(output[: len(output) // 2])  # shorter: starts over
    assert rules.output == output[: len(output) // 2]
    rules.update(prompt + output, len(prompt))  # the same response after an offset
    assert rules.output == output
