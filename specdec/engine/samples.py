"""n and best_of: one prompt fanned out into one engine request per sample, and merged back.

One engine request is one sequence. ``LLM.generate`` and the server both expand a request with
several samples here: sample ``i`` is its own request (``{group}-{i}``, seeded seed + i, see
``SamplingParams.for_sample``), and with the prefix cache on, one greedy one-token request first
prefills the prompt so that every sample copies its KV instead of computing it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.outputs import RequestOutput, merge_samples
from specdec.sampling_params import SamplingParams


@dataclass
class SamplePlan:
    """The engine requests behind one prompt: ``(req_id, sampling)`` per sample, and the
    sampling of the warm-up prefill to run (and finish) before them, or None."""

    samples: list[tuple[str | None, SamplingParams]]
    warmup: SamplingParams | None


def plan_samples(
    sampling: SamplingParams,
    group_id: str | None,
    num_prompt_tokens: int,
    prefix_caching: bool,
) -> SamplePlan:
    """The requests for one prompt. One sample keeps ``group_id`` (None: the engine names it);
    several need a ``group_id`` and get ``{group_id}-{i}``."""
    if sampling.num_samples == 1:
        return SamplePlan([(group_id, sampling)], None)
    assert group_id is not None, "several samples need a group id"
    samples: list[tuple[str | None, SamplingParams]] = [
        (f"{group_id}-{i}", sampling.for_sample(i)) for i in range(sampling.num_samples)
    ]
    return SamplePlan(samples, warmup_sampling(sampling, num_prompt_tokens, prefix_caching))


def warmup_sampling(
    sampling: SamplingParams, num_prompt_tokens: int, prefix_caching: bool
) -> SamplingParams | None:
    """The warm-up prefill before a prompt's samples (greedy, one token), or None: one sample,
    no prefix cache to share it through, a one-token prompt, or prompt_logprobs asked for."""
    if sampling.num_samples == 1 or not prefix_caching or num_prompt_tokens <= 1:
        return None
    if sampling.prompt_logprobs is not None:
        return None
    return SamplingParams(temperature=0.0, max_tokens=1, seed=0)


def merge_group(
    group_id: str, outs: list[RequestOutput], sampling: SamplingParams
) -> RequestOutput:
    """A prompt's finished samples as one output (best_of keeps the n best)."""
    if sampling.num_samples == 1:
        return outs[0]
    return merge_samples(group_id, outs, sampling.n, sampling.logprobs is not None)
