"""Pure functions that turn target (or draft) logits into the distribution a request samples from.

The same transform is applied with and without speculation, and to draft logits, so that
verification compares like with like.
"""

from __future__ import annotations

import torch

from specdec import kernels
from specdec.sampling_params import SamplingParams


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's first maximum (``logits [R, V]``), as a list.

    On CPU float32 the native kernel does it (torch's argmax takes ~0.5 ms for 17 rows of a
    49k vocabulary, a few percent of a verification step); elsewhere torch does.
    """
    native = kernels.native_module()
    if native is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return native.argmax(logits).tolist()
    return logits.argmax(dim=-1).tolist()


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32
    prompt_mask: torch.Tensor,  # [V] bool: token occurs in the prompt
    output_counts: torch.Tensor,  # [R, V] float32: occurrences in the output so far, per row
    sp: SamplingParams,
) -> torch.Tensor:  # [R, V]
    """vLLM semantics: repetition penalty over prompt and output; presence/frequency over output."""
    if sp.repetition_penalty != 1.0:
        seen = prompt_mask.unsqueeze(0) | (output_counts > 0)
        penalised = torch.where(
            logits > 0, logits / sp.repetition_penalty, logits * sp.repetition_penalty
        )
        logits = torch.where(seen, penalised, logits)
    if sp.frequency_penalty:
        logits = logits - sp.frequency_penalty * output_counts
    if sp.presence_penalty:
        logits = logits - sp.presence_penalty * (output_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k, top-p and min-p exclude. ``logits`` already temperature-scaled."""
    vocab = logits.shape[-1]
    if sp.top_k != -1 and sp.top_k < vocab:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # NOTE: keep a token when the mass strictly before it is < top_p (the top token always stays).
        exclusive = probs.cumsum(dim=-1) - probs
        drop_sorted = exclusive >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if sp.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * sp.min_p
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def processed_logits(
    logits: torch.Tensor,  # [R, V]
    sp: SamplingParams,
    prompt_mask: torch.Tensor | None,  # [V] bool
    output_counts: torch.Tensor | None,  # [R, V]
) -> torch.Tensor:  # [R, V]: penalised logits (greedy) or masked, temperature-scaled logits
    logits = logits.float()
    if sp.has_penalties and prompt_mask is not None and output_counts is not None:
        logits = apply_penalties(logits, prompt_mask, output_counts, sp)
    if sp.is_greedy:
        return logits
    logits = logits / sp.temperature
    return apply_top_k_top_p_min_p(logits, sp)


def target_probs(
    logits: torch.Tensor,
    sp: SamplingParams,
    prompt_mask: torch.Tensor | None,
    output_counts: torch.Tensor | None,
) -> torch.Tensor:  # [R, V] float32 probabilities a random request samples from
    return processed_logits(logits, sp, prompt_mask, output_counts).softmax(dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:  # probs [V]
    return int(torch.multinomial(probs, 1, generator=generator).item())
