"""Suffix decoding and a trained head in the same request (``"method": "hybrid"``), each step
taking the drafter whose drafts are expected to yield the most tokens per millisecond (as Arctic
Inference pairs suffix decoding with its speculator).

Suffix decoding scores its own draft: the sum of its tokens' estimated probabilities, the
expected number accepted. The head's expected number for j drafts is ``sum_{i<=j} prod_{l<=i}
a_l``, with ``a_l`` the request's running chance that head draft l survives given that draft
l - 1 did (learnt from the tokens that arrive; a new request starts from the rates measured over
earlier ones). Suffix decoding drafts up to its own cap (``SUFFIX_CAP``, its default
``num_speculative_tokens``); the head drafts at most ``num_speculative_tokens``.

Each step, per request, three options are priced with the engine's learnt cost of a step
(``Proposer.cost_model``: the verification curve, its learnt extras) plus the head's own measured
time: suffix decoding's draft, the head's best j, or no draft. Expected tokens per millisecond
decides. Without the adaptive controller (no cost model) the larger expected number of accepted
drafts wins, as before. NOTE: pricing matters on a CPU: a head whose first draft survives a third
of the time adds about what its verified row costs, so drafting it whenever suffix decoding had
nothing made hybrid slower than suffix decoding alone (1.24x against 1.30x plain, 2-core Xeon,
2026-11-24).

While the head is not run, the target's states it has not read wait here and it reads them all
in one step the next time it drafts (one step over n rows costs about one over one). Shadow
requests (scored, never verified) get suffix decoding's draft only.

A head that cannot pay is switched off: after MIN_HEAD_TRIALS verified head drafts, hybrid
judges it on its record over every request (see ``_head_pays``); if it loses, hybrid is suffix
decoding alone from then on, and ``wants_hidden`` tells the engine to stop computing the
target's states (keeping and reading them cost 1-2% even while the head was idle).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from specdec.spec_decode.base import (
    DraftInput,
    DraftOutput,
    DraftRequest,
    Proposer,
    accepted_prefix,
)
from specdec.spec_decode.controller import CATCH_UP_HORIZON, expected_tokens
from specdec.spec_decode.suffix import SuffixProposer

PRIOR_RATE = 0.5  # the head's acceptance rate per position before any has been measured
RATE_WEIGHT = 0.2  # how much one verification moves a request's rate
PRIOR_WEIGHT = 0.05  # how much one verification moves the rates new requests start from
MS_WEIGHT = 0.1  # how much one timed head call moves the head's time per step
SUFFIX_CAP = 32  # suffix decoding's default num_speculative_tokens
STASH_ROWS = 256  # past this many unread target states the head reads them (drafting one)
STEADY_ROWS = 8  # a head call reading at most this many states counts as a steady step
MIN_HEAD_TRIALS = 64  # verified head drafts before hybrid judges whether the head pays at all


@dataclass
class _Pick:
    source: str  # "suffix" | "head"
    draft_token_ids: list[int]
    start: int  # the request's token count when proposed


class HybridProposer(Proposer):
    free_drafts = True
    confident_drafts = True  # suffix decoding's drafts, or the head's priced by hybrid itself

    def __init__(self, suffix: SuffixProposer, head: Proposer, head_k: int) -> None:
        self.suffix, self.head, self.head_k = suffix, head, head_k
        self.max_drafts = max(SUFFIX_CAP, head_k)
        self.hidden_layers = head.hidden_layers
        self.prior = [PRIOR_RATE] * head_k  # per draft position, for new requests
        self.rates: dict[str, list[float]] = {}  # per request, per draft position
        self.head_step_ms = 0.0  # one head step (a draft, or a catch-up over a few states)
        self.head_row_ms = 0.0  # per state beyond those, when catching up after a pause
        self.last: dict[str, _Pick] = {}
        self.num_drafted = {"suffix": 0, "head": 0}  # drafts proposed, by source
        # states the head has not read, per request: (first position, [n_i, D] pieces, sum n_i)
        self.stash: dict[str, tuple[int, list[torch.Tensor], int]] = {}
        # the head's record over every request (verified drafts reaching each position, and
        # surviving): once it says the head cannot pay, hybrid is suffix decoding alone
        self.trials = [0] * head_k
        self.hits = [0] * head_k
        self.head_on = True

    @property
    def wants_hidden(self) -> bool:
        return self.head_on

    def add_request(self, req_id: str) -> None:
        self.suffix.add_request(req_id)
        self.head.add_request(req_id)

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        self.suffix.remove_request(req_id, token_ids)
        self.head.remove_request(req_id, token_ids)
        self.rates.pop(req_id, None)
        self.last.pop(req_id, None)
        self.stash.pop(req_id, None)

    def reset_cache(self) -> None:
        self.suffix.reset_cache()
        self.head.reset_cache()

    def _learn(self, r: DraftRequest) -> None:
        """Score the head's last drafts for this request against the tokens that arrived."""
        pick = self.last.pop(r.req_id, None)
        if pick is None or pick.source != "head" or not pick.draft_token_ids:
            return
        drafts = pick.draft_token_ids
        m = accepted_prefix(drafts, r.token_ids[pick.start :])
        rates = self.rates.setdefault(r.req_id, list(self.prior))
        for i in range(min(m + 1, len(drafts))):  # positions reached: survived, or failed at m
            hit = 1.0 if i < m else 0.0
            rates[i] += RATE_WEIGHT * (hit - rates[i])
            self.prior[i] += PRIOR_WEIGHT * (hit - self.prior[i])
            self.trials[i] += 1
            self.hits[i] += int(hit)
        if self.head_on and self.trials[0] >= MIN_HEAD_TRIALS and self.cost_model is not None:
            # NOTE: only while on: the engine stops returning states once it is off, for good
            self.head_on = self._head_pays()
            if not self.head_on:
                self.stash.clear()

    def _head_pays(self) -> bool:
        """Whether some j head drafts would beat no draft at the head's measured rates (over
        every request so far) and its steady cost per step. NOTE: on SmolLM2-135M a head
        step is ~10% of a target step and the shipped head's first draft survives ~4 times in
        10 where suffix decoding has nothing, so it does not: then hybrid stops the head and
        the target's states (their upkeep cost 1-2% of the time)."""
        rates = [h / t if t else 0.0 for h, t in zip(self.hits, self.trials)]
        value, _ = self._best_drafts(rates, self.head_k, self.head_step_ms)
        return value > 1.0 / self.cost_model.step_ms(1, 0)

    def _head_value(self, r: DraftRequest, k: int, num_rows: int) -> tuple[float, int]:
        """The head's best (expected tokens per ms, number of drafts) for this request."""
        # NOTE: states left unread while suffix decoding drafted are read in one step; what it
        # costs beyond a step is spread over the steps the head then drafts, as the controller
        # spreads a drafter's catch-up
        behind = self.head_row_ms * max(0, num_rows - STEADY_ROWS) / CATCH_UP_HORIZON
        rates = self.rates.get(r.req_id, self.prior)
        return self._best_drafts(rates, k, self.head_step_ms + behind)

    def _best_drafts(self, rates: list[float], k: int, catch_up_ms: float) -> tuple[float, int]:
        """(expected tokens per ms, j) of the best j <= k head drafts at these rates: one head
        step to catch up (``catch_up_ms``), then one per draft, plus the verified rows."""
        cost = self.cost_model
        best, best_j = 0.0, 0
        for j in range(1, k + 1):
            ms = cost.step_ms(1 + j, j, draft_ms=catch_up_ms + self.head_step_ms * j)
            value = expected_tokens(rates, j) / ms
            if value > best:
                best, best_j = value, j
        return best, best_j

    def _choose(self, r: DraftRequest, drafts: list[int], num_rows: int) -> tuple[str, int]:
        """("suffix" | "head" | "none", number of drafts) for a request that may be verified."""
        k = min(r.max_num_drafts, self.head_k) if self.head_on else 0
        score = self.suffix.last_scores.get(r.req_id, 0.0) if drafts else 0.0
        if self.cost_model is None:  # no prices: the larger expected number of accepted drafts
            rates = self.rates.get(r.req_id, self.prior)
            if drafts and score >= expected_tokens(rates, k) - 1.0:
                return "suffix", len(drafts)
            return ("head", k) if k > 0 else ("none", 0)
        cost = self.cost_model
        options = [(1.0 / cost.step_ms(1, 0), "none", 0)]
        if drafts:
            n = len(drafts)
            options.append(((1.0 + score) / cost.step_ms(1 + n, n, draft_ms=0.0), "suffix", n))
        if k > 0:
            value, j = self._head_value(r, k, num_rows)
            options.append((value, "head", j))
        _, source, n = max(options, key=lambda o: o[0])
        # NOTE: suffix decoding alone drafts whenever the controller lets it (confident_drafts:
        # only its guard can say no); hybrid keeps that, so "none" is only taken over the head,
        # never over a suffix draft.
        if source == "none" and drafts:
            return "suffix", len(drafts)
        return source, n

    def propose(self, inp: DraftInput) -> DraftOutput:
        for r in inp.requests:
            self._learn(r)
        s_out = self.suffix.propose(inp)
        choices: list[tuple[str, int]] = []
        head_reqs: list[DraftRequest] = []
        for r, drafts in zip(inp.requests, s_out.draft_token_ids):
            start, rows, num_rows = self._unread(r)
            choice = ("suffix", len(drafts)) if r.shadow else self._choose(r, drafts, num_rows)
            choices.append(choice)
            if choice[0] == "head":
                head_reqs.append(_with_cap(r, choice[1], start, rows))
            elif not self.head_on:
                continue
            elif num_rows >= STASH_ROWS and r.max_num_drafts > 0:
                head_reqs.append(_with_cap(r, 1, start, rows))  # read them; the draft is dropped
            elif rows:
                self.stash[r.req_id] = (start, rows, num_rows)
        head_drafts = self._run_head(head_reqs)
        ids, probs = [], []
        for i, (r, (source, _)) in enumerate(zip(inp.requests, choices)):
            d, q = s_out.draft_token_ids[i], None
            if source == "head":
                d, q = head_drafts[r.req_id]
            elif source == "none":
                d = []
            self.last[r.req_id] = _Pick(source, list(d), len(r.token_ids))
            if source != "none":
                self.num_drafted[source] += len(d)
            ids.append(list(d))
            probs.append(q)
        return DraftOutput(ids, probs)

    def _run_head(self, reqs: list[DraftRequest]) -> dict[str, tuple[list[int], object]]:
        """Run the head over these requests, timing it: one catch-up step each plus their drafts."""
        if not reqs:
            return {}
        t0 = time.perf_counter()
        out = self.head.propose(DraftInput(reqs))
        ms = (time.perf_counter() - t0) * 1e3
        steps = sum(1 + r.max_num_drafts for r in reqs)
        extra_rows = sum(
            max(0, (0 if r.hidden_states is None else r.hidden_states.shape[0]) - STEADY_ROWS)
            for r in reqs
        )
        if not extra_rows:  # steady: a step per draft and one over the few new states
            w = MS_WEIGHT if self.head_step_ms else 1.0
            self.head_step_ms += w * (ms / steps - self.head_step_ms)
        else:
            per_row = max(0.0, ms - self.head_step_ms * steps) / extra_rows
            w = MS_WEIGHT if self.head_row_ms else 1.0
            self.head_row_ms += w * (per_row - self.head_row_ms)
        return {
            d.req_id: (ids, out.draft_probs[i] if out.draft_probs else None)
            for i, (d, ids) in enumerate(zip(reqs, out.draft_token_ids))
        }

    def _unread(self, r: DraftRequest) -> tuple[int, list[torch.Tensor], int]:
        """The target states the head has not read (first position, pieces, number): those kept
        here, then the request's own (contiguous; a gap drops what was kept, as the head would).
        The pieces are joined only when the head runs."""
        start, rows = r.hidden_start, r.hidden_states
        new = [] if rows is None or rows.shape[0] == 0 else [rows]
        num_new = rows.shape[0] if new else 0
        kept = self.stash.pop(r.req_id, None)
        if kept is None:
            return start, new, num_new
        k_start, k_rows, k_num = kept
        if not new:
            return k_start, k_rows, k_num
        if k_start + k_num != start:
            return start, new, num_new
        return k_start, [*k_rows, rows.to(k_rows[0].dtype)], k_num + num_new


def _with_cap(r: DraftRequest, cap: int, start: int, rows: list[torch.Tensor]) -> DraftRequest:
    d = DraftRequest(r.req_id, r.token_ids, cap, r.sampling, r.seed, r.num_prompt_tokens)
    d.cache_salt = r.cache_salt
    d.hidden_states = None if not rows else rows[0] if len(rows) == 1 else torch.cat(rows)
    d.hidden_start = start
    return d


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    from specdec.spec_decode import eagle3, suffix

    # suffix decoding keeps its own cap; num_speculative_tokens bounds the head
    own = dataclasses.replace(
        cfg, num_speculative_tokens=max(SUFFIX_CAP, cfg.num_speculative_tokens)
    )
    return HybridProposer(
        suffix.make(own, target, load_draft, max_num_seqs, max_len),
        eagle3.make(cfg, target, load_draft, max_num_seqs, max_len),
        cfg.num_speculative_tokens,
    )
