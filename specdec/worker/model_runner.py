"""One target forward over every scheduled token, then verification (or plain sampling).

The runner reads only the ``SchedulerOutput``. A failure that belongs to one request (its logits
are not finite, its sampling fails, the forward fails on its tokens) comes back as a
``RequestFailure`` for that request alone; the others' results are unchanged.

Drafters that read the target's hidden states name them once (``hidden_layers``); the runner
then returns, per scheduled request, those states for every token it fed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import ExecutorError
from specdec.kv_cache.pool import KVCache
from specdec.model.llama import HIDDEN_FINAL, LlamaModel, SeqBatch
from specdec.sample.logprobs import TokenLogprobs, row_logprobs
from specdec.sample.rejection_sampler import verify
from specdec.worker.step import (
    RequestFailure,
    ScheduledRequest,
    SchedulerOutput,
    StepResult,
    failure,
)

__all__ = ["HIDDEN_FINAL", "ModelRunner", "ModelRunnerOutput", "RequestFailure", "failure"]


@dataclass
class ModelRunnerOutput:
    results: list[StepResult]  # per scheduled request
    # per scheduled request, with hidden_layers: [num_fed_tokens, H * len(hidden_layers)]
    # (None for a request whose forward failed)
    hidden_states: list[torch.Tensor | None] = field(default_factory=list)
    # per scheduled request: its fed prompt rows' log-probabilities (prompt_logprobs) or None
    prompt_logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)


def _raise_if_executor_gone(e: Exception) -> None:
    """A rank gone (tensor parallelism) fails every request, not one: let it through."""
    if isinstance(e, ExecutorError):
        raise e


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, hidden_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.kv = kv
        # the states the drafter reads: HIDDEN_FINAL (what the LM head reads) and/or i, the
        # residual stream entering layer i (layer i - 1's output)
        self.hidden_layers = hidden_layers

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        try:
            logits, hidden = self._forward(sched.scheduled)
        except Exception as e:  # noqa: BLE001 - isolated below
            _raise_if_executor_gone(e)
            if len(sched.scheduled) == 1:
                return ModelRunnerOutput([failure("the forward pass", e)], [None], [None])
            return self._one_by_one(sched.scheduled)
        results, prompt_logprobs = self._verify(sched.scheduled, logits)
        return ModelRunnerOutput(results, hidden, prompt_logprobs)

    def _one_by_one(self, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
        """After a batched forward failed: each request alone, so only the one whose tokens
        fail is failed. NOTE: rewriting the same KV positions with the same tokens is harmless."""
        out = ModelRunnerOutput([], [], [])
        for s in scheduled:
            try:
                logits, hidden = self._forward([s])
            except Exception as e:  # noqa: BLE001
                _raise_if_executor_gone(e)
                out.results.append(failure("the forward pass", e))
                out.hidden_states.append(None)
                out.prompt_logprobs.append(None)
                continue
            results, prompt_logprobs = self._verify([s], logits)
            out.results.extend(results)
            out.hidden_states.extend(hidden)
            out.prompt_logprobs.extend(prompt_logprobs)
        return out

    def _forward(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """The target over every scheduled token: logits [R, V] of the rows that need them (per
        request: its prompt_logprobs rows, then its verification rows), and each request's hidden
        rows when a drafter reads them."""
        ids, pos, logit_rows = [], [], []
        batch = SeqBatch([], [], [])
        for s in scheduled:
            start, n = s.start_pos, len(s.token_ids)
            logit_rows.extend(range(len(ids), len(ids) + len(s.prompt_next_token_ids)))
            if s.needs_logits:
                first = len(ids) + n - 1 - s.num_drafts
                logit_rows.extend(range(first, len(ids) + n))
            ids.extend(s.token_ids)
            pos.extend(range(start, start + n))
            batch.slots.append(s.slot)
            batch.start_pos.append(start)
            batch.num_tokens.append(n)
            batch.prefix_slots.append(s.prefix_slot)
            batch.prefix_lens.append(s.prefix_len)
        device = self.model.device
        final, captured = self.model.forward_capture(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device),
            batch,
            self.kv,
            self.hidden_layers,
        )  # [T, H], [T, H * len(hidden_layers)] or None
        hidden: list[torch.Tensor | None] = [None] * len(scheduled)
        if captured is not None:
            hidden = list(captured.split(batch.num_tokens))
        if not logit_rows:
            return None, hidden
        # NOTE: the rows ascend (built in order above); consecutive ones (a lone request, or
        # requests that all need logits for every fed row) are a view, with no index tensor
        first, last = logit_rows[0], logit_rows[-1]
        if last - first + 1 == len(logit_rows):
            return self.model.compute_logits(final[first : last + 1]), hidden
        return self.model.compute_logits(final[torch.tensor(logit_rows, device=device)]), hidden

    def _verify(
        self,
        scheduled: list[ScheduledRequest],
        logits: torch.Tensor | None,  # [R, V]
    ) -> tuple[list[StepResult], list[list[TokenLogprobs] | None]]:
        """Each request's sampled / verified tokens, and its prompt rows' log-probabilities."""
        results: list[StepResult] = []
        prompt_logprobs: list[list[TokenLogprobs] | None] = []
        row = 0
        for s in scheduled:
            num_prompt_rows = len(s.prompt_next_token_ids)
            prompt_logprobs.append(None)
            if num_prompt_rows:
                prompt_rows = logits[row : row + num_prompt_rows]  # [m, V]
                row += num_prompt_rows
                num_top = s.prompt_logprobs or 0
                prompt_logprobs[-1] = row_logprobs(prompt_rows, s.prompt_next_token_ids, num_top)
            if not s.needs_logits:
                results.append(None)
                continue
            end = row + s.num_drafts + 1
            rows = logits if row == 0 and end == logits.shape[0] else logits[row:end]
            row = end
            try:
                results.append(
                    verify(
                        rows,
                        s.draft_token_ids,
                        s.draft_probs,
                        s.sampling,
                        s.penalty,
                        s.seed,
                        s.output_pos,
                        s.adjust,
                        s.mask,
                    )  # fmt: skip
                )
            except Exception as e:  # noqa: BLE001 - this request's failure alone
                results.append(failure("sampling", e))
        return results, prompt_logprobs
