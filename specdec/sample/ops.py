"""Pure functions that turn target (or draft) logits into the logits a request samples from.

The same transform is applied with and without speculation, and to draft logits, so that
verification compares like with like.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specdec import kernels
from specdec.sampling_params import SamplingParams


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Run torch's CPU ops on the calling thread only.

    NOTE: an op over one 49k-vocabulary row splits across the OpenMP pool, and waking the
    sleeping (OMP_WAIT_POLICY=PASSIVE) threads costs more than the op: exp over a row took
    250 us on 2 threads and 24 us on one; a whole sampled token 665 vs 169 us.
    """
    num = torch.get_num_threads()
    if device.type != "cpu" or num == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's first maximum (``logits [R, V]``), as a list.

    On CPU float32 the native kernel does it (torch's argmax takes ~0.5 ms for 17 rows of a
    49k vocabulary, a few percent of a verification step); elsewhere torch does.
    """
    native = kernels.native_module()
    if native is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return native.argmax(logits).tolist()
    return logits.argmax(dim=-1).tolist()


def argmax_rows_finite(logits: torch.Tensor) -> tuple[list[int], bool]:
    """``argmax_rows``, and whether every row's chosen maximum is finite (``logits [R, V]``).
    On CPU float32 one native call, which returns the indices as a list and checks the maxima
    itself: no tensor of indices to read back and no read of each chosen logit from Python."""
    native = kernels.native_module()
    if native is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        best, finite = native.argmax_finite(logits)
        return best, finite
    best = logits.argmax(dim=-1)
    finite = bool(torch.isfinite(logits.gather(-1, best.unsqueeze(-1))).all())
    return best.tolist(), finite


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


def processed_logits(
    logits: torch.Tensor,  # [R, V]
    sp: SamplingParams,
    prompt_mask: torch.Tensor | None,  # [V] bool
    output_counts: torch.Tensor | None,  # [R, V]
) -> torch.Tensor:  # [R, V]: penalised logits, divided by the temperature unless greedy
    """The logits every row samples from; top-k, top-p and min-p are the sampler's
    (``specdec.sample.sampler``). Elementwise only, so a row never depends on the others."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    if sp.has_penalties and prompt_mask is not None and output_counts is not None:
        logits = apply_penalties(logits, prompt_mask, output_counts, sp)
    if sp.is_greedy:
        return logits
    return logits / sp.temperature
