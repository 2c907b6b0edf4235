"""Speculative config parsing and validation; sampling parameter validation."""

from __future__ import annotations

import pytest

from specdec.config import ConfigError, SpeculativeConfig
from specdec.sampling_params import SamplingParams


def test_vllm_keys_json_and_inference() -> None:
    cfg = SpeculativeConfig.from_any(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    )
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 3, 5)
    assert SpeculativeConfig.from_any({"model": "some/draft.gguf"}).method == "draft_model"
    legacy = SpeculativeConfig.from_legacy("[ngram]", 4, ngram_prompt_lookup_max=3)
    assert (legacy.method, legacy.num_speculative_tokens, legacy.prompt_lookup_max) == (
        "ngram",
        4,
        3,
    )


def test_default_num_speculative_tokens_per_method() -> None:
    # vLLM's defaults: suffix decoding sizes its own drafts, so its k is a high cap.
    assert SpeculativeConfig.from_any({"method": "suffix"}).num_speculative_tokens == 32
    assert SpeculativeConfig.from_any({"method": "ngram"}).num_speculative_tokens == 5
    explicit = SpeculativeConfig.from_any({"method": "suffix", "num_speculative_tokens": 8})
    assert explicit.num_speculative_tokens == 8


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({"method": "ngram", "bogus": 1}, "bogus"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "eagle"}, "model is required"),
        ({"method": "nonsense"}, "allowed"),
        ({"method": "draft_model"}, "model"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_speculative_config_names_the_key(value, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        SpeculativeConfig.from_any(value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -3}, "top_k"),
        ({"n": 0}, "n must be an integer in \\[1, 128\\]"),
        ({"n": 2, "best_of": 1}, "best_of must be >= n"),
        ({"logit_bias": {1: 200}}, "logit_bias values"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_bad_sampling_params(kwargs, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)
