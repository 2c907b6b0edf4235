"""The drafting methods, by name: ``METHODS`` is the one list. Config validation, the engine and
the "every drafter" tests read it; nothing else branches on the method.

A leaf module (it imports nothing of specdec): ``config`` reads the table without importing the
drafter package, whose modules are imported only when a method is used
(``specdec.spec_decode.make_proposer``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    module: str  # specdec.spec_decode.<module>.make builds the proposer
    samples_q: bool  # may draft from its own distribution (draft_sample_method probabilistic)
    needs_model: bool  # speculative_config.model names the drafter's weights
    aliases: tuple[str, ...] = ()  # other names users paste (vLLM's)


METHODS: dict[str, Method] = {
    "ngram": Method("ngram", samples_q=False, needs_model=False),
    "suffix": Method("suffix", samples_q=False, needs_model=False),
    "draft_model": Method("draft_model", samples_q=True, needs_model=True),
    "layer_skip": Method("layer_skip", samples_q=True, needs_model=False),
    "eagle": Method("eagle", samples_q=True, needs_model=True),
    # eagle3: a head ships for the default model; elsewhere `model` is required (at load)
    "eagle3": Method("eagle3", samples_q=True, needs_model=False),
    "medusa": Method("medusa", samples_q=True, needs_model=True),
    # suffix decoding and an EAGLE-3 head, each step the one expected to yield more
    "hybrid": Method("hybrid", samples_q=True, needs_model=False),
    "mtp": Method(
        "mtp",
        samples_q=True,
        needs_model=False,
        aliases=(
            "deepseek_mtp",
            "mimo_mtp",
            "ernie_mtp",
            "qwen3_next_mtp",
            "glm4_moe_mtp",
            "longcat_flash_mtp",
            "pangu_ultra_moe_mtp",
            "openpangu_mtp",
        ),  # fmt: skip
    ),
}


def canonical_method(name: str) -> str | None:
    """The table's name for ``name`` (itself or an alias), or None if unknown."""
    if name in METHODS:
        return name
    return next((m for m, spec in METHODS.items() if name in spec.aliases), None)


__all__ = ["METHODS", "Method", "canonical_method"]
