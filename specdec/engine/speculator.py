"""Everything about drafting, behind one call per engine step.

The ``Speculator`` owns the proposer (looked up in the method table), the adaptive controller
that picks each request's draft length, shadow drafts (proposed but not verified, scored against
the tokens that arrive so the controller stays informed at no verification cost), the hidden
states a drafter reads, and the acceptance statistics. ``LLMEngine.step`` calls ``step`` once,
after the scheduler has committed the runner's results.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.config import SpeculativeConfig
from specdec.engine.request import Request
from specdec.engine.scheduler import (
    Scheduler,
    SchedulerOutput,
    SchedulerUpdate,
    StepResult,
)
from specdec.kv_cache.pool import KVCache
from specdec.model.llama import LlamaModel
from specdec.model.moe import ExpertSpread, expert_mask, latest_routes, moe_blocks
from specdec.sample.rejection_sampler import VerifyResult
from specdec.spec_decode import DraftInput, DraftRequest, Proposer, make_proposer
from specdec.spec_decode.base import accepted_prefix
from specdec.spec_decode.controller import SpecController, measure_verify_cost
from specdec.spec_decode.metrics import SpecDecodeStats
from specdec.structured.grammar import MAX_FORCED_DRAFTS

logger = logging.getLogger("specdec.engine")


LONG_CONTEXT = 1024  # where the start-up measurement times what context adds to a verify row
# A batch whose requests all got no drafts rests: the controller is asked again after 1, 2, 4,
# ... at most REST_MAX steps (a new request, or one leaving, ends the rest). NOTE: asking cost
# ~0.4 ms of a ~9.5 ms step at a batch of 6 (n-gram at 0.94x plain on MT-Bench first turns,
# 2-core Xeon), and a batch's rates move slowly; a request whose drafts start to pay waits at
# most REST_MAX steps for them.
REST_MAX = 8


class DrafterError(RuntimeError):
    """The drafter could not take a request (its ``add_request`` hook raised): an engine fault,
    never the client's."""


@dataclass
class _Shadow:
    draft_token_ids: list[int]
    start: int  # the request's token count when they were proposed


@dataclass
class _Hidden:
    """Target hidden rows not yet handed to the drafter, contiguous from position ``start``."""

    start: int
    rows: list[torch.Tensor] = field(default_factory=list)  # each [n, D]
    end: int = -1  # start + the rows' count, kept as rows come (summed, it was O(rows) a step)

    def __post_init__(self) -> None:
        self.end = self.start + sum(r.shape[0] for r in self.rows)

    def append(self, rows: torch.Tensor) -> None:
        self.rows.append(rows)
        self.end += rows.shape[0]


class Speculator:
    def __init__(
        self,
        spec: SpeculativeConfig,
        target: LlamaModel,
        kv: KVCache,
        scheduler: Scheduler,
        load_draft: Callable[[SpeculativeConfig], LlamaModel],
        max_batched_tokens: int,
        max_drafts_per_step: int | None = None,
    ) -> None:
        """``max_drafts_per_step``: the runner's own cap on a request's drafts (fixed-shape
        steps hold 1 + that many tokens a request)."""
        self.spec = spec
        self.scheduler = scheduler
        self.proposer: Proposer = make_proposer(
            spec, target, load_draft, scheduler.max_num_seqs, scheduler.max_model_len
        )
        # The per-request cap: num_speculative_tokens, or the drafter's own when larger (hybrid)
        self.max_k = max(spec.num_speculative_tokens, self.proposer.max_drafts or 0)
        if max_drafts_per_step is not None:
            self.max_k = min(self.max_k, max_drafts_per_step)
        self.enabled = True  # False: propose nothing (plain decoding with the same engine)
        # True: the start-up measurement says drafting cannot pay here (``_cannot_pay``); the
        # engine then decodes as plain, without the drafter or any per-step bookkeeping
        self.dormant = False
        self.stats = SpecDecodeStats()
        self.controller: SpecController | None = None
        self._measured_cost = None
        # Mixture of experts: each step's router choices, to price drafts by the experts they
        # would touch (CostModel.experts_ms)
        self._moe = moe_blocks(target)
        self.spread: ExpertSpread | None = None
        if spec.adaptive:
            self._measured_cost = self._measure_cost(target, kv, max_batched_tokens)
            drafter = self.proposer.measure_cost()
            if drafter is not None:
                cost = self._measured_cost
                cost.draft_ms_per_token, cost.catch_up_ms_per_token = drafter
            self._new_controller()
            if self._moe:
                self.spread = ExpertSpread(target.cfg.num_experts, self._moe[0].top_k)
            self.dormant = self._cannot_pay()
        self._shadow: dict[str, _Shadow] = {}
        self._hidden: dict[str, _Hidden] = {}
        # requests whose drafter raised: plain decoding for them from then on (exact)
        self._drafter_off: set[str] = set()
        # a resting batch (REST_MAX): its requests, the steps left, the length of the last rest
        self._rest_batch: tuple[str, ...] = ()
        self._rest_left = self._rest_len = 0
        # drafter faults: requests switched off, and add / remove hooks that raised
        self.num_drafter_failures = 0

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target states the runner returns for the drafter (see LlamaModel.forward_capture)."""
        if self.dormant or not self.proposer.wants_hidden:
            return ()
        return tuple(self.proposer.hidden_layers)

    def _cannot_pay(self) -> bool:
        """Whether a drafter that costs time to ask cannot beat plain decoding by the controller's
        margin for a request alone even were every draft accepted, at the start-up prices.

        NOTE: the default layer_skip (28 of SmolLM2-135M's 30 layers) and the target as its own
        draft cost about a target step per draft. The controller kept them off, but its
        per-step bookkeeping and its probes (each a catch-up over the whole request) held
        layer_skip at 0.91-0.95x plain on held-out chat; dormant, 0.99-1.01x (paired, quiet,
        2-core AVX2 EPYC, 2026-11-27; `git show 610d18e:BENCHMARKS.md`). ``"adaptive": false`` drafts anyway.
        """
        if self.proposer.free_drafts or self.max_k < 1:
            return False
        if self.controller.could_pay(1, self.max_k):
            return False
        logger.warning(
            "speculative decoding: %s cannot beat plain decoding here (a draft costs %.2f ms, "
            'a target step %.2f ms): decoding plain; "adaptive": false drafts anyway',
            self.spec.method,
            self.controller.cost.draft_ms_per_token,
            self.controller.cost.verify(1),
        )
        return True

    def _measure_cost(self, target: LlamaModel, kv: KVCache, max_batched_tokens: int):
        """The verification cost curve, measured once on a free slot before any request."""
        k = self.max_k
        slot = kv.allocate()
        try:
            # The curve up to one request's k + 1 tokens, then up to a full batch with drafts.
            # One slot holds context + the widest row count: keep both within max_model_len.
            max_n = max(k + 1, 4)
            widest = min(
                self.scheduler.max_num_seqs * (k + 1),
                max_batched_tokens,
                self.scheduler.max_model_len // 2,
            )
            batch_ns = tuple(
                n for n in (2 * (k + 1), 4 * (k + 1), 8 * (k + 1), widest) if max_n < n <= widest
            )
            context = max(1, min(64, self.scheduler.max_model_len - max((max_n, *batch_ns)) - 1))
            # NOTE: a verify row at 2,000 tokens of context cost 2.3x one at 200 on an AVX2
            # machine (SmolLM2-135M, 2026-11-26): drafts are priced at each request's length.
            long_context = min(LONG_CONTEXT, self.scheduler.max_model_len - 16)
            return measure_verify_cost(
                target, kv, slot, max_n, context, batch_ns=batch_ns, long_context=long_context
            )
        finally:
            kv.free(slot)

    # ---- request lifecycle ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """The drafter sets the request up; if it raises, whatever it kept is dropped and
        ``DrafterError`` says so (the request must not be queued)."""
        if self.dormant:
            return
        try:
            self.proposer.add_request(req.req_id)
        except Exception as e:  # noqa: BLE001 - the drafter's fault, reported as the engine's
            self._drafter_fault(req.req_id, "add_request", e)
            self._proposer_remove(req.req_id, None)
            raise DrafterError(
                f"the drafter could not take request {req.req_id!r} ({type(e).__name__})"
            ) from e

    def remove_request(self, req: Request, keep: bool) -> None:
        """``keep=False``: nothing of the request is learnt (a failed request). Never raises: a
        drafter that fails here is logged and counted, and the request is forgotten anyway."""
        if self.dormant:
            return
        self._shadow.pop(req.req_id, None)
        self._hidden.pop(req.req_id, None)
        if self.controller is not None:
            self.controller.remove_request(req.req_id)
        if self.spread is not None:
            self.spread.remove(req.req_id)
        if req.req_id in self._drafter_off:
            self._drafter_off.discard(req.req_id)  # the drafter forgot it when switched off
            return
        self._proposer_remove(req.req_id, req.all_token_ids if keep else None)

    def _proposer_remove(self, req_id: str, token_ids: list[int] | None) -> None:
        try:
            self.proposer.remove_request(req_id, token_ids)
        except Exception as e:  # noqa: BLE001 - whatever it kept of the request may leak
            self._drafter_fault(req_id, "remove_request", e)

    def _drafter_fault(self, req_id: str, where: str, e: Exception, then: str = "") -> None:
        """Count a drafter fault and log it: one line, the exception's type only (its message
        may quote the request's text or the drafter's state)."""
        self.num_drafter_failures += 1
        logger.warning(
            "request %r: the drafter's %s raised %s%s", req_id, where, type(e).__name__, then
        )

    def _switch_off(self, r: Request, e: Exception) -> None:
        """The drafter raised for this request: plain decoding for it from now on (exact: the
        output is what it would have been), and the drafter forgets it."""
        self._drafter_fault(r.req_id, "propose", e, "; drafting switched off for it")
        r.draft_token_ids, r.draft_probs = [], None
        self._drafter_off.add(r.req_id)
        self._shadow.pop(r.req_id, None)
        self._hidden.pop(r.req_id, None)
        self._proposer_remove(r.req_id, None)

    def reset_cache(self) -> None:
        """Forget what finished requests taught speculation (suffix decoding's global tree, the
        controller's learnt costs and rates); running requests keep their drafter state."""
        self.proposer.reset_cache()
        if self.controller is not None:
            self._new_controller()
        if self.spread is not None:
            self.spread = ExpertSpread(
                self.spread.num_experts, self.spread.top_k, requests=self.spread.requests
            )

    def _new_controller(self) -> None:
        """A controller starting from the start-up cost curve; the proposer prices with its cost."""
        self.controller = SpecController(self.max_k, copy.deepcopy(self._measured_cost))
        self.proposer.cost_model = self.controller.cost

    # ---- the step -----------------------------------------------------------------------------
    def step(
        self,
        sched: SchedulerOutput,
        results: list[StepResult],
        hidden: list[torch.Tensor | None],
        update: SchedulerUpdate,
        requests: dict[str, Request],
    ) -> None:
        """Learn from this step's verification, then propose the next drafts."""
        if self.dormant:
            return
        self._observe(sched, results, hidden, requests)
        for req, keep in update.finished:
            self.remove_request(req, keep)
        if self.enabled:
            self._propose()

    def _observe(
        self,
        sched: SchedulerOutput,
        results: list[StepResult],
        hidden: list[torch.Tensor | None],
        requests: dict[str, Request],
    ) -> None:
        for i, (s, result) in enumerate(zip(sched.scheduled, results)):
            req = requests[s.req_id]
            if result is not None and not isinstance(result, VerifyResult):
                continue  # failed
            num_valid = len(s.token_ids)
            if isinstance(result, VerifyResult):
                num_valid += result.num_accepted - s.num_drafts
                # NOTE: drafts accepted past a stop (EOS inside an accepted run) are not output:
                # the request's figures count the accepted drafts it returns
                num_kept = min(result.num_accepted, req.num_step_committed)
                req.spec_stats.observe(s.num_drafts, num_kept)
                self.stats.observe(s.num_drafts, num_kept)
                # NOTE: grammar-forced drafts come last; the controller learns the drafter's
                num_model = s.num_drafts - s.num_forced_drafts
                if s.num_forced_drafts:
                    forced_ok = max(0, num_kept - num_model)
                    req.spec_stats.observe_grammar(s.num_forced_drafts, forced_ok)
                    self.stats.observe_grammar(s.num_forced_drafts, forced_ok)
                if self.controller is not None and num_model:
                    self.controller.observe(
                        s.req_id, num_model, min(result.num_accepted, num_model)
                    )
            if hidden and hidden[i] is not None and s.req_id not in self._drafter_off:
                self._keep_hidden(s.req_id, s.start_pos, hidden[i][:num_valid])
            if s.req_id in self._shadow and not req.is_finished:
                self._score_shadow(req)
        if self.controller is not None:
            decode_only = all(
                isinstance(r, VerifyResult) and len(s.token_ids) == 1 + s.num_drafts
                for s, r in zip(sched.scheduled, results)
            )
            num_drafts = sum(s.num_drafts for s in sched.scheduled)
            num_tokens = sum(len(r.token_ids) for r in results if isinstance(r, VerifyResult))
            distinct = None
            if self.spread is not None and self.enabled:
                distinct = self._observe_experts(sched, results)
            self.controller.observe_step(
                len(sched.scheduled), num_drafts, num_tokens, decode_only, distinct
            )

    def _observe_experts(self, sched: SchedulerOutput, results: list[StepResult]) -> float | None:
        """Mixture of experts: each request's rows of this step teach its expert spread; returns
        the distinct experts per MoE layer the step's rows touched."""
        routes = latest_routes(self._moe)  # [T, L, k]
        for block in self._moe:
            block.last_ids = None  # NOTE: read once: a step without a forward finds none
        sizes = [len(s.token_ids) for s in sched.scheduled]
        if routes is None or routes.shape[0] != sum(sizes):
            return None  # NOTE: a failed batch ran its requests one by one
        step, start = None, 0
        for s, r, n in zip(sched.scheduled, results, sizes):
            rows, start = routes[start : start + n], start + n
            if r is None or isinstance(r, VerifyResult):
                num_valid = n + (r.num_accepted - s.num_drafts if r is not None else 0)
                touched = self.spread.observe(s.req_id, rows, num_valid, n == 1 + s.num_drafts)
            else:  # failed
                touched = expert_mask(rows, self.spread.num_experts)
            step = touched if step is None else step | touched
        return np.count_nonzero(step) / step.shape[0] if step is not None else None

    def _keep_hidden(self, req_id: str, start: int, rows: torch.Tensor) -> None:
        pending = self._hidden.get(req_id)
        if pending is None or pending.end != start:
            # NOTE: a gap (nothing computed for a prefix-cache hit) or a rewind starts afresh.
            pending = self._hidden[req_id] = _Hidden(start)
        pending.append(rows)

    def _score_shadow(self, req: Request) -> None:
        """Score unverified drafts against the tokens generated since they were proposed: once
        one differs, or all have arrived, the controller learns from them as from a verification
        (greedy: the same test; sampling: a point-mass draft survives with probability p(token),
        the chance that the sampled token equals it)."""
        shadow = self._shadow[req.req_id]
        drafts = shadow.draft_token_ids
        arrived = req.token_ids_from(shadow.start)
        m = accepted_prefix(drafts, arrived)
        if m < len(arrived) or m == len(drafts):
            self.controller.observe(req.req_id, len(drafts), m)
            del self._shadow[req.req_id]

    def _propose(self) -> None:
        ctl = self.controller
        if ctl is not None:
            ctl.end_cycle()
        sched = self.scheduler
        limit = self.spec.disable_by_batch_size
        if limit is not None and len(sched.running) > limit:
            return
        reqs = [r for r in sched.running if not r.is_prefilling]
        if not reqs:
            return
        if ctl is not None and self._next_step_prefills(len(reqs)):
            # NOTE: prompt chunks fill the next step already; on a CPU the forward is then
            # compute-bound, so drafts would cost a full row each and delay those prompts.
            return
        if ctl is not None and self._resting(reqs):
            for r in reqs:
                if r.grammar is not None and not r.is_finished:
                    self._constrain(r)  # NOTE: the drafts a grammar forces cost no drafter
            return
        k = self.max_k
        # NOTE: each request's own settings bound what the controller may choose: its cap
        # (SamplingParams.num_speculative_tokens, 0 = off) and its n_min (speculative_n_min, by
        # default draft_min): fewer drafts are not verified, so a smaller limit or choice is 0.
        n_mins = {
            r.req_id: self.spec.draft_min
            if r.sampling.speculative_n_min is None
            else r.sampling.speculative_n_min
            for r in reqs
        }
        limits = []
        for r in reqs:
            own = r.sampling.num_speculative_tokens
            lim = min(k if own is None else min(k, own), sched.max_drafts(r, k))
            if r.req_id in self._drafter_off:
                lim = 0
            limits.append(lim if lim >= max(1, n_mins[r.req_id]) else 0)
        caps = limits
        free = self.proposer.free_drafts
        if ctl is not None:
            caps = ctl.choose(
                [r.req_id for r in reqs],
                limits,
                [r.num_tokens for r in reqs],
                free=free,
                confident=self.proposer.confident_drafts,
                spreads=None
                if self.spread is None
                else [self.spread.predict(r.req_id, lim + 1) for r, lim in zip(reqs, limits)],
            )
            caps = [cap if cap >= n_mins[r.req_id] else 0 for r, cap in zip(reqs, caps)]
            for r, cap in zip(reqs, caps):
                predicted = ctl.predicted(r.req_id)
                r.spec_stats.observe_choice(cap, predicted)
                self.stats.observe_choice(cap, predicted)
        todo = [(r, cap) for r, cap in zip(reqs, caps) if cap > 0]
        if ctl is not None:
            self._rest_after(reqs, bool(todo))
        shadow: list[tuple[Request, int]] = []
        if ctl is not None and free:
            for r, cap, lim in zip(reqs, caps, limits):
                if cap > 0:
                    self._shadow.pop(r.req_id, None)  # verified drafts tell the controller the same
                elif lim > 0 and r.req_id not in self._shadow:
                    shadow.append((r, lim))
        if todo or shadow:
            self._draft(todo, shadow)
        self._cut_drafts(todo, n_mins)
        for r, _ in shadow:
            if r.draft_token_ids:
                self._shadow[r.req_id] = _Shadow(r.draft_token_ids, r.num_tokens)
            r.draft_token_ids, r.draft_probs = [], None
        if ctl is not None:
            drafted = {r.req_id: len(r.draft_token_ids) for r, _ in todo}
            live = [r for r in reqs if not r.is_finished]  # drafting may have failed some
            ctl.observe_drafts([r.req_id for r in live], [drafted.get(r.req_id, 0) for r in live])
        for r in reqs:
            if r.grammar is not None and not r.is_finished:
                self._constrain(r)

    def _resting(self, reqs: list[Request]) -> bool:
        """Whether this batch rests this step (``REST_MAX``): no drafts, nothing asked."""
        batch = tuple(r.req_id for r in reqs)
        if len(reqs) < 2 or batch != self._rest_batch:
            self._rest_batch, self._rest_left, self._rest_len = batch, 0, 0
            return False
        if self._rest_left > 0:
            self._rest_left -= 1
            return True
        return False

    def _rest_after(self, reqs: list[Request], drafted: bool) -> None:
        """After a choice for a batch: none drafted, rest twice as long as last time."""
        if drafted or len(reqs) < 2:
            self._rest_len = 0
            return
        self._rest_len = min(2 * self._rest_len or 1, REST_MAX)
        self._rest_left = self._rest_len

    def _cut_drafts(self, todo: list[tuple[Request, int]], n_mins: dict[str, int]) -> None:
        """llama.cpp's p_min: drafting stops where the draft distribution's top probability falls
        below it (a rule on the prefix, so Leviathan/Chen acceptance stays exact); point-mass
        drafts (no q) shorter than n_min are dropped (sample-and-match is exact for any drafts).
        NOTE: q drafts cut below n_min stay: dropping them would make keeping draft i depend on
        draft i itself."""
        for r, _ in todo:
            p_min = self.spec.draft_p_min
            if r.sampling.speculative_p_min is not None:
                p_min = r.sampling.speculative_p_min
            q, n = r.draft_probs, len(r.draft_token_ids)  # q: [n, V] or None
            if p_min > 0 and q is not None and n:
                weak = (q[:n].max(dim=-1).values < p_min).nonzero()
                n = int(weak[0]) if weak.numel() else n
            if q is None and n < n_mins[r.req_id]:
                n = 0
            if n < len(r.draft_token_ids):
                r.draft_token_ids = r.draft_token_ids[:n]
                r.draft_probs = q[:n] if q is not None and n else None

    def _constrain(self, r: Request) -> None:
        """Structured output: cut the drafts where the grammar rejects one (never verified),
        then append the tokens the grammar forces after them (a schema's next key, closing
        braces) as drafts no model had to compute."""
        grammar = r.grammar
        drafts = r.draft_token_ids
        n = grammar.valid_prefix(drafts)
        if n < len(drafts):
            r.draft_token_ids = drafts = drafts[:n]
            r.draft_probs = r.draft_probs[:n] if r.draft_probs is not None and n else None
        if r.sampling.num_speculative_tokens == 0:
            return
        room = min(MAX_FORCED_DRAFTS, self.scheduler.max_drafts(r, MAX_FORCED_DRAFTS) - n)
        forced = grammar.forced_after(drafts, room)
        if not forced:
            return
        if r.draft_probs is not None:
            # NOTE: a forced draft was "sampled" from a point mass: q = one-hot keeps the
            # Leviathan/Chen test exact for the rows after the drafter's
            q = torch.zeros(len(forced), r.draft_probs.shape[-1], dtype=r.draft_probs.dtype)
            q[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
            r.draft_probs = torch.cat([r.draft_probs[:n], q.to(r.draft_probs.device)])
        r.draft_token_ids = drafts + forced
        r.num_forced_drafts = len(forced)

    def _next_step_prefills(self, num_decoding: int) -> bool:
        """A running request is still prefilling, or a waiting one will be admitted."""
        sched = self.scheduler
        if num_decoding < len(sched.running):
            return True
        return bool(
            sched.waiting and len(sched.running) < sched.max_num_seqs and sched.kv.num_free_slots
        )

    def _draft_request(self, r: Request, cap: int, shadow: bool = False) -> DraftRequest:
        d = DraftRequest(
            r.req_id, r.all_token_ids, cap, r.sampling, r.seed, len(r.prompt_token_ids)
        )
        d.shadow, d.cache_salt = shadow, r.cache_salt
        pending = self._hidden.get(r.req_id)
        if pending is not None and pending.rows:
            rows = pending.rows[0] if len(pending.rows) == 1 else torch.cat(pending.rows)
            d.hidden_states, d.hidden_start = rows, pending.start
            self._hidden[r.req_id] = _Hidden(pending.end)
        return d

    def _draft(
        self, todo: list[tuple[Request, int]], shadow: list[tuple[Request, int]] = ()
    ) -> None:
        """Drafts for ``todo`` (to verify) and ``shadow`` (to score only), in one call."""
        inp = DraftInput(
            [self._draft_request(r, cap) for r, cap in todo]
            + [self._draft_request(r, cap, shadow=True) for r, cap in shadow]
        )
        todo = [*todo, *shadow]
        try:
            out = self.proposer.propose(inp)
        except Exception:  # noqa: BLE001 - find whose drafting fails, switch off only those
            self._draft_one_by_one(inp, todo)
            return
        for i, (r, _) in enumerate(todo):
            r.draft_token_ids = list(out.draft_token_ids[i])
            r.draft_probs = out.draft_probs[i] if out.draft_probs else None

    def _draft_one_by_one(self, inp: DraftInput, todo: list[tuple[Request, int]]) -> None:
        """The batch's call raised: each request alone, and those whose drafting still raises
        go on without drafts (``_switch_off``), the others with theirs."""
        for d, (r, _) in zip(inp.requests, todo):
            try:
                out = self.proposer.propose(DraftInput([d]))
            except Exception as e:  # noqa: BLE001
                self._switch_off(r, e)
                continue
            r.draft_token_ids = list(out.draft_token_ids[0])
            r.draft_probs = out.draft_probs[0] if out.draft_probs else None
