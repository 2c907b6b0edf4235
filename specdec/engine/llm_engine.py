"""The engine: add_request / abort_request / step().

``step()`` reads schedule, execute, update, propose, outputs. Around it: the executor that
loads and runs the target on one or many ranks (``engine/executor.py``), loading the draft
(``engine/loading.py``), request building (``engine/processor.py``) and output building
(``engine/output_processor.py``).
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from specdec.config import EngineConfig, KVEventsConfig, SpeculativeConfig
from specdec.engine.core_output import take_core_output
from specdec.engine.delegation import Delegated, delegated_method
from specdec.engine.executor import Executor, make_executor
from specdec.engine.loading import describe_model, load_draft, resolve_dtype
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.processor import Processor
from specdec.engine.request import Request
from specdec.engine.scheduler import Scheduler
from specdec.engine.speculator import Speculator
from specdec.kv_cache.block_events import BlockLog
from specdec.kv_cache.pool import KVCache
from specdec.kv_cache.sizing import describe_pool, plan_kv_slots
from specdec.model.llama import LlamaModel
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.metrics import SpecDecodeStats
from specdec.structured.grammar import GrammarCompiler
from specdec.worker.model_runner import ModelRunner
from specdec.worker.static_runner import scratch_positions, static_step_rows

if TYPE_CHECKING:
    from specdec.engine.kv_events import KVEventPublisher

logger = logging.getLogger("specdec.engine")


_HEAP_FROZEN = False


def _freeze_startup_heap() -> None:
    """As vLLM's engine core and our server: the heap built before the first engine runs (torch,
    the model's modules, the tokenizer) is left out of the collector's later passes, once per
    process. NOTE: a full collection over it paused one step for 60-90 ms (a 2,700-token
    prompt_logprobs read beside a stream, SmolLM2, offline), the stream's longest gap 15-20
    decode steps."""
    global _HEAP_FROZEN
    if not _HEAP_FROZEN:
        _HEAP_FROZEN = True
        gc.collect()
        gc.freeze()


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        dtype, self._kernels = resolve_dtype(config)
        self.executor: Executor = make_executor(config)
        self.model, self.tokenizer = self.executor.load_model(self.device, dtype, self._kernels)
        self.max_model_len = self.model.max_len
        num_running_slots, num_cache_slots = self._num_kv_slots(config)
        self.step_rows = static_step_rows(config, self.model)  # None: no fixed shapes
        scratch = 0
        if self.step_rows is not None:
            # NOTE: a fixed-shape step runs every slot (idle ones as padding): no slots beyond
            # the running ones (freed slots still keep their prefixes for the prefix cache)
            scratch, num_cache_slots = scratch_positions(self.step_rows), 0
        self.kv = self.model.make_kv_cache(
            num_running_slots + num_cache_slots, self.max_model_len + scratch
        )
        self.kv.enable_prefix_caching = config.enable_prefix_caching
        self.kv_events = self._start_kv_events(config.kv_events_config, config.data_parallel_rank)
        self.scheduler = Scheduler(
            self.kv, num_running_slots, config.max_num_batched_tokens, self.max_model_len,
            self.tokenizer.eog_token_ids, config.prefill_time_share,
        )  # fmt: skip
        self.spec: SpeculativeConfig | None = config.speculative
        self.speculator: Speculator | None = None
        if self.spec is not None:
            self.speculator = Speculator(
                self.spec, self.model, self.kv, self.scheduler, self._load_draft,
                config.max_num_batched_tokens,
                None if self.step_rows is None else self.step_rows - 1,
            )  # fmt: skip
        hidden_layers = self.speculator.hidden_layers if self.speculator else ()
        self.executor.init_runner(self.model, self.kv, hidden_layers, self.step_rows)
        self.processor = Processor(
            self.tokenizer, self.model.cfg.vocab_size, self.max_model_len, self.device, config.seed
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens = 0
        _freeze_startup_heap()
        logger.info(
            "engine: %s; %s; max_model_len %d; KV slots: %d running, %d prefix cache; "
            "speculation: %s",
            config.model, describe_model(self.model), self.max_model_len, num_running_slots,
            num_cache_slots,
            f"{self.spec.method} k={self.spec.num_speculative_tokens}" if self.spec else "off",
        )  # fmt: skip

    def _num_kv_slots(self, config: EngineConfig) -> tuple[int, int]:
        """Slots of max_model_len positions: (for running sequences, extra for the prefix
        cache); see ``plan_kv_slots``. Fewer running slots than max_num_seqs are logged."""
        cfg = self.model.cfg
        per_token = KVCache.bytes_per_token(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.model.kv_dtype
        )
        num_running, num_cache = plan_kv_slots(
            self.max_model_len, per_token, config.max_num_seqs, config.enable_prefix_caching,
            config.kv_cache_memory,
        )  # fmt: skip
        if num_running < config.max_num_seqs and config.kv_cache_memory is not None:
            logger.warning(
                "max_num_seqs %d lowered to %d: the KV budget (kv_cache_memory / "
                "gpu_memory_utilization %g) holds %d sequences of max_model_len %d; raise it or "
                "lower max_model_len",
                config.max_num_seqs, num_running, config.kv_cache_memory, num_running,
                self.max_model_len,
            )  # fmt: skip
        return num_running, num_cache

    def _start_kv_events(
        self, events: KVEventsConfig | None, data_parallel_rank: int
    ) -> KVEventPublisher | None:
        """The KV events publisher (engine/kv_events.py), or None (and nothing imported) when
        kv_events_config does not enable it."""
        if events is None or not events.active:
            return None
        if not self.kv.enable_prefix_caching:
            logger.warning("kv_events_config: prefix caching is off, so no block is ever offered")
        from specdec.engine.kv_events import KVEventPublisher

        self.kv.block_log = BlockLog(events.block_size)
        return KVEventPublisher(events, events.block_size, data_parallel_rank)

    def _publish_kv_events(self) -> None:
        """Hand what the KV pool recorded since the last call to the publisher (never waits)."""
        if self.kv_events is not None and self.kv.block_log is not None:
            self.kv_events.publish(self.kv.block_log.drain())

    def _load_draft(self, spec: SpeculativeConfig) -> LlamaModel:
        return load_draft(spec, self.config, self.model, self.tokenizer, self._kernels)

    runner = Delegated[ModelRunner](
        "executor.runner", "Rank 0's model runner (tests and the training data pipeline read it)."
    )

    def shutdown(self) -> None:
        """Stop the executor's workers and the KV events publisher (idempotent)."""
        self.executor.shutdown()
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.shutdown()

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

    make_request = delegated_method(
        "processor",
        Processor.make_request,
        "A checked request, not yet queued (``enqueue`` queues it).",
    )
    grammar_compiler = Delegated[GrammarCompiler]("processor.grammar_compiler")
    bad_words = delegated_method("processor", Processor.bad_words)
    new_request_id = delegated_method("processor", Processor.new_request_id)

    def enqueue(self, req: Request) -> str:
        """Queue a request made by ``make_request``. Raises (nothing queued, nothing kept) for a
        request id in use, or ``DrafterError`` when the drafter cannot take it."""
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        if self.speculator is not None:
            # NOTE: first, so that a drafter fault leaves the request nowhere
            self.speculator.add_request(req)
        self.requests[req.req_id] = req
        self.scheduler.add(req)
        self.output_processor.add_request(req)
        self.num_prompt_tokens += len(req.prompt_token_ids)
        return req.req_id

    def abort_request(self, req_id: str) -> None:
        """Finish a request now (finish_reason "abort"), freeing its KV slot; no-op for an
        unknown or finished one."""
        try:
            self._abort(req_id)
        finally:
            self.output_processor.forget(req_id)

    def _abort(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return
        req.finish_reason = "abort"
        try:
            self.scheduler.finish(req)
            if self.speculator is not None:
                self.speculator.remove_request(req, keep=True)
        finally:
            self.requests.pop(req_id, None)
            self._publish_kv_events()

    def abort_output(self, req_id: str) -> RequestOutput | None:
        """Abort a request and return its last output (None for an unknown request)."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        self._abort(req_id)
        out = self.output_processor.make_output(take_core_output(req))
        self.output_processor.forget(req_id)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished_request_ids(self) -> list[str]:
        """The ids of the requests waiting or running, waiting ones first."""
        return [r.req_id for r in (*self.scheduler.waiting, *self.scheduler.running)]

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute (target forward + verification), update, propose; the outputs."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._publish_kv_events()
            return []
        out = self.executor.execute_model(sched)
        update = self.scheduler.update_from_output(
            sched, out.results, self.requests, out.prompt_logprobs
        )
        self.output_processor.add_prompt_logprobs(sched, out.prompt_logprobs)
        if self.speculator is not None:
            self.speculator.step(sched, out.results, out.hidden_states, update, self.requests)
            if self.executor.hidden_layers and not self.speculator.hidden_layers:
                self.executor.hidden_layers = ()  # the drafter stopped reading the target's states
        outputs = self.output_processor.process_outputs(
            [take_core_output(r) for r in update.changed]
        )
        for r in update.changed:
            if r.is_finished:
                self.requests.pop(r.req_id, None)
        self._publish_kv_events()
        return outputs

    # ---- what callers may read and set (the CLI, LLM, the server) -------------------------
    vocab_size = Delegated[int]("model.cfg.vocab_size")
    max_num_seqs = Delegated[int](
        "scheduler.max_num_seqs", "Sequences that can run at once (KV slots for running requests)."
    )
    prefix_caching = Delegated[bool](
        "kv.enable_prefix_caching",
        "Whether finished prompts' KV is kept for later requests with the same prefix.",
    )

    def describe_kv_cache(self) -> str:
        """One line about the KV pool (sizes, dtype, slots) for the startup log."""
        return describe_pool(self.kv, self.scheduler.max_num_seqs)

    def set_speculation(self, enabled: bool) -> None:
        """Switch drafting on or off for the steps that follow (no-op without a drafter):
        benchmarks time the same engine with and without speculation."""
        if self.speculator is not None:
            self.speculator.enabled = enabled

    def reset_spec_stats(self) -> None:
        """Start the acceptance statistics (``spec_stats``) afresh."""
        if self.speculator is not None:
            self.speculator.stats = SpecDecodeStats()

    # ---- statistics ------------------------------------------------------------------------
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

    num_prefix_cache_queries = Delegated[int](
        "kv.num_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
    )
    num_prefix_cache_hits = Delegated[int](
        "kv.num_prefix_cache_hits",
        "Prompt tokens whose KV came from the prefix cache (vLLM's prefix_cache_hits).",
    )

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks: make a warm-up request leave no trace)."""
        self.kv.reset_prefix_cache()
        self._publish_kv_events()

    def reset_drafter_cache(self) -> None:
        """Forget what finished requests taught speculation (suffix decoding's global tree, the
        adaptive controller's learnt costs and rates), so a benchmark's warm-up or a repeated
        prompt is not measured as a repeated task. Running requests keep their drafter state."""
        if self.speculator is not None:
            self.speculator.reset_cache()

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Acceptance statistics of every request so far (empty without speculation)."""
        return self.speculator.stats if self.speculator is not None else SpecDecodeStats()

    num_generation_tokens = Delegated[int]("scheduler.num_generation_tokens")

    @property
    def num_drafter_failures(self) -> int:
        """Drafter faults: requests whose drafting was switched off, hooks that raised."""
        return self.speculator.num_drafter_failures if self.speculator is not None else 0

    num_failed_requests = Delegated[int](
        "scheduler.num_failed_requests", 'Requests that finished with finish_reason "error".'
    )
