"""AsyncLLM: the engine on a background thread, driven from asyncio.

The engine is not thread-safe, so one thread owns it. Callers never touch it: ``add`` and
``abort`` become commands on a queue that the thread drains before every step, and each step's
outputs travel back to the caller's event loop with ``call_soon_threadsafe``. When nothing is
running the thread sleeps on a condition variable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specdec.config import EngineConfig, SpeculativeConfig
from specdec.engine.delegation import Delegated, delegated_method
from specdec.engine.executor import ExecutorError
from specdec.engine.llm_engine import LLMEngine
from specdec.metrics import EngineMetrics
from specdec.model.tokenizer import Tokenizer
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.structured.compile_worker import PARENT_STACK_BYTES, start_thread
from specdec.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

DEFAULT_LOG_INTERVAL_S = 10.0


class EngineError(RuntimeError):
    """The engine failed while running this request (the server keeps serving others)."""


class EngineDeadError(EngineError):
    """The engine loop stopped or cannot recover, or the server is shutting down: no request can
    be served."""


class RequestFailed(EngineError):
    """The engine failed this one request (finish_reason "error"); the others go on."""

    def __init__(self, req_id: str, message: str) -> None:
        super().__init__(message)
        self.req_id = req_id


_ACCEPTED = object()  # queue marker: add_request succeeded
_DELTA_FIELDS = tuple(
    f.name for f in dataclasses.fields(RequestOutput) if f.name.startswith("delta_")
)


class RequestStream:
    """The outputs of one request, as an async iterator; ``abort()`` or cancelling stops it.

    When the consumer falls behind, queued outputs are merged into one (deltas concatenated), so a
    slow client costs one chunk per read, not one per engine step.
    """

    def __init__(self, req_id: str, owner: AsyncLLM) -> None:
        self.req_id = req_id
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self.finished = False

    # ---- engine-thread side ----------------------------------------------------------------
    def put_threadsafe(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass

    # ---- caller side -------------------------------------------------------------------------
    async def _wait_accepted(self) -> None:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = self._check(await self._queue.get())
        while not out.finished and not self._queue.empty():
            nxt = self._check(self._queue.get_nowait())
            # every delta_* field: a merged output must carry each step's delta (provenance too)
            deltas = {f: getattr(out, f) + getattr(nxt, f) for f in _DELTA_FIELDS}
            out = dataclasses.replace(nxt, **deltas)
        self.finished = out.finished
        return out

    def _check(self, item: object) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert isinstance(item, RequestOutput)
        return item

    def abort(self) -> None:
        """Stop the request and free its KV slot (no-op once it finished)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.req_id)


@dataclass
class _Add:
    req_id: str
    prompt: str | list[int]
    sampling: SamplingParams
    stream: RequestStream
    cache_salt: str | None = None


@dataclass
class _Abort:
    req_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    done: Callable[[object], None]


class AsyncLLM:
    """``async for out in llm.generate(prompt, sampling): ...`` with the engine on its own thread."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        log_stats: bool = True,
        log_interval: float = DEFAULT_LOG_INTERVAL_S,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_stats = log_stats
        self.log_interval = log_interval
        self._cv = threading.Condition()
        self._commands: list[_Add | _Abort | _Call] = []
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stop = False
        self.dead_error: BaseException | None = None
        self._refusing: str | None = None  # set by abort_all: why new requests are refused
        self._thread: threading.Thread | None = None
        self._log = _StatsLog(engine)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> AsyncLLM:
        return cls(LLMEngine(config), **kwargs)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        # NOTE: the engine thread drives grammar matchers: 16x the stack they were checked on
        self._thread = start_thread(self._run, "specdec-engine", PARENT_STACK_BYTES)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.shutdown()  # NOTE: tensor-parallel workers end with the engine

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ---- what the server reads of the engine (fixed at load, or thread-safe) ---------------
    tokenizer = Delegated[Tokenizer]("engine.tokenizer")
    max_model_len = Delegated[int]("engine.max_model_len")
    vocab_size = Delegated[int]("engine.vocab_size")
    prefix_caching = Delegated[bool](
        "engine.prefix_caching",
        "Whether prompts' KV is shared through the prefix cache (n / best_of warm-ups).",
    )
    speculative_config = Delegated[SpeculativeConfig | None]("engine.spec")
    grammar_compiler = Delegated[GrammarCompiler](
        "engine.grammar_compiler",
        "Structured-output constraints compile here, off the engine thread (thread-safe).",
    )
    bad_words = delegated_method(
        "engine",
        LLMEngine.bad_words,
        "``words`` tokenized for ``SamplingParams.compiled_bad_words`` (thread-safe).",
    )
    describe_kv_cache = delegated_method("engine", LLMEngine.describe_kv_cache)

    # ---- the public API ----------------------------------------------------------------------
    async def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        req_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it (raises its ValueError if not).

        ``cache_salt`` (vLLM's): cached prefixes are shared only between requests with the same
        salt. A request the engine fails alone ends its stream with ``RequestFailed``.
        """
        if self._refusing is not None:
            raise EngineDeadError(self._refusing)
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error or 'stopped'}")
        stream = RequestStream(req_id or f"req-{uuid.uuid4().hex}", self)
        self._submit(_Add(stream.req_id, prompt, sampling, stream, cache_salt))
        try:
            await stream._wait_accepted()
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        req_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step; closing or cancelling the iterator aborts it."""
        stream = await self.add_request(prompt, sampling, req_id, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, req_id: str) -> None:
        self._submit(_Abort(req_id))

    async def abort_all(self, reason: str) -> int:
        """Refuse new requests from now on and end every running one: its stream raises
        ``EngineDeadError(reason)``. Returns how many were ended (for a graceful shutdown)."""
        self._refusing = reason
        if not self.is_running:
            return 0
        ended = await self.call(lambda engine: self._fail_all(EngineDeadError(reason)))
        assert isinstance(ended, int)
        return ended

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the engine thread between steps (for inspection and tests)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()

        def done(result: object) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

            loop.call_soon_threadsafe(settle)

        self._submit(_Call(fn, done))
        return await fut

    def _submit(self, cmd: _Add | _Abort | _Call) -> None:
        with self._cv:
            if not self._stop:
                self._commands.append(cmd)
                self._cv.notify()
                return
        error = EngineDeadError(f"the engine is not running: {self.dead_error or 'stopped'}")
        if isinstance(cmd, _Add):
            cmd.stream.put_threadsafe(error)
        elif isinstance(cmd, _Call):
            cmd.done(error)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (
                        self._stop or self._commands or self.engine.has_unfinished_requests()
                    ):
                        self._cv.wait()
                    if self._stop:
                        break
                    commands, self._commands = self._commands, []
                self._apply(commands)
                if self.engine.has_unfinished_requests():
                    self._step()
                if self.metrics is not None:
                    self.metrics.update(self.engine)
                if self.log_stats:
                    self._log.maybe_log(self.log_interval)
        except BaseException as e:  # noqa: BLE001 - report, then refuse new work
            if isinstance(e, ExecutorError):  # a worker gone: one line, then refuse (503)
                logger.error("engine stopped: %s", e)
                self.engine.shutdown()
            else:
                logger.exception("engine loop crashed")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"engine loop crashed: {e}"))
        finally:
            self._fail_all(EngineDeadError("the engine is shutting down"))
            self._reject_pending(EngineDeadError("the engine is shutting down"))

    def _reject_pending(self, error: BaseException) -> None:
        with self._cv:
            self._stop = True
            commands, self._commands = self._commands, []
        for cmd in commands:
            if isinstance(cmd, _Add):
                cmd.stream.put_threadsafe(error)
            elif isinstance(cmd, _Call):
                cmd.done(error)

    def _apply(self, commands: list[_Add | _Abort | _Call]) -> None:
        for cmd in commands:
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.req_id)
            else:
                try:
                    cmd.done(cmd.fn(self.engine))
                except Exception as e:  # noqa: BLE001 - goes back to the caller
                    cmd.done(e)

    def _add(self, cmd: _Add) -> None:
        if self._refusing is not None:  # queued before abort_all, applied after it
            cmd.stream.put_threadsafe(EngineDeadError(self._refusing))
            return
        try:
            self.engine.add_request(cmd.prompt, cmd.sampling, cmd.req_id, cmd.cache_salt)
        except Exception as e:  # noqa: BLE001 - the caller's error, not the engine's
            cmd.stream.put_threadsafe(e)
            return
        self._streams[cmd.req_id] = cmd.stream
        cmd.stream.put_threadsafe(_ACCEPTED)

    def _abort(self, req_id: str) -> None:
        stream = self._streams.pop(req_id, None)
        out = self.engine.abort_output(req_id)
        if out is not None:
            if self.metrics is not None:
                self.metrics.observe_finished(out)
            if stream is not None:
                stream.put_threadsafe(out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except ExecutorError:
            raise  # NOTE: the executor is gone: the loop ends and the engine refuses work
        except Exception as e:  # noqa: BLE001 - fail the batch, keep the loop
            logger.exception(
                "engine step failed; failing %d in-flight request(s)", len(self._streams)
            )
            failed = self._fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
            if self.metrics is not None:
                self.metrics.observe_failures(failed)
            return
        for out in outputs:
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        failed = out.finished and out.outputs[0].finish_reason == "error"
        if self.metrics is not None:
            if len(out.outputs[0].token_ids) == len(out.delta_token_ids) and out.delta_token_ids:
                self.metrics.observe_first_token(out)
            if out.finished and not failed:  # NOTE: failures: engine.num_failed_requests
                self.metrics.observe_finished(out)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        if failed:
            # NOTE: the engine has logged the failure (one line with the request id).
            stream.put_threadsafe(RequestFailed(out.request_id, out.error or "request failed"))
        else:
            stream.put_threadsafe(out)

    def _fail_all(self, error: BaseException) -> int:
        """Abort every in-flight request (freeing its KV) and hand ``error`` to its caller;
        returns how many callers got it."""
        streams, self._streams = self._streams, {}
        for req_id, stream in streams.items():
            try:
                self.engine.abort_output(req_id)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                logger.exception("abort of %s failed", req_id)
            stream.put_threadsafe(error)
        for req_id in self.engine.unfinished_request_ids():
            try:  # requests nobody waits for any more (should not exist, but never spin on them)
                self.engine.abort_output(req_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", req_id)
        if self.engine.has_unfinished_requests() and self.dead_error is None:
            self.dead_error = error
            with self._cv:
                self._stop = True
        return len(streams)


class _StatsLog:
    """One line every ``interval`` seconds while busy: throughput, queues, acceptance."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.last_time = time.monotonic()
        self.last = self._snapshot()

    def _snapshot(self) -> tuple[int, int, int, int, int, int]:
        e = self.engine
        return (
            e.num_prompt_tokens,
            e.num_generation_tokens,
            e.spec_stats.num_drafts,
            e.spec_stats.num_accepted_tokens,
            e.num_prefix_cache_queries,
            e.num_prefix_cache_hits,
        )

    def maybe_log(self, interval: float) -> None:
        now = time.monotonic()
        if now - self.last_time < interval:
            return
        snap = self._snapshot()
        if snap == self.last and not self.engine.has_unfinished_requests():
            self.last_time = now  # idle: nothing to report
            return
        dt = now - self.last_time
        prompt, gen, drafts, accepted, queries, hits = (a - b for a, b in zip(snap, self.last))
        e = self.engine
        accept = f"{1.0 + accepted / drafts:.2f}" if drafts else "n/a"
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, "
            "waiting: %d, KV cache usage: %.0f%%, prefix cache hit rate: %.0f%%, "
            "mean acceptance length: %s",
            prompt / dt, gen / dt, e.num_running, e.num_waiting, 100.0 * e.kv_cache_usage,
            100.0 * hits / queries if queries else 0.0, accept,
        )  # fmt: skip
        self.last_time, self.last = now, snap
