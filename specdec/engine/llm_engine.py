"""The engine: add_request / abort_request / step()."""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import random
import time

import torch

from specdec.config import ConfigError, EngineConfig, SpeculativeConfig
from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.engine.request import Request
from specdec.engine.scheduler import Scheduler
from specdec.kernels import get_ops
from specdec.kv_cache.pool import KVCache
from specdec.model.llama import LlamaModel
from specdec.model.loader import load_checkpoint
from specdec.model.registry import resolve_model_path
from specdec.model.tokenizer import Tokenizer
from specdec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specdec.sample.random import normalize_seed
from specdec.sample.rejection_sampler import PenaltyState, VerifyResult
from specdec.sampling_params import SamplingParams
from specdec.spec_decode import PROPOSERS, DraftInput, DraftRequest, Proposer
from specdec.spec_decode.controller import SpecController, measure_verify_cost
from specdec.spec_decode.metrics import SpecDecodeStats
from specdec.worker.model_runner import ModelRunner, RequestFailure, failure

logger = logging.getLogger("specdec.engine")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": torch.float32,
}
DEFAULT_MAX_MODEL_LEN = 4096
# Prefix cache slots beyond the running ones: without kv_cache_memory, this many, no more than fit
# (each full) in this fraction of the available RAM; with it, what the budget holds, up to the cap.
DEFAULT_PREFIX_CACHE_SLOTS = 32
DEFAULT_PREFIX_CACHE_RAM_FRACTION = 0.25
MAX_PREFIX_CACHE_SLOTS = 256


def load_model(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    kernels: str,
    quantization: str,
    max_len: int | None,
    activation_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
) -> tuple[LlamaModel, Tokenizer]:
    path = resolve_model_path(model)
    ckpt = load_checkpoint(path)
    if ckpt.gguf_metadata is not None:
        tokenizer = Tokenizer.from_gguf_metadata(ckpt.gguf_metadata)
    else:
        tokenizer = Tokenizer.from_hf_folder(path)
    if dtype != torch.float32 and kernels == "native":
        raise ConfigError(
            "native kernels run float32 only; use --kernels torch for bfloat16/float16"
        )
    ops = get_ops("torch" if dtype != torch.float32 else kernels, device)
    limit = ckpt.arch.max_position_embeddings
    max_len = max_len or min(DEFAULT_MAX_MODEL_LEN, limit)
    if max_len > limit:
        raise ConfigError(f"max_model_len {max_len} exceeds the model's context length {limit}")
    model = LlamaModel(ckpt, ops, device, dtype, quantization, max_len, activation_dtype)
    model.set_kv_dtype(kv_cache_dtype)
    return model, tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        dtype = _DTYPES[config.dtype]
        self.model, self.tokenizer = load_model(
            config.model,
            self.device,
            dtype,
            config.kernels,
            config.quantization,
            config.max_model_len,
            config.activation_dtype,
            config.kv_cache_dtype,
        )
        self.max_model_len = self.model.max_len
        num_running_slots, num_cache_slots = self._num_kv_slots(config)
        self.kv = self.model.make_kv_cache(num_running_slots + num_cache_slots, self.max_model_len)
        self.kv.enable_prefix_caching = config.enable_prefix_caching
        self.scheduler = Scheduler(
            self.kv, num_running_slots, config.max_num_batched_tokens, self.max_model_len
        )
        # NOTE: requests without a seed draw one here, at admission, and then take the same
        # keyed path as seeded ones.
        self._seeds = random.Random(config.seed)
        self.runner = ModelRunner(self.model, self.kv)
        self.spec: SpeculativeConfig | None = config.speculative
        self.proposer: Proposer | None = None
        if self.spec is not None:
            self.proposer = PROPOSERS[self.spec.method](
                self.spec, self.model, self._load_draft, config.max_num_seqs, self.max_model_len
            )
        self.controller: SpecController | None = None
        if self.spec is not None and self.spec.adaptive:
            self.controller = self._make_controller()
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecDecodeStats()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_failed_requests = 0  # finished with finish_reason "error"
        self._failed: list[Request] = []  # this step's
        self._ids = itertools.count()

    def _num_kv_slots(self, config: EngineConfig) -> tuple[int, int]:
        """Slots of max_model_len positions: (for running sequences, extra for the prefix cache).

        Running sequences get max_num_seqs slots, fewer if kv_cache_memory holds fewer. Prefix
        caching adds the slots the rest of that budget holds (at most MAX_PREFIX_CACHE_SLOTS),
        or without a budget DEFAULT_PREFIX_CACHE_SLOTS, no more than fit in
        DEFAULT_PREFIX_CACHE_RAM_FRACTION of the RAM available now.

        NOTE: slots are reserved virtually (torch.empty); pages are committed as sequences grow
        and stay committed, so every slot is counted at its full max_model_len: the most it can
        commit. A cached slot holds the pages its last sequence wrote.
        """
        cfg = self.model.cfg
        per_slot = self.max_model_len * KVCache.bytes_per_token(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.model.kv_dtype
        )
        if config.kv_cache_memory is None:
            num_running = config.max_num_seqs
            num_cache = 0
            if config.enable_prefix_caching:
                import psutil

                ram = DEFAULT_PREFIX_CACHE_RAM_FRACTION * psutil.virtual_memory().available
                num_cache = min(DEFAULT_PREFIX_CACHE_SLOTS, int(ram // per_slot))
            return num_running, num_cache
        budget = config.kv_cache_memory
        if budget <= 1:
            import psutil

            budget *= psutil.virtual_memory().available
        slots = int(budget // per_slot)
        if slots < 1:
            raise ConfigError(
                f"kv_cache_memory {int(budget)} bytes holds no sequence of max_model_len "
                f"{self.max_model_len} ({per_slot} bytes); raise it or lower max_model_len"
            )
        num_running = min(slots, config.max_num_seqs)
        num_cache = min(slots - num_running, MAX_PREFIX_CACHE_SLOTS)
        return num_running, num_cache if config.enable_prefix_caching else 0

    def _make_controller(self) -> SpecController:
        """Measure the verification cost curve once, on a free slot, before any request."""
        k = self.spec.num_speculative_tokens
        slot = self.kv.allocate()
        try:
            # The curve up to one request's k + 1 tokens, then up to a full batch with drafts.
            # One slot holds context + the widest row count: keep both within max_model_len.
            max_n = max(k + 1, 4)
            widest = min(
                self.scheduler.max_num_seqs * (k + 1),
                self.config.max_num_batched_tokens,
                self.max_model_len // 2,
            )
            batch_ns = tuple(
                n for n in (2 * (k + 1), 4 * (k + 1), 8 * (k + 1), widest) if max_n < n <= widest
            )
            context = max(1, min(64, self.max_model_len - max((max_n, *batch_ns)) - 1))
            cost = measure_verify_cost(self.model, self.kv, slot, max_n, context, batch_ns=batch_ns)
        finally:
            self.kv.free(slot)
        self._measured_cost = copy.deepcopy(cost)
        return SpecController(k, cost)

    def _load_draft(self, spec: SpeculativeConfig) -> LlamaModel:
        draft, draft_tok = load_model(
            spec.model, self.device, self.model.dtype, self.config.kernels,
            spec.draft_quantization or self.config.quantization, self.max_model_len,
            self.config.activation_dtype, self.config.kv_cache_dtype,
        )  # fmt: skip
        if (
            draft.cfg.vocab_size != self.model.cfg.vocab_size
            or draft_tok.vocab_size != self.tokenizer.vocab_size
        ):
            raise ConfigError(
                f"speculative_config.model: the draft's vocabulary ({draft.cfg.vocab_size}) differs from "
                f"the target's ({self.model.cfg.vocab_size}); draft and target must share a tokenizer"
            )
        return draft

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        req_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request. ``cache_salt`` (vLLM's): prompts share cached prefixes only with
        requests of the same salt. Raises ValueError (the queue unchanged) for a bad request."""
        return self.enqueue(self.make_request(prompt, sampling, req_id, cache_salt))

    def make_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        req_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A checked request, not yet queued (``enqueue`` queues it)."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, not {type(sampling).__name__}"
            )
        sampling.validate()  # NOTE: fields may have been changed since it was made
        req_id = req_id or f"req-{next(self._ids)}"
        text = prompt if isinstance(prompt, str) else None
        ids = self._prompt_ids(prompt)
        self._check_prompt(ids)
        req = Request(
            req_id=req_id,
            prompt=text,
            prompt_token_ids=ids,
            sampling=sampling,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, sampling.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=time.monotonic()),
        )
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(64)
        req.seed = normalize_seed(seed)
        if sampling.has_penalties:
            vocab = self.model.cfg.vocab_size
            mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            mask[torch.tensor(ids, device=self.device)] = True
            req.penalty = PenaltyState(mask, torch.zeros(vocab, device=self.device))
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError("cache_salt must be a non-empty string")
            digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()
            req.cache_salt = int.from_bytes(digest[:8], "little", signed=True) or 1
        return req

    def enqueue(self, req: Request) -> str:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.requests[req.req_id] = req
        self.scheduler.add(req)
        if self.proposer is not None:
            self.proposer.add_request(req.req_id)
        self.num_prompt_tokens += len(req.prompt_token_ids)
        return req.req_id

    def _prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, not {type(prompt).__name__}"
        )

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, at or beyond max_model_len {self.max_model_len}"
            )
        vocab = self.model.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def abort_request(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return
        req.finish_reason = "abort"
        self._finish(req)
        self.requests.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the running sequences' KV slots in use (cached prefixes are free)."""
        return self.kv.num_used_slots / max(1, self.scheduler.max_num_seqs)

    @property
    def num_prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)."""
        return self.kv.num_prefix_cache_queries

    @property
    def num_prefix_cache_hits(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (vLLM's prefix_cache_hits)."""
        return self.kv.num_prefix_cache_hits

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks: make a warm-up request leave no trace)."""
        self.kv.reset_prefix_cache()

    def reset_drafter_cache(self) -> None:
        """Forget what finished requests taught speculation (suffix decoding's global tree, the
        adaptive controller's learnt costs and rates), so a benchmark's warm-up or a repeated
        prompt is not measured as a repeated task. Running requests keep their drafter state."""
        if self.proposer is not None:
            self.proposer.reset_cache()
        if self.controller is not None and self.spec is not None:
            self.controller = SpecController(
                self.spec.num_speculative_tokens, copy.deepcopy(self._measured_cost)
            )

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the target once, verify, commit, propose; return what changed."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        out = self.runner.execute_model(sched)
        changed: list[Request] = []
        self._failed = []
        for s, result in zip(sched.scheduled, out.results):
            req = s.req
            if isinstance(result, RequestFailure):
                self._fail(req, result)
                continue
            if result is None:
                req.num_computed_tokens += len(s.token_ids)
                continue
            req.num_computed_tokens += len(s.token_ids) - s.num_drafts + result.num_accepted
            req.spec_stats.observe(s.num_drafts, result.num_accepted)
            self.spec_stats.observe(s.num_drafts, result.num_accepted)
            if self.controller is not None and s.num_drafts:
                self.controller.observe(req.req_id, s.num_drafts, result.num_accepted)
            req.draft_token_ids, req.draft_probs = [], None
            try:
                self._commit(req, result)
            except Exception as e:  # noqa: BLE001 - this request's failure alone
                self._fail(req, failure("detokenizing", e))
                continue
            if req.shadow_draft_ids and not req.is_finished:
                self._score_shadow(req)
            changed.append(req)
        if self.controller is not None:
            decode_only = all(
                isinstance(r, VerifyResult) and len(s.token_ids) == 1 + s.num_drafts
                for s, r in zip(sched.scheduled, out.results)
            )
            num_drafts = sum(s.num_drafts for s in sched.scheduled)
            num_tokens = sum(len(r.token_ids) for r in out.results if isinstance(r, VerifyResult))
            self.controller.observe_step(len(sched.scheduled), num_drafts, num_tokens, decode_only)
        self._propose()
        changed += [r for r in self._failed if r not in changed]
        return [self._make_output(r) for r in changed]

    def _fail(self, req: Request, why: RequestFailure) -> None:
        """Finish one request with an error; its KV is not cached, the others go on."""
        req.error = why.message
        req.finish_reason, req.stop_reason = "error", None
        self.num_failed_requests += 1
        logger.warning("request %r failed: %s", req.req_id, why.message)
        self._finish(req, cache=False)
        self._failed.append(req)

    def _commit(self, req: Request, result: VerifyResult) -> None:
        """Append tokens one by one, stopping at EOS / stop ids / stop strings / length."""
        now = time.monotonic()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        for i, tok in enumerate(result.token_ids):
            req.output_token_ids.append(tok)
            self.num_generation_tokens += 1
            if result.logprobs is not None:
                req.output_logprobs.append(result.logprobs[i])
            if req.penalty is not None:
                req.penalty.output_counts[tok] += 1
            delta = req.detokenizer.add_tokens([tok])
            req.output_text += delta
            if self._check_stop(req, tok, delta):
                if not isinstance(req.stop_reason, str):
                    req.output_text += req.detokenizer.finalize()  # flush held-back bytes
                self._finish(req)
                return

    def _check_stop(self, req: Request, tok: int, delta: str) -> bool:
        sp = req.sampling
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and tok in self.tokenizer.eog_token_ids:
                req.finish_reason, req.stop_reason = "stop", None
                return True
            if tok in sp.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", tok
                return True
            if sp.stop and delta and self._check_stop_strings(req, len(delta)):
                return True
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            req.finish_reason = "length"
            return True
        if req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
            return True
        return False

    def _check_stop_strings(self, req: Request, new_chars: int) -> bool:
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

    def _finish(self, req: Request, cache: bool = True) -> None:
        """``cache=False``: nothing of the request is kept (prefix cache, drafter trees)."""
        req.metrics.finished_time = time.monotonic()
        self.scheduler.finish(req, cache)
        if self.proposer is not None:
            self.proposer.remove_request(req.req_id, req.all_token_ids if cache else None)
        if self.controller is not None:
            self.controller.remove_request(req.req_id)

    def _propose(self) -> None:
        if self.proposer is None or self.spec is None:
            return
        if self.controller is not None:
            self.controller.end_cycle()
        limit = self.spec.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) > limit:
            return
        reqs = [r for r in self.scheduler.running if not r.is_prefilling]
        if not reqs:
            return
        if self.controller is not None and self._next_step_prefills(len(reqs)):
            # NOTE: prompt chunks fill the next step already; on a CPU the forward is then
            # compute-bound, so drafts would cost a full row each and delay those prompts.
            return
        k = self.spec.num_speculative_tokens
        caps = limits = [min(k, self.scheduler.max_drafts(r, k)) for r in reqs]
        free = self.proposer.free_drafts
        if self.controller is not None:
            caps = self.controller.choose(
                [r.req_id for r in reqs], limits, [r.num_tokens for r in reqs], all_or_nothing=free
            )
            for r, cap in zip(reqs, caps):
                predicted = self.controller.predicted(r.req_id)
                r.spec_stats.observe_choice(cap, predicted)
                self.spec_stats.observe_choice(cap, predicted)
        todo = [(r, cap) for r, cap in zip(reqs, caps) if cap > 0]
        shadow: list[tuple[Request, int]] = []
        if self.controller is not None and free:
            for r, cap, limit in zip(reqs, caps, limits):
                if cap > 0:
                    r.shadow_draft_ids = []  # verified drafts tell the controller the same
                elif limit > 0 and not r.shadow_draft_ids:
                    shadow.append((r, limit))
        if todo or shadow:
            self._draft(todo + shadow)
        for r, _ in shadow:
            r.shadow_draft_ids, r.shadow_start = r.draft_token_ids, r.num_tokens
            r.draft_token_ids, r.draft_probs = [], None
        if self.controller is not None:
            drafted = {r.req_id: len(r.draft_token_ids) for r, _ in todo}
            live = [r for r in reqs if not r.is_finished]  # drafting may have failed some
            self.controller.observe_drafts(
                [r.req_id for r in live], [drafted.get(r.req_id, 0) for r in live]
            )

    def _next_step_prefills(self, num_decoding: int) -> bool:
        """A running request is still prefilling, or a waiting one will be admitted."""
        sched = self.scheduler
        if num_decoding < len(sched.running):
            return True
        return bool(
            sched.waiting and len(sched.running) < sched.max_num_seqs and self.kv.num_free_slots
        )

    def _score_shadow(self, req: Request) -> None:
        """Score unverified drafts against the tokens generated since they were proposed: once
        one differs, or all have arrived, the controller learns from them as from a verification
        (greedy: the same test; sampling: a point-mass draft survives with probability p(token),
        the chance that the sampled token equals it)."""
        drafts = req.shadow_draft_ids
        arrived = req.token_ids_from(req.shadow_start)
        m = 0
        while m < len(arrived) and m < len(drafts) and arrived[m] == drafts[m]:
            m += 1
        if m < len(arrived) or m == len(drafts):
            self.controller.observe(req.req_id, len(drafts), m)
            req.shadow_draft_ids = []

    def _draft(self, todo: list[tuple[Request, int]]) -> None:
        inp = DraftInput(
            [
                DraftRequest(
                    r.req_id, r.all_token_ids, cap, r.sampling, r.seed, len(r.prompt_token_ids)
                )
                for r, cap in todo
            ]
        )
        try:
            out = self.proposer.propose(inp)
        except Exception:  # noqa: BLE001 - find whose drafting fails, fail only those
            self._draft_one_by_one(inp, todo)
            return
        for i, (r, _) in enumerate(todo):
            r.draft_token_ids = list(out.draft_token_ids[i])
            r.draft_probs = out.draft_probs[i] if out.draft_probs else None

    def _draft_one_by_one(self, inp: DraftInput, todo: list[tuple[Request, int]]) -> None:
        for d, (r, _) in zip(inp.requests, todo):
            try:
                out = self.proposer.propose(DraftInput([d]))
            except Exception as e:  # noqa: BLE001
                self._fail(r, failure("drafting", e))
                continue
            r.draft_token_ids = list(out.draft_token_ids[0])
            r.draft_probs = out.draft_probs[0] if out.draft_probs else None

    # ---- outputs -----------------------------------------------------------------------------
    def _make_output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        text = req.output_text
        if not finished and req.sampling.stop:
            # NOTE: hold back what could be the start of a stop string.
            hold = max(len(s) for s in req.sampling.stop) - 1
            text = text[: max(req.num_streamed_chars, len(text) - hold)]
        delta_text = text[req.num_streamed_chars :]
        req.num_streamed_chars = len(text)
        delta_ids = req.output_token_ids[req.num_streamed_tokens :]
        req.num_streamed_tokens = len(req.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=req.output_text if finished else text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.output_logprobs) if req.sampling.logprobs is not None else None,
        )
        if finished:
            self.requests.pop(req.req_id, None)
        return RequestOutput(
            request_id=req.req_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            spec_decode_stats=req.spec_stats.copy(),
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
        )

    def abort_output(self, req_id: str) -> RequestOutput | None:
        req = self.requests.get(req_id)
        if req is None:
            return None
        self.abort_request(req_id)
        return self._make_output(req)
