"""SamplingParams, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from specdec.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# Bounds every request is checked against (the server's protocol reads them too).
TEMPERATURE_MAX = 100.0
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI's
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SEED_RANGE = (-(2**63), 2**64)  # [low, high)
INT_MAX = 2**31 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 4096
MAX_N = 128  # n and best_of
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
MAX_LOGIT_BIAS = 4096
MAX_BAD_WORDS = 256
# NOTE: 256 words of 1,024 characters tokenize in ~0.25 s (of 4,096: 0.8 s); a word's tokens:
# sample.bad_words.MAX_BAD_WORD_TOKENS
MAX_BAD_WORD_CHARS = 1024
MAX_TOKEN_ID_DIGITS = 10  # INT_MAX has 10


def _shown(value: object) -> str:
    """A value for a one-line error message: numbers as written (long integers by size), other
    values by their type, never their text."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        # NOTE: repr() of an integer of more than 4,300 digits raises ValueError
        bits = value.bit_length()
        return repr(value) if bits <= 64 else f"an integer of {bits} bits"
    if isinstance(value, float):
        return repr(value)
    return f"a value of type {type(value).__name__}"


def _check_real(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (isinstance(value, int) or math.isfinite(value))  # NOTE: a huge int cannot be a float
        and (low < value if low_open else low <= value)
        and value <= high
    )
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(
            f"{name} must be a finite number in {bracket}{low:g}, {high:g}], got {_shown(value)}"
        )


def _check_int(name: str, value: object, low: int, high: int, message: str | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        raise ValueError(
            f"{message or f'{name} must be an integer in [{low}, {high}]'}, got {_shown(value)}"
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {_shown(value)}")


def token_id_key(key: object) -> int | None:
    """A ``logit_bias`` key as a token id, or None: an int, an integer-valued float, or a string
    of at most ``MAX_TOKEN_ID_DIGITS`` ASCII digits (OpenAI's JSON keys), within [0, INT_MAX].

    NOTE: not ``int(key)``: it reads "٣" as 3, refuses "²" with its own message, and takes
    seconds over 100k digits."""
    if isinstance(key, str):
        if not (0 < len(key) <= MAX_TOKEN_ID_DIGITS and key.isascii() and key.isdigit()):
            return None
        key = int(key)
    elif isinstance(key, float) and math.isfinite(key) and key.is_integer():
        key = int(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key <= INT_MAX:
        return key
    return None


def _string_list(name: str, value: object) -> list[str]:
    """``value`` (None, a string, or a list / tuple of strings) as a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got {_shown(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise ValueError(f"{name}[{i}] must be a string, got {_shown(s)}")
    return list(value)


@dataclass
class SamplingParams:
    """How to pick each token. ``temperature == 0`` is greedy; ``top_k`` -1 (or 0) is off.

    ``n`` samples per prompt (``best_of``: generate that many, return the ``n`` with the highest
    cumulative log-probability); sample i is seeded ``seed + i`` (as vLLM) when ``seed`` is set.
    ``logprobs=N``: per output position the chosen token's and the top-N tokens' log-probabilities
    (vLLM's ``Logprob`` dicts); ``prompt_logprobs=N`` the same for each prompt token.
    ``logit_bias`` (token id -> bias in [-100, 100]) and ``bad_words`` (strings never generated)
    change the distribution every draw samples from, with or without speculation."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Per-request speculation (None: the engine's). At most this many drafts per step, 0 = no
    # speculation for this request; the adaptive controller chooses within it.
    num_speculative_tokens: int | None = None
    # llama.cpp's speculative.n_min / p_min (None: the engine's --draft-min / --draft-p-min):
    # fewer drafts than n_min are not verified; drafting stops where the draft distribution's top
    # probability falls below p_min (drafters that report it). Output is unchanged either way.
    speculative_n_min: int | None = None
    speculative_p_min: float | None = None
    # The output must match a JSON schema, regex, choice list or grammar (vLLM's
    # StructuredOutputsParams, or a dict of its fields); ``guided_decoding`` is vLLM's older name.
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    guided_decoding: StructuredOutputsParams | dict[str, Any] | None = None
    # bad_words tokenized and indexed ahead (a sample.bad_words.BadWords, LLMEngine.bad_words),
    # when the caller did it off the engine's thread (the server does); used while its words
    # are still bad_words
    compiled_bad_words: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        # NOTE: not False (== 0 in Python): validate() refuses a bool as top_k
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (its message starts with the name and
        fits on one line), whatever the fields' types; normalizes ``stop`` to a list of strings,
        ``stop_token_ids`` to a list and ``logit_bias`` keys to token ids."""
        self.stop = [s for s in _string_list("stop", self.stop) if s]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {_shown(self.stop_token_ids)}"
            )
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        _check_int("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1, MAX_N)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        _check_real("temperature", self.temperature, 0.0, TEMPERATURE_MAX)
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k != -1:
            _check_int("top_k", self.top_k, 1, INT_MAX, "top_k must be -1 (off) or >= 1")
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        _check_real("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        _check_real("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT_MAX)
        _check_int("min_tokens", self.min_tokens, 0, INT_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self._check_logit_bias()
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or len(self.bad_words) > MAX_BAD_WORDS
            or not all(
                isinstance(w, str) and 0 < len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words
            )
        ):
            raise ValueError(
                f"bad_words must be a list of at most {MAX_BAD_WORDS} non-empty strings of at most "
                f"{MAX_BAD_WORD_CHARS} characters"
            )
        if self.num_speculative_tokens is not None:
            _check_int("num_speculative_tokens", self.num_speculative_tokens, 0, INT_MAX)
        if self.speculative_n_min is not None:
            _check_int("speculative_n_min", self.speculative_n_min, 0, INT_MAX)
        if self.speculative_p_min is not None:
            _check_real("speculative_p_min", self.speculative_p_min, 0.0, 1.0)
        if self.structured_outputs is not None:
            self._check_structured_outputs()
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(
                f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT_MAX
            for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative integers"
            )

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids -> biases"
            )
        checked = {}
        for key, value in bias.items():
            token = token_id_key(key)
            if token is None:
                # NOTE: the key is not shown: it is client text of any length
                raise ValueError(
                    f"logit_bias keys must be token ids (at most {MAX_TOKEN_ID_DIGITS} ASCII "
                    f"digits, at most {INT_MAX})"
                )
            _check_real("logit_bias values", value, *LOGIT_BIAS_RANGE)
            checked[token] = float(value)
        self.logit_bias = checked

    def _check_structured_outputs(self) -> None:
        try:
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
            self.structured_outputs.validate()
        except TypeError as e:  # e.g. a dict with keys that are not strings
            raise ValueError(f"structured_outputs: invalid value ({type(e).__name__})") from e
        except ValueError as e:
            if str(e).startswith("structured_outputs"):
                raise
            raise ValueError(f"structured_outputs: invalid value ({type(e).__name__})") from e

    @property
    def num_samples(self) -> int:
        """Sequences generated for the prompt: ``best_of`` (or ``n``)."""
        return self.best_of or self.n

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of ``n`` / ``best_of``: one sequence, seeded
        ``seed + index`` (vLLM's rule; unseeded samples draw their own seeds); log-probabilities
        are computed whenever samples are ranked (best_of > n)."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed >= SEED_RANGE[1]:
                seed -= SEED_RANGE[1]
        logprobs = self.logprobs
        if logprobs is None and self.num_samples > self.n:
            logprobs = 0
        return replace(self, n=1, best_of=None, seed=seed, logprobs=logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam is expanded by its top 2 * beam_width tokens


@dataclass
class BeamSearchParams:
    """``LLM.beam_search``'s parameters (vLLM's ``vllm.sampling_params.BeamSearchParams``):
    keep the ``beam_width`` best sequences, each step expanding every beam by its top
    ``2 * beam_width`` tokens, for at most ``max_tokens`` steps. Beams are ranked by cumulative
    log-probability over ``len(tokens) ** length_penalty`` (prompt included, a final EOS not
    counted, as vLLM). ``ignore_eos``: an EOS does not end a beam; ``temperature``: how each
    step's sampled token is drawn (it joins the candidates; the ranking uses raw
    log-probabilities); ``include_stop_str_in_output``: a finished beam's text ends with its
    EOS text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH)
        _check_int("max_tokens", self.max_tokens, 1, INT_MAX)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_real("temperature", self.temperature, 0.0, TEMPERATURE_MAX)
        _check_real("length_penalty", self.length_penalty, -1e6, 1e6)
