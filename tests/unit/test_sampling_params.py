"""SamplingParams refuses a value of the wrong type in any field with a one-line ValueError that
names the field (never a TypeError, never the value's text), offline and on the server alike."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specdec.entrypoints.openai.protocol import ChatCompletionRequest, RequestError
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams, token_id_key
from specdec.structured.params import StructuredOutputsParams


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str_list(v: object) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)


_INTS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTS = ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs",
                  "num_speculative_tokens", "speculative_n_min")  # fmt: skip
_REALS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty")  # fmt: skip
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def _right_type(name: str, v: Any) -> bool:
    """Whether ``v`` is of a type the field takes (its value may still be out of range)."""
    if name in _INTS:
        return _is_int(v)
    if name in _OPTIONAL_INTS:
        return v is None or _is_int(v)
    if name in _REALS:
        return _is_number(v)
    if name == "speculative_p_min":
        return v is None or _is_number(v)
    if name in _BOOLS:
        return isinstance(v, bool)
    if name == "stop":
        return v is None or isinstance(v, str) or _str_list(v)
    if name == "stop_token_ids":
        return v is None or (isinstance(v, (list, tuple)) and all(_is_int(t) for t in v))
    if name == "bad_words":
        return v is None or (isinstance(v, list) and all(isinstance(s, str) for s in v))
    if name == "logit_bias":
        return v is None or isinstance(v, dict)
    if name in ("structured_outputs", "guided_decoding"):
        return v is None or isinstance(v, (dict, StructuredOutputsParams))
    raise AssertionError(name)


FIELDS = [f.name for f in fields(SamplingParams) if f.name != "compiled_bad_words"]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**300 + 5),  # not a float (_WRONG: 5,000 digits)
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.text(alphabet="0123456789²٣\n", max_size=12),
    st.binary(max_size=4),
    st.builds(object),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(
            st.one_of(st.text(max_size=12), st.integers(), st.floats()), inner, max_size=3
        ),
        st.sets(st.integers(), max_size=3),
    ),
    max_leaves=6,
)


def _check_message(message: str, name: str) -> None:
    assert "\n" not in message and len(message) < 300, message
    names = {name, "structured_outputs"} if name == "guided_decoding" else {name}
    head = message.split(" ", 1)[0].rstrip(":,").split("[", 1)[0]
    assert head in names, (name, message)


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(FIELDS), value=_values)
@example(name="top_k", value=False)  # found by hypothesis: False == 0 became top_k = -1 (off)
def test_every_field_refuses_a_wrong_type_with_one_line_naming_it(name: str, value: Any) -> None:
    try:
        SamplingParams(**{name: value})
    except ValueError as e:
        _check_message(str(e), name)
        return
    # NOTE: whatever is accepted was of a type the field takes
    assert _right_type(name, value), (name, value)


_WRONG = [
    ("stop", 5), ("stop", [1]), ("stop", {"a": 1}), ("stop_token_ids", 5),
    ("stop_token_ids", "12"), ("stop_token_ids", [1.5]), ("bad_words", "word"),
    ("logit_bias", [1, 2]), ("logit_bias", {"a": 1}), ("seed", "1"), ("n", 2.0),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1), ("temperature", "0.5"),
    ("seed", 10**5000), ("top_p", 10**5000), ("structured_outputs", 5),
    ("structured_outputs", {1: 2}), ("structured_outputs", {"json": 10**5000}),
    ("guided_decoding", [1]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value"), _WRONG, ids=[f"{n}-{i}" for i, (n, _) in enumerate(_WRONG)]
)
def test_wrong_types_are_value_errors(name: str, value: Any) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    _check_message(str(e.value), name)


def test_validate_catches_fields_changed_after_construction(tiny_llama) -> None:
    """LLM.generate calls validate() again: a field set later is checked as in the constructor,
    and nothing of the call is queued."""
    sp = SamplingParams(max_tokens=2)
    sp.stop = 5  # type: ignore[assignment]
    with pytest.raises(ValueError, match="^stop must be"):
        sp.validate()
    llm = LLM(str(tiny_llama), max_model_len=64)
    for name, value in (("stop", 5), ("stop_token_ids", 7), ("logit_bias", {"٣": 1.0})):
        sp = SamplingParams(max_tokens=2)
        setattr(sp, name, value)
        with pytest.raises(ValueError, match=rf"^sampling_params\[1\]: {name} ") as e:
            llm.generate(["hi", "there"], [SamplingParams(max_tokens=2), sp])
        assert "\n" not in str(e.value)
        assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("key", "token"),
    [
        ("0", 0), ("42", 42), ("007", 7), ("2147483647", 2**31 - 1), (5, 5), (5.0, 5),
        ("2147483648", None), ("12345678901", None), ("9" * 5000, None), ("²", None),
        ("٣", None), ("3٣", None), (" 3", None), ("+3", None), ("-1", None), ("3.0", None),
        ("", None), (-1, None), (True, None), (2.5, None), (float("inf"), None), (None, None),
    ],
)  # fmt: skip
def test_token_id_key(key: object, token: int | None) -> None:
    assert token_id_key(key) == token


def test_logit_bias_keys_become_token_ids() -> None:
    sp = SamplingParams(logit_bias={"3": 1, 4.0: -2.5, 5: 100})
    assert sp.logit_bias == {3: 1.0, 4: -2.5, 5: 100.0}


@pytest.mark.parametrize(
    "bias",
    [{"²": 1}, {"٣": 1}, {"9" * 5000: 1}, {"x\ny": 1}, {"3": 101}, {"3": float("nan")},
     {"3": "1"}, {"3": True}, {"3": [1]}],
)  # fmt: skip
def test_logit_bias_refusals_are_400s_on_the_field_without_the_key(bias: dict) -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": bias}
    )
    with pytest.raises(RequestError) as e:
        req.to_sampling_params(8)
    err = e.value
    assert (err.status, err.param) == (400, "logit_bias"), err.message
    assert "\n" not in err.message and len(err.message) < 200
    key = next(iter(bias))
    assert key not in err.message.replace("logit_bias", "")
