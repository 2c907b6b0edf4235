"""One target forward over every scheduled token, then verification (or plain sampling).

A failure that belongs to one request (its logits are not finite, its sampling fails, the
forward fails on its tokens) comes back as a ``RequestFailure`` for that request alone; the
others' results are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.scheduler import ScheduledRequest, SchedulerOutput
from specdec.kv_cache.pool import KVCache
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.sample.rejection_sampler import VerifyResult, verify


@dataclass
class RequestFailure:
    """The request cannot go on; ``message`` says why (one line)."""

    message: str


StepResult = VerifyResult | RequestFailure | None  # None: a prefill chunk, nothing sampled


@dataclass
class ModelRunnerOutput:
    results: list[StepResult]  # per scheduled request


def failure(stage: str, e: BaseException) -> RequestFailure:
    return RequestFailure(f"{stage} failed: {type(e).__name__}: {e}".splitlines()[0][:500])


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model = model
        self.kv = kv

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        try:
            logits = self._forward(sched.scheduled)
        except Exception as e:  # noqa: BLE001 - isolated below
            if len(sched.scheduled) == 1:
                return ModelRunnerOutput([failure("the forward pass", e)])
            return ModelRunnerOutput(self._one_by_one(sched.scheduled))
        return ModelRunnerOutput(self._verify(sched.scheduled, logits))

    def _one_by_one(self, scheduled: list[ScheduledRequest]) -> list[StepResult]:
        """After a batched forward failed: each request alone, so only the one whose tokens
        fail is failed. NOTE: rewriting the same KV positions with the same tokens is harmless."""
        results: list[StepResult] = []
        for s in scheduled:
            try:
                logits = self._forward([s])
            except Exception as e:  # noqa: BLE001
                results.append(failure("the forward pass", e))
                continue
            results.extend(self._verify([s], logits))
        return results

    def _forward(self, scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        """The target over every scheduled token; logits [R, V] of the rows that need them."""
        ids, pos, logit_rows = [], [], []
        batch = SeqBatch([], [], [])
        for s in scheduled:
            start = s.start_pos
            n = len(s.token_ids)
            if s.needs_logits:
                first = len(ids) + n - 1 - s.num_drafts
                logit_rows.extend(range(first, len(ids) + n))
            ids.extend(s.token_ids)
            pos.extend(range(start, start + n))
            batch.slots.append(s.req.slot)
            batch.start_pos.append(start)
            batch.num_tokens.append(n)
        device = self.model.device
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device),
            batch,
            self.kv,
        )  # [T, H]
        if not logit_rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(logit_rows, device=device)])

    def _verify(
        self,
        scheduled: list[ScheduledRequest],
        logits: torch.Tensor | None,  # [R, V]
    ) -> list[StepResult]:
        results: list[StepResult] = []
        row = 0
        for s in scheduled:
            if not s.needs_logits:
                results.append(None)
                continue
            req = s.req
            rows = logits[row : row + s.num_drafts + 1]
            row += s.num_drafts + 1
            try:
                results.append(
                    verify(
                        rows,
                        req.draft_token_ids,
                        req.draft_probs,
                        req.sampling,
                        req.penalty,
                        req.seed,
                        len(req.output_token_ids),
                    )  # fmt: skip
                )
            except Exception as e:  # noqa: BLE001 - this request's failure alone
                results.append(failure("sampling", e))
        return results
