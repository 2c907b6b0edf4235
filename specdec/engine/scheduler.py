"""Decides, each step, which requests run and which tokens each feeds.

Running requests go first, each with its last token plus its pending drafts (clipped by the
token budget, max_tokens and max_model_len); waiting requests are admitted while KV slots and
``max_num_seqs`` allow, their prompts prefilled in chunks of the remaining budget, starting after
whatever prefix their KV slot already holds (prefix caching).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdec.engine.request import Request, RequestStatus
from specdec.kv_cache.pool import KVCache


@dataclass
class ScheduledRequest:
    req: Request
    token_ids: list[int]  # fed this step: missing real tokens, then drafts
    num_drafts: int
    needs_logits: bool  # the chunk reaches the end of the known tokens: sample / verify

    @property
    def start_pos(self) -> int:
        return self.req.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


class Scheduler:
    def __init__(
        self, kv: KVCache, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        for req in self.running:
            if budget <= 0:
                break
            item = self._schedule_one(req, budget)
            out.append(item)
            budget -= len(item.token_ids)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and self.kv.num_free_slots
        ):
            req = self.waiting.popleft()
            req.slot, req.num_cached_tokens = self.kv.allocate_for_prompt(
                req.prompt_token_ids, req.cache_salt
            )
            req.num_computed_tokens = req.num_cached_tokens  # prefill starts after the prefix
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            item = self._schedule_one(req, budget)
            out.append(item)
            budget -= len(item.token_ids)
        return SchedulerOutput(out)

    def _schedule_one(self, req: Request, budget: int) -> ScheduledRequest:
        missing = req.token_ids_from(req.num_computed_tokens)
        if len(missing) > budget:
            return ScheduledRequest(req, missing[:budget], 0, needs_logits=False)
        drafts = req.draft_token_ids[: self.max_drafts(req, budget - len(missing))]
        if len(drafts) < len(req.draft_token_ids) and req.draft_probs is not None:
            req.draft_probs = req.draft_probs[: len(drafts)]
        req.draft_token_ids = drafts
        return ScheduledRequest(req, missing + drafts, len(drafts), needs_logits=True)

    def max_drafts(self, req: Request, budget: int) -> int:
        """Drafts this request may verify: each verified step yields at most drafts + 1 tokens."""
        left = (req.sampling.max_tokens or self.max_model_len) - len(req.output_token_ids) - 1
        room = self.max_model_len - req.num_tokens
        return max(0, min(budget, left, room))

    def finish(self, req: Request, cache: bool = True) -> None:
        """Take the request out and free its KV slot; ``cache=False`` forgets the slot's KV
        (a failed request's KV may be garbage, so no later prompt reuses it)."""
        req.status = RequestStatus.FINISHED
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            # NOTE: KV past num_computed_tokens (rejected drafts) is stale; it is never cached.
            # A stop inside an accepted run leaves num_computed_tokens past the last token.
            cached = req.all_token_ids[: req.num_computed_tokens] if cache else []
            self.kv.free(req.slot, cached, req.cache_salt)
            req.slot = None
