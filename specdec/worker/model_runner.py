"""One target forward over every scheduled token, then verification (or plain sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.scheduler import SchedulerOutput
from specdec.kv_cache.pool import KVCache
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.sample.rejection_sampler import VerifyResult, verify


@dataclass
class ModelRunnerOutput:
    results: list[
        VerifyResult | None
    ]  # per scheduled request; None = prefill chunk, nothing sampled


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model = model
        self.kv = kv

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        ids, pos, logit_rows = [], [], []
        batch = SeqBatch([], [], [])
        for s in sched.scheduled:
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
        logits = None
        if logit_rows:
            logits = self.model.compute_logits(
                hidden[torch.tensor(logit_rows, device=device)]
            )  # [R, V]
        return ModelRunnerOutput(self._verify(sched, logits))

    def _verify(
        self, sched: SchedulerOutput, logits: torch.Tensor | None
    ) -> list[VerifyResult | None]:
        results: list[VerifyResult | None] = []
        row = 0
        for s in sched.scheduled:
            if not s.needs_logits:
                results.append(None)
                continue
            req = s.req
            rows = logits[row : row + s.num_drafts + 1]
            row += s.num_drafts + 1
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
        return results
