"""Decides, each step, which requests run and which tokens each feeds; commits what comes back.

Decoding requests go first, each with its last token plus its pending drafts (clipped by the
token budget, max_tokens and max_model_len); then prompts are read: running requests' unread
prompt tokens, and waiting requests admitted while KV slots and ``max_num_seqs`` allow, in chunks
of the remaining budget, starting after whatever prefix their KV slot already holds (prefix
caching). While some request decodes, the prompt tokens a step reads are bounded by time
(engine/fair_share.py): a long prompt slows the others' streams by a set share, never by its
whole prefill.

``update_from_output`` takes the runner's results: it appends accepted tokens one by one with
the stop checks, moves each request's KV length back past rejected drafts (rollback is only that
length: the stale entries are overwritten later) and finishes requests that stopped or failed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specdec.engine.fair_share import PrefillShare
from specdec.engine.request import Request, RequestStatus
from specdec.kv_cache.pool import KVCache
from specdec.sample.logprobs import TokenLogprobs
from specdec.sample.rejection_sampler import VerifyResult
from specdec.structured.grammar import Grammar
from specdec.worker.step import (
    RequestFailure,
    ScheduledRequest,
    SchedulerOutput,
    StepResult,
    failure,
)

logger = logging.getLogger("specdec.engine")


class GrammarViolation(RuntimeError):
    """A committed token the request's grammar does not allow (a bug, never the user's)."""


@dataclass
class SchedulerUpdate:
    """What one step changed: requests with new tokens or a new end, in step order."""

    changed: list[Request] = field(default_factory=list)
    # requests that ended this step, and whether their tokens may be kept (prefix cache,
    # drafter memory): False for failures
    finished: list[tuple[Request, bool]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eog_token_ids: frozenset[int] | set[int] = frozenset(),
        prefill_time_share: float = 1.0,
    ) -> None:
        self.kv = kv
        self.prefill_share = PrefillShare(prefill_time_share)
        # the step being run: when it was scheduled, its prompt tokens, whether it decoded (timed
        # to its update: the forward and verification, what its prompt tokens add to)
        self._step: tuple[float, int, int, str] | None = None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # NOTE: a prompt_logprobs row costs an LM-head row and a log-softmax over the vocabulary
        # besides its forward (1.3-1.8x a plain prefill token on 135M, CPU): such a request's
        # prefill chunk is capped while it shares the engine, so each step others wait for
        # stays cheap (alone, it takes the whole budget).
        self.max_prompt_logprob_rows = max(16, max_num_batched_tokens // 8)
        self.max_model_len = max_model_len
        self.eog_token_ids = eog_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_generation_tokens = 0
        self.num_failed_requests = 0  # finished with finish_reason "error"

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        reading: list[Request] = []  # running requests with prompt tokens left to read
        for req in self.running:
            if self._reads_prompt(req):
                reading.append(req)
            elif budget > 0:
                item = self._schedule_one(req, budget)
                out.append(item)
                budget -= len(item.token_ids)
        num_decoding = len(out)
        # prompt tokens: at most the time share's while others decode (fair_share.py), of one
        # kind a step (plain tokens or prompt-logprob rows: each kind's cost is learnt apart)
        kind = _prompt_kind(reading[0] if reading else self.waiting[0] if self.waiting else None)
        one_kind = num_decoding > 0 and self.prefill_share.enabled
        prompt_budget = self.prefill_share.budget(budget, num_decoding, kind)
        for req in reading:
            if prompt_budget <= 0:
                break
            if one_kind and _prompt_kind(req) != kind:
                continue
            item = self._schedule_one(req, prompt_budget)
            out.append(item)
            prompt_budget -= len(item.token_ids)
        while (
            self.waiting
            and prompt_budget > 0
            and len(self.running) < self.max_num_seqs
            and self.kv.num_free_slots
        ):
            if self._waits_for_prefix(self.waiting[0]):
                break
            if one_kind and _prompt_kind(self.waiting[0]) != kind:
                break  # NOTE: its kind's turn comes; the queue keeps its order
            req = self.waiting.popleft()
            if req.sampling.prompt_logprobs is not None:
                # NOTE: every prompt row needs its logits: nothing comes from the prefix cache
                req.slot, req.num_cached_tokens = self.kv.allocate(), 0
            else:
                req.slot, req.num_cached_tokens = self.kv.allocate_for_prompt(
                    req.prompt_token_ids, req.cache_salt
                )
            req.num_computed_tokens = req.num_cached_tokens  # prefill starts after the prefix
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            item = self._schedule_one(req, prompt_budget)
            out.append(item)
            prompt_budget -= len(item.token_ids)
        # NOTE: after every admission: one may have given a running sequence its own copy of the
        # prefix it read from the slot the admitted request took
        for item in out:
            item.prefix_slot, item.prefix_len = self.kv.prefix_of(item.slot)
        num_prompt = sum(len(item.token_ids) for item in out[num_decoding:])
        self._step = (time.perf_counter(), num_prompt, num_decoding, kind) if out else None
        return SchedulerOutput(out)

    @staticmethod
    def _reads_prompt(req: Request) -> bool:
        """Whether ``req`` still has prompt tokens to read (beyond its last sampled token)."""
        return req.num_tokens - req.num_computed_tokens > 1

    def _waits_for_prefix(self, req: Request) -> bool:
        """Shared prefixes (kv_cache/pool.py): whether ``req``'s prompt starts with a whole
        block or more of what a running request is still prefilling. Admitted now, it would
        compute that a second time; a step or two later it shares or copies it. Only while that
        request prefills: it goes on, so the wait is short."""
        block = self.kv.share_block
        if (
            not block
            or not self.kv.enable_prefix_caching
            or req.sampling.prompt_logprobs is not None
        ):
            return False
        prompt = req.prompt_token_ids
        for r in self.running:
            other = r.prompt_token_ids
            n = min(len(prompt), len(other)) - 1  # the last prompt token is always computed
            if r.num_computed_tokens >= n or n < block or r.cache_salt != req.cache_salt:
                continue
            same = np.asarray(prompt[:n]) == np.asarray(other[:n])
            lcp = n if same.all() else int(same.argmin())
            if lcp >= block and lcp > r.num_computed_tokens:
                return True
        return False

    def _schedule_one(self, req: Request, budget: int) -> ScheduledRequest:
        if req.sampling.prompt_logprobs is not None and (len(self.running) > 1 or self.waiting):
            budget = min(budget, self.max_prompt_logprob_rows)
        missing = req.token_ids_from(req.num_computed_tokens)
        if len(missing) > budget:
            return self._item(req, missing[:budget], 0, False, None)
        drafts = req.draft_token_ids[: self.max_drafts(req, budget - len(missing))]
        mask = None
        if req.grammar is not None:
            # NOTE: the speculator cut drafts the grammar forbids; the mask stops at one anyway
            mask = req.grammar.masks(drafts)
            drafts = drafts[: len(mask.rows) - 1]
        probs = req.draft_probs
        if probs is not None and len(drafts) < len(req.draft_token_ids):
            probs = probs[: len(drafts)] if drafts else None
        num_forced = max(0, req.num_forced_drafts - (len(req.draft_token_ids) - len(drafts)))
        # NOTE: drafts are verified once; whatever happens, the next step drafts anew.
        req.draft_token_ids, req.draft_probs, req.num_forced_drafts = [], None, 0
        item = self._item(req, missing + drafts, len(drafts), True, probs)
        item.num_forced_drafts, item.mask = num_forced, mask
        return item

    def _item(
        self,
        req: Request,
        token_ids: list[int],
        num_drafts: int,
        needs_logits: bool,
        probs: torch.Tensor | None,
    ) -> ScheduledRequest:
        item = ScheduledRequest(
            req.req_id, req.slot, req.num_computed_tokens, token_ids, num_drafts, needs_logits,
            req.sampling, req.seed, len(req.output_token_ids), req.penalty, probs,
        )  # fmt: skip
        adjust = req.logits_adjust
        if adjust is not None and adjust.bad_words is not None and adjust.bad_words.max_prefix_len:
            out = req.output_token_ids
            tail = tuple(out[max(0, len(out) - adjust.bad_words.max_prefix_len) :])
            adjust = replace(adjust, output_tail=tail)
        item.adjust = adjust
        if req.sampling.prompt_logprobs is not None:
            start, prompt = req.num_computed_tokens, req.prompt_token_ids
            end = min(start + len(token_ids), len(prompt) - 1)  # rows with a next prompt token
            item.prompt_logprobs = req.sampling.prompt_logprobs
            item.prompt_next_token_ids = prompt[start + 1 : end + 1] if end > start else []
        return item

    def max_drafts(self, req: Request, budget: int) -> int:
        """Drafts this request may verify: each verified step yields at most drafts + 1 tokens."""
        left = (req.sampling.max_tokens or self.max_model_len) - len(req.output_token_ids) - 1
        room = self.max_model_len - req.num_tokens
        return max(0, min(budget, left, room))

    # ---- update --------------------------------------------------------------------------
    def update_from_output(
        self,
        sched: SchedulerOutput,
        results: list[StepResult],
        requests: dict[str, Request],
        prompt_logprobs: list[list[TokenLogprobs] | None] | None = None,
    ) -> SchedulerUpdate:
        """Commit each request's accepted tokens (stop checks one by one), roll its KV length
        back past rejected drafts, finish the requests that stopped or failed. ``prompt_logprobs``
        (per scheduled request): what its fed prompt rows report (prompt_logprobs)."""
        if self._step is not None:
            started, num_prompt, num_decoding, kind = self._step
            ms = 1000.0 * (time.perf_counter() - started)
            self.prefill_share.observe(num_prompt, num_decoding, ms, kind)
            self._step = None
        update = SchedulerUpdate()
        for i, (s, result) in enumerate(zip(sched.scheduled, results)):
            req = requests[s.req_id]
            if prompt_logprobs and prompt_logprobs[i]:
                req.prompt_logprobs.extend(prompt_logprobs[i])
            if isinstance(result, RequestFailure):
                self.fail(req, result, update)
                continue
            if result is None:
                req.num_computed_tokens += len(s.token_ids)
                self._publish(req, s)
                continue
            req.num_computed_tokens += len(s.token_ids) - s.num_drafts + result.num_accepted
            self._publish(req, s)
            try:
                self._commit(req, result)
            except GrammarViolation as e:
                self.fail(req, RequestFailure(str(e)), update)
                continue
            except Exception as e:  # noqa: BLE001 - this request's failure alone
                self.fail(req, failure("detokenizing", e), update)
                continue
            if req.is_finished:
                update.finished.append((req, True))
            update.changed.append(req)
        return update

    def fail(self, req: Request, why: RequestFailure, update: SchedulerUpdate) -> None:
        """Finish one request with an error; its KV is not cached, the others go on."""
        req.error = why.message
        req.finish_reason, req.stop_reason = "error", None
        self.num_failed_requests += 1
        detail = f" ({why.detail})" if why.detail else ""
        logger.warning("request %r failed: %s%s", req.req_id, why.message, detail)
        self.finish(req, cache=False)
        update.finished.append((req, False))
        if req not in update.changed:
            update.changed.append(req)

    def _commit(self, req: Request, result: VerifyResult) -> None:
        """Append tokens one by one, stopping at EOS / stop ids / stop strings / length."""
        # NOTE: first, so a step that fails before committing anything counts no accepted drafts
        req.num_step_committed = 0
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.monotonic()
        grammar = req.grammar
        if grammar is not None and (why := grammar.failure()) is not None:
            raise GrammarViolation(why)  # the client's constraint: its request fails alone
        for i, tok in enumerate(result.token_ids):
            if grammar is not None and not grammar.accept(tok):
                if (why := grammar.failure()) is not None and "gave up" in why:
                    raise GrammarViolation(why)
                # NOTE: the library's error holds its parser state and the grammar: one line
                # of it goes to the log, none to the client
                first = grammar.error.partition("\n")[0][:200]
                logger.warning("request %r: grammar refused token %d: %r", req.req_id, tok, first)
                raise GrammarViolation(
                    f"structured output: token {tok} is outside the request's grammar"
                )
            req.output_token_ids.append(tok)
            self.num_generation_tokens += 1
            if result.logprobs is not None:
                req.output_logprobs.append(result.logprobs[i])
            if req.penalty is not None:
                req.penalty.output_counts[tok] += 1
            delta = req.detokenizer.add_tokens([tok])
            req.output_text += delta
            req.output_char_ends.append(len(req.output_text))
            req.output_from_draft.append(i < result.num_accepted)
            req.num_step_committed += 1
            if self._check_stop(req, tok, delta) or (
                grammar is not None and self._grammar_done(req, grammar)
            ):
                if not isinstance(req.stop_reason, str):
                    req.output_text += req.detokenizer.finalize()  # flush held-back bytes
                self.finish(req)
                return

    @staticmethod
    def _grammar_done(req: Request, grammar: Grammar) -> bool:
        """The structured output is complete: nothing but the end may follow."""
        if not grammar.is_finished:
            return False
        req.finish_reason, req.stop_reason = "stop", None
        return True

    def _check_stop(self, req: Request, tok: int, delta: str) -> bool:
        sp = req.sampling
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and tok in self.eog_token_ids:
                req.finish_reason, req.stop_reason = "stop", None
                return True
            if tok in sp.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", tok
                return True
            if sp.stop and delta and _check_stop_strings(req, len(delta)):
                return True
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            req.finish_reason = "length"
            return True
        if req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
            return True
        return False

    # ---- finish --------------------------------------------------------------------------
    def _publish(self, req: Request, s: ScheduledRequest) -> None:
        """After a step fed prompt tokens: the prompt's computed part, for later requests to
        share (``KVCache.publish``)."""
        prompt = req.prompt_token_ids
        if s.start_pos < len(prompt) and req.slot is not None:
            n = min(req.num_computed_tokens, len(prompt))
            self.kv.publish(req.slot, prompt[:n], req.cache_salt)

    def finish(self, req: Request, cache: bool = True) -> None:
        """Take the request out and free its KV slot; ``cache=False`` forgets the slot's KV
        (a failed request's KV may be garbage, so no later prompt reuses it)."""
        req.status = RequestStatus.FINISHED
        req.metrics.finished_time = time.monotonic()
        req.draft_token_ids, req.draft_probs = [], None
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


def _check_stop_strings(req: Request, new_chars: int) -> bool:
    text = req.output_text
    longest = max(len(s) for s in req.sampling.stop)
    search_from = max(0, len(text) - new_chars - longest + 1)
    for stop in req.sampling.stop:
        idx = text.find(stop, search_from)
        if idx != -1:
            end = idx + len(stop) if req.sampling.include_stop_str_in_output else idx
            req.output_text = text[:end]
            req.finish_reason, req.stop_reason = "stop", stop
            return True
    return False


def _prompt_kind(req: Request | None) -> str:
    """The kind of prompt rows ``req`` reads (``fair_share.KINDS``)."""
    if req is not None and req.sampling.prompt_logprobs is not None:
        return "logprobs"
    return "prompt"
