"""The EAGLE-3 head shipped for smollm2-135m (issue 19): found without a ``model``, in the
speculators layout, one safetensors file of at most 20 MB, exact, and its drafts are accepted."""

from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.config import ConfigError
from specdec.model.registry import default_head, resolve_model_path

PROMPTS = [
    "Write a short note to a neighbour asking them to water the plants while I am away.",
    "Explain how a bicycle gear works to a ten year old.",
]


PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
MESSAGES = [[{"role": "user", "content": p}] for p in PROMPTS]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    """Plain's greedy outputs, once for both methods (each prompt alone, as the drafter runs)."""
    llm = LLM("smollm2-135m", max_model_len=1024)
    return [llm.chat(m, PARAMS)[0].outputs[0].token_ids for m in MESSAGES]


def test_the_head_ships_with_the_package() -> None:
    head = default_head("eagle3", resolve_model_path("smollm2-135m"))
    assert head is not None
    files = sorted(p.name for p in head.iterdir())
    assert files == ["config.json", "model.safetensors"]
    assert (head / "model.safetensors").stat().st_size <= 20 * 1024 * 1024
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"


@pytest.mark.parametrize("method", ["eagle3", "hybrid"])
def test_no_model_uses_the_shipped_head_exactly(method: str, plain) -> None:
    spec = LLM(
        "smollm2-135m",
        max_model_len=1024,
        speculative_config={"method": method, "num_speculative_tokens": 3, "adaptive": False},
    )
    got = [spec.chat(m, PARAMS)[0].outputs[0].token_ids for m in MESSAGES]
    assert got == plain
    stats = spec.spec_decode_stats
    # a trained head: its first drafts are accepted far more often than chance (a random head's
    # almost never are)
    assert stats.num_drafts > 0
    assert stats.accepted_per_pos[0] / stats.num_drafts > 0.2


def test_no_head_for_another_model_names_the_field(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="speculative_config.model"):
        LLM(str(tiny_llama), speculative_config={"method": "eagle3"})
