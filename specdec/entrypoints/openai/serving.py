"""The two generation endpoints: request -> prompt ids + SamplingParams -> AsyncLLM -> response.

Everything that can be checked before the engine sees the request is checked here, so a bad
request costs a 400 and nothing else; streaming responses only start once the engine accepted
the request. Parsing, template rendering and tokenization run on a small thread pool (and a
request's own template in a worker process), never on the event loop or the engine's thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from specdec.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineError,
    RequestFailed,
    RequestStream,
)
from specdec.entrypoints.openai.chat_sandbox import TemplateRenderError, TemplateSandbox
from specdec.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptLogprobs,
    PromptTokenUsageInfo,
    RequestError,
    UsageInfo,
    _SamplingRequest,
    dump_chunk,
    now,
    one_line,
    random_id,
)
from specdec.entrypoints.openai.safety import (
    dropped_bytes,
    for_log,
    has_surrogates,
    unrepresentable,
    unrepresentable_error,
)
from specdec.entrypoints.openai.special_tokens import (
    LiteralSpecials,
    SpecialTokenMode,
    effective_mode,
    find_special,
    special_token_error,
)
from specdec.entrypoints.openai.stats import ProvenanceAligner, timings, vllm_spec_metrics
from specdec.entrypoints.openai.tools import ToolPlan, plan_tools
from specdec.entrypoints.openai.tools import template_messages as tool_template_messages
from specdec.model.tokenizer import max_token_chars, prepare_messages
from specdec.outputs import CompletionOutput, PositionLogprobs, RequestOutput, merge_samples
from specdec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
_RESERVED_TEMPLATE_KEYS = ("messages", "add_generation_prompt", "tokenize", "chat_template")
_T = TypeVar("_T")


MAX_REASON_CHARS = 200  # of an engine's error message, in a response


def _engine_error(e: EngineError, req_id: str, req: _SamplingRequest | None = None) -> RequestError:
    """The response for a request the engine could not finish: the engine's reason cut to one
    short line, with the request id (and one log line). A failure the request's own constraint
    caused (its grammar over a limit) is a 400 naming the field."""
    reason = one_line(str(e), MAX_REASON_CHARS)
    if isinstance(e, RequestFailed) and reason.startswith("structured_outputs"):
        if req is not None:
            return req.error_for(reason)
        return RequestError(reason, param=reason.partition(":")[0])
    if isinstance(e, EngineDeadError):
        logger.warning("request %s ended: %s", req_id, for_log(reason))
        return RequestError(reason, status=503, code=None, type="service_unavailable")
    if not isinstance(e, RequestFailed):  # NOTE: the engine logs its per-request failures
        logger.error("request %s failed: %s", req_id, for_log(reason))
    return RequestError(
        f"request {req_id} failed: {reason}", status=500, code=None, type="internal_server_error"
    )


def shutting_down_error() -> RequestError:
    """The answer to a request the server will not admit: it is shutting down."""
    return RequestError(
        "the server is shutting down", status=503, code=None, type="service_unavailable"
    )


def internal_error(e: Exception, req_id: str) -> RequestError:
    """An unexpected exception: one log line with the request id (the traceback at debug)."""
    logger.error("request %s failed: %s: %s", req_id, type(e).__name__, for_log(e))
    logger.debug("request %s traceback", req_id, exc_info=e)
    return RequestError(
        f"internal server error ({type(e).__name__}); request id {req_id}",
        status=500,
        code=None,
        type="internal_server_error",
    )


def _usage(pairs: list[tuple[_Job, RequestOutput]]) -> UsageInfo:
    """Usage of one response: each prompt once, every generated sample (best_of's included)."""
    jobs: dict[int, tuple[_Job, int]] = {}  # id(job) -> (job, its most cached tokens)
    for job, out in pairs:
        cached = max(jobs.get(id(job), (job, 0))[1], out.num_cached_tokens)
        jobs[id(job)] = (job, cached)
    n_prompt = sum(len(job.prompt_ids) for job, _ in jobs.values())
    n_out = sum(len(c.token_ids) for _, out in pairs for c in out.outputs)
    return UsageInfo(
        prompt_tokens=n_prompt,
        completion_tokens=n_out,
        total_tokens=n_prompt + n_out,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=sum(c for _, c in jobs.values())),
    )


def _new_logprobs(out: RequestOutput) -> tuple[list[int], list[PositionLogprobs]]:
    """The token ids of this output's delta and their log-probability dicts."""
    lps = out.outputs[0].logprobs or []
    ids = out.delta_token_ids
    return ids, lps[len(lps) - len(ids) :] if ids else []


class _Streams:
    """The engine requests behind one response (samples, prompts) as one stream to abort."""

    def __init__(self, req_id: str, streams: list[RequestStream]) -> None:
        self.req_id = req_id
        self.streams = streams

    def abort(self) -> None:
        for s in self.streams:
            s.abort()


@dataclass
class _Job:
    """One prompt of a response: its token ids, its samples' streams, its sampling."""

    prompt_ids: list[int]
    prompt_text: str | None
    streams: list[RequestStream]
    sampling: SamplingParams
    first_index: int  # the choice index of its first sample


@dataclass
class EventStream:
    """A streaming response: SSE events, and the requests to abort if the client goes away."""

    events: AsyncIterator[str]
    stream: RequestStream | _Streams

    async def close(self) -> None:
        await self.events.aclose()  # type: ignore[attr-defined]
        self.stream.abort()


_END = object()


async def _merged(jobs: list[_Job]) -> AsyncIterator[tuple[int, _Job, RequestOutput]]:
    """(choice index, its job, output) from every sample's stream, as they come."""
    pairs = [(job.first_index + i, job, s) for job in jobs for i, s in enumerate(job.streams)]
    if len(pairs) == 1:
        index, job, stream = pairs[0]
        async for out in stream:
            yield index, job, out
        return
    queue: asyncio.Queue[tuple[int, _Job, object]] = asyncio.Queue()

    async def pump(index: int, job: _Job, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((index, job, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, job, e))
        await queue.put((index, job, _END))

    tasks = [asyncio.ensure_future(pump(*pair)) for pair in pairs]
    try:
        remaining = len(tasks)
        while remaining:
            index, job, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, job, item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()


class OpenAIServing:
    """The endpoints' logic. ``template_sandbox`` set: requests may send their own chat template
    (vLLM's ``--trust-request-chat-template``), rendered there; otherwise such requests get a 400."""

    def __init__(
        self,
        llm: AsyncLLM,
        served_model_names: list[str],
        model_root: str | None = None,
        template_sandbox: TemplateSandbox | None = None,
        num_prepare_threads: int = 2,
        sampling_defaults: dict[str, Any] | None = None,
        num_respond_threads: int = 2,
        per_request_spec_decode_metrics: str | None = None,
        special_tokens_in_content: SpecialTokenMode = "allow",
    ) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.llm = llm
        self.served_model_names = list(served_model_names)
        self.model_root = model_root
        self.tokenizer = llm.engine.tokenizer
        self.max_model_len = llm.engine.max_model_len
        self.template_sandbox = template_sandbox
        # vLLM's --per-request-spec-decode-metrics: "summary" adds metrics.speculative_decoding
        self.per_request_spec_decode_metrics = per_request_spec_decode_metrics
        # special-token strings in client text (special_tokens.py): allow, text or reject
        self.special_tokens_in_content = special_tokens_in_content
        self._dropped_bytes = dropped_bytes(self.tokenizer.hf)
        # NOTE: no token spells more characters than its vocabulary string has: a longer text
        # cannot fit the context, and is refused before the tokenizer spends seconds on it
        self._max_prompt_chars = self.max_model_len * max_token_chars(self.tokenizer.hf)
        # the server's defaults for sampling fields a request leaves out (llama.cpp's --temp ...)
        self.sampling_defaults = dict(sampling_defaults or {})
        self._pool = ThreadPoolExecutor(num_prepare_threads, thread_name_prefix="specdec-prepare")
        self._shutting_down = asyncio.Event()
        # NOTE: its own threads: a 4-5 MB reply (3,000 tokens of top-20 logprobs) takes 0.3-1 s
        # to build and encode, which on the event loop silenced /health (0.9-2.8 s gaps), and on
        # the preparation pool would hold up other requests' parsing and tokenization
        self._respond_pool = ThreadPoolExecutor(
            num_respond_threads, thread_name_prefix="specdec-respond"
        )

    async def run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the preparation pool: parsing, templates, tokenization. Once the
        server is shutting down: a 503 instead, at once (a call already running finishes
        unobserved)."""
        self._check_admitting()
        loop = asyncio.get_running_loop()
        return await self._unless_shutting_down(loop.run_in_executor(self._pool, fn, *args))

    def begin_shutdown(self) -> None:
        """Admit nothing more: requests still being prepared (and any that arrive) get a 503;
        requests the engine has go on. Work queued on the preparation pool is dropped."""
        self._shutting_down.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_admitting(self) -> None:
        if self._shutting_down.is_set():
            raise shutting_down_error()

    async def _unless_shutting_down(self, step: Awaitable[_T]) -> _T:
        """``step``'s result, or a 503 as soon as the server begins shutting down."""
        work = asyncio.ensure_future(step)
        stop = asyncio.ensure_future(self._shutting_down.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not work.done():
                work.cancel()
        if work.cancelled():
            raise shutting_down_error()
        return work.result()

    async def run_respond(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the response pool: building and encoding non-streamed replies."""
        return await asyncio.get_running_loop().run_in_executor(self._respond_pool, fn, *args)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._respond_pool.shutdown(wait=False, cancel_futures=True)
        if self.template_sandbox is not None:
            await self.template_sandbox.close()

    def _encode(
        self,
        text: str,
        add_special_tokens: bool,
        param: str = "prompt",
        literal: LiteralSpecials | None = None,
        plain: bool = False,
    ) -> list[int]:
        """``text``'s token ids; a 400 on ``param`` for text the tokenizer would drop. With
        ``literal`` (``text`` mode), ``text`` was rendered from masked client values; ``plain``:
        special-token strings in ``text`` are read as text."""
        rendered = text
        if literal is not None:
            text = literal.restore(text)  # what the ids will spell: the text checked
        if len(text) > self._max_prompt_chars:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {len(text)} characters, more than that many tokens can hold",
                param=param,
                code="context_length_exceeded",
            )
        char = unrepresentable(text, self._dropped_bytes)
        if char is not None:
            raise unrepresentable_error(param, char)
        if literal is not None:
            return literal.encode(rendered)
        if plain:
            return self.tokenizer.encode_plain_batch([text], add_special_tokens)[0]
        # NOTE: encode_batch releases the GIL while it works, encode does not: a 3 MB prompt held
        # the event loop (and /health) for 1.6 s through encode, 24 ms at most through this.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def _encode_prompt(
        self, text: str, add_special_tokens: bool, mode: str, param: str = "prompt"
    ) -> list[int]:
        """A client's prompt string under ``mode`` (``--special-tokens-in-content``)."""
        found = None if mode == "allow" else self.tokenizer.find_special_token(text)
        if found is None:
            return self._encode(text, add_special_tokens, param)
        if mode == "reject":
            raise special_token_error(param, found[0])
        return self._encode(text, add_special_tokens, param, plain=True)

    def special_token_mode(self, requested: SpecialTokenMode | None) -> str:
        """The mode a request runs under (a 400 for one looser than the server's)."""
        return effective_mode(self.special_tokens_in_content, requested)

    # ---- shared ----------------------------------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=n, root=self.model_root, max_model_len=self.max_model_len)
                for n in self.served_model_names
            ]
        )

    def _check_request(self, req: _SamplingRequest) -> str:
        req.check_supported()
        if req.model is not None and req.model not in self.served_model_names:
            raise RequestError(
                f"the model '{req.model}' does not exist; served: {', '.join(self.served_model_names)}",
                param="model",
                status=404,
                code="model_not_found",
            )
        if req.ignored_fields:
            names = req.ignored_fields
            listed = ", ".join(for_log(name, 64) for name in names[:8])
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            logger.warning("ignoring unknown request field(s): %s%s", listed, more)
        return req.model or self.served_model_names[0]

    def _max_tokens(
        self, num_prompt: int, requested: int | None, prompt_param: str, max_param: str
    ) -> int:
        """``requested`` checked against the context left after the prompt (None: all of it)."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = limit - num_prompt
        if requested is None:
            return room
        if requested > room:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{num_prompt + requested} ({num_prompt} in the prompt, {requested} for the completion): "
                f"lower {max_param} to at most {room} or shorten the prompt",
                param=max_param,
                code="context_length_exceeded",
            )
        return requested

    async def _start(
        self,
        prompts: list[tuple[list[int], str | None]],
        req: _SamplingRequest,
        max_tokens: list[int],
        param: str,
        rid: str,
    ) -> list[_Job]:
        """Queue every prompt's samples (n / best_of: one engine request each, seeded seed + i;
        their prompt is prefilled once and shared through the prefix cache). On a refusal, what
        was queued is aborted."""
        jobs: list[_Job] = []
        try:
            for p, ((ids, text), budget) in enumerate(zip(prompts, max_tokens)):
                sampling = req.to_sampling_params(budget, self.sampling_defaults)
                if sampling.structured_outputs is not None:
                    await self._compile_grammar(sampling, req)
                if sampling.bad_words:
                    await self._prepare_bad_words(sampling, req)
                prefix = rid if len(prompts) == 1 else f"{rid}-{p}"
                jobs.append(await self._start_samples(ids, text, sampling, req, prefix, jobs))
        except BaseException:
            for job in jobs:
                for stream in job.streams:
                    stream.abort()
            raise
        return jobs

    async def _compile_grammar(self, sampling: SamplingParams, req: _SamplingRequest) -> None:
        """Compile the request's constraint off the engine's thread (a large schema can take
        100 ms+) and off the preparation pool: the compiler's own threads wait for its grammar
        workers (up to their deadline), so other requests' tokenization never waits behind."""
        params = sampling.structured_outputs
        assert params is not None
        try:
            future = self.llm.engine.grammar_compiler.submit(params, req._client)
            params.compiled = await asyncio.wrap_future(future)
        except ValueError as e:
            raise req.error_for(str(e)) from e

    async def _prepare_bad_words(self, sampling: SamplingParams, req: _SamplingRequest) -> None:
        """Tokenize and index bad_words on the preparation pool, not on the engine's thread."""
        assert sampling.bad_words
        try:
            sampling.compiled_bad_words = await self.run_blocking(
                self.llm.engine.bad_words, sampling.bad_words
            )
        except ValueError as e:
            raise req.error_for(str(e)) from e

    async def _start_samples(
        self,
        ids: list[int],
        text: str | None,
        sampling: SamplingParams,
        req: _SamplingRequest,
        prefix: str,
        earlier: list[_Job],
    ) -> _Job:
        first = sum(j.sampling.n for j in earlier)
        job = _Job(ids, text, [], sampling, first)
        if sampling.num_samples == 1:
            job.streams.append(await self._add(ids, sampling, prefix, req))
            return job
        engine = self.llm.engine
        if engine.kv.enable_prefix_caching and len(ids) > 1 and sampling.prompt_logprobs is None:
            warm = SamplingParams(temperature=0.0, max_tokens=1, seed=0)
            await self._collect(await self._add(ids, warm, f"{prefix}-prefill", req))
        for i in range(sampling.num_samples):
            try:
                job.streams.append(
                    await self._add(ids, sampling.for_sample(i), f"{prefix}-{i}", req)
                )
            except BaseException:
                for stream in job.streams:
                    stream.abort()
                raise
        return job

    async def _add(
        self, ids: list[int], sampling: SamplingParams, req_id: str, req: _SamplingRequest
    ) -> RequestStream:
        self._check_admitting()
        try:
            return await self.llm.add_request(ids, sampling, req_id, req.cache_salt)
        except EngineError as e:
            raise _engine_error(e, req_id) from e
        except ValueError as e:
            err = req.error_for(str(e))
            err.param = err.param or "prompt"
            raise err from e

    @staticmethod
    async def _collect(stream: RequestStream, req: _SamplingRequest | None = None) -> RequestOutput:
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
        except EngineError as e:
            raise _engine_error(e, stream.req_id, req) from e
        finally:
            stream.abort()  # no-op once finished; frees the KV if we were cancelled
        assert final is not None
        return final

    async def _collect_jobs(
        self, jobs: list[_Job], req: _SamplingRequest | None = None
    ) -> list[tuple[_Job, list[RequestOutput]]]:
        """Every sample's final output, per job (on a failure the others are aborted)."""
        streams = [s for job in jobs for s in job.streams]
        try:
            outs = await asyncio.gather(*(self._collect(s, req) for s in streams))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        grouped, k = [], 0
        for job in jobs:
            grouped.append((job, list(outs[k : k + len(job.streams)])))
            k += len(job.streams)
        return grouped

    def _sse(
        self,
        events: AsyncIterator[str],
        jobs: list[_Job],
        rid: str,
        req: _SamplingRequest | None = None,
    ) -> EventStream:
        group = _Streams(rid, [s for job in jobs for s in job.streams])
        return EventStream(self._sse_events(events, group, req), group)

    async def _sse_events(
        self, events: AsyncIterator[str], stream: _Streams, req: _SamplingRequest | None = None
    ) -> AsyncIterator[str]:
        """Wrap a chunk generator: a failure becomes an error event; always end with [DONE]."""
        try:
            async for event in events:
                yield event
        except EngineError as e:
            yield _error_event(_engine_error(e, stream.req_id, req))
        except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
            yield _error_event(internal_error(e, stream.req_id))
        finally:
            stream.abort()
        yield DONE

    def _figures(
        self, pairs: list[tuple[_Job, RequestOutput]], req: _SamplingRequest
    ) -> dict[str, Any]:
        """A response's (or one finished choice's) per-request figures: our ``spec_decode``,
        llama.cpp's ``timings`` and, when the server was asked, vLLM's ``metrics``."""
        merged = _merge_all([o for _, o in pairs])
        usage = _usage(pairs)
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        spec = self._spec_decode(merged, req)
        figures: dict[str, Any] = {
            "spec_decode": spec,
            "timings": timings(
                usage.prompt_tokens,
                cached or 0,
                usage.completion_tokens,
                [o.metrics for _, o in pairs],
                merged.spec_decode_stats,
            ),  # fmt: skip
        }
        k = spec.get("num_speculative_tokens")
        if self.per_request_spec_decode_metrics and k is not None:
            figures["metrics"] = vllm_spec_metrics(merged.spec_decode_stats, k)
        return figures

    def _finish_figures(
        self, job: _Job, out: RequestOutput, req: _SamplingRequest
    ) -> dict[str, Any]:
        """A stream chunk's figures: a finished choice's; ``timings`` and ``metrics`` go on the
        usage chunk instead when there is one (they belong on the last chunk)."""
        if not out.finished:
            return {}
        figures = self._figures([(job, out)], req)
        return {"spec_decode": figures["spec_decode"]} if req.include_usage else figures

    def _spec_decode(self, out: RequestOutput, req: _SamplingRequest) -> dict[str, Any]:
        """The response's ``spec_decode``: the request's acceptance figures, and the most drafts
        per step it allowed (its own cap within the engine's; 0: speculation off for it)."""
        d = out.spec_decode_stats.as_dict()
        spec = self.llm.engine.spec
        if spec is not None:
            own = req.num_speculative_tokens
            own = req.speculative_n_max if own is None else own
            k = spec.num_speculative_tokens
            d["num_speculative_tokens"] = k if own is None else min(own, k)
        return d

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def create_chat_completion(
        self, req: ChatCompletionRequest, rid: str | None = None
    ) -> bytes | EventStream:
        rid = rid or random_id("chatcmpl")
        model = self._check_request(req)
        plan = plan_tools(
            req.tools, req.tool_choice, req.chat_template or self.tokenizer.chat_template
        )
        req._tool_plan = plan
        if plan is not None and req.return_token_provenance:
            raise RequestError(
                "return_token_provenance cannot be combined with tools that may be called",
                "return_token_provenance",
            )
        prompt_ids = await self._chat_prompt_ids(req, plan)
        max_param = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = self._max_tokens(
            len(prompt_ids), req.requested_max_tokens, "messages", max_param
        )
        jobs = await self._start([(prompt_ids, None)], req, [max_tokens], "messages", rid)
        created = now()
        if req.stream:
            return self._sse(self._chat_chunks(req, jobs, rid, created, model), jobs, rid, req)
        ((job, outs),) = await self._collect_jobs(jobs, req)
        return await self.run_respond(self._chat_body, req, job, outs, rid, created, model)

    def _chat_body(
        self,
        req: ChatCompletionRequest,
        job: _Job,
        outs: list[RequestOutput],
        rid: str,
        created: int,
        model: str,
    ) -> bytes:
        """The non-streamed chat response, encoded (on the response pool)."""
        plan: ToolPlan | None = req._tool_plan
        merged = _merge(job, outs, rid)
        top = req.top_logprobs or 0
        choices = []
        for c in merged.outputs:
            message, finish = self._chat_message(plan, c.text, c.finish_reason)
            choice = ChatCompletionChoice(
                index=c.index, message=message, finish_reason=finish, stop_reason=c.stop_reason
            ).model_dump()
            if req.logprobs:  # NOTE: as plain dicts, as model_dump() would write them (below)
                entries = self._chat_logprob_entries(c.token_ids, c.logprobs or [], top)
                choice["logprobs"] = {"content": entries}
            choices.append(choice)
        pairs = [(job, o) for o in outs]
        body = ChatCompletionResponse(
            id=rid, created=created, model=model, choices=[], usage=_usage(pairs),
            **self._figures(pairs, req),
        ).model_dump()  # fmt: skip
        body["choices"], body["prompt_logprobs"] = choices, self._prompt_logprobs(merged)
        if body["metrics"] is None:
            del body["metrics"]
        return encode_json(body)

    @staticmethod
    def _chat_message(
        plan: ToolPlan | None, text: str, finish_reason: str | None
    ) -> tuple[ChatResponseMessage, str | None]:
        """The reply message (tool calls read out of the text) and its finish_reason."""
        if plan is None:
            return ChatResponseMessage(content=text), finish_reason
        content, calls = plan.parse(text)
        if calls and plan.mode != "named" and finish_reason == "stop":
            finish_reason = "tool_calls"
        message = ChatResponseMessage(content=content, tool_calls=[c.as_openai() for c in calls])
        return message, finish_reason

    async def _chat_prompt_ids(
        self, req: ChatCompletionRequest, plan: ToolPlan | None = None
    ) -> list[int]:
        """Render the conversation with the model's template (a thread) or, on a server that
        trusts them, the request's own (the sandbox process), then tokenize it (a thread).
        Tools that may be called are shown to the template as ``tools``."""
        messages = tool_template_messages(req.template_messages())
        extra = {
            k: v
            for k, v in (req.chat_template_kwargs or {}).items()
            if k not in _RESERVED_TEMPLATE_KEYS
        }
        if plan is not None:
            extra["tools"] = plan.tools
        literal = None
        mode = self.special_token_mode(req.special_tokens_in_content)
        if mode != "allow":
            messages, extra, literal = await self.run_blocking(
                self._client_specials, mode, messages, extra
            )
        if not req.chat_template:
            try:
                text = await self.run_blocking(
                    self._render_model_template, messages, req.add_generation_prompt, extra
                )
            except Exception as e:  # noqa: BLE001 - the template is fixed: the request broke it
                message = (
                    str(e)
                    if isinstance(e, (ValueError, TypeError))
                    else f"chat template error: {type(e).__name__}: {e}"
                )
                raise RequestError(message, param="messages") from e  # fmt: skip
            return await self.run_blocking(self._encode_rendered, text, req, literal)
        if self.template_sandbox is None:
            raise RequestError(
                "chat_template was sent with the request, but the server was not started with "
                "--trust-request-chat-template: refused",
                param="chat_template",
                code="untrusted_chat_template",
            )
        variables = {
            "documents": None,
            **self.tokenizer.special_tokens_map,
            "tools": None,
            **extra,
            "messages": prepare_messages(messages),
            "add_generation_prompt": req.add_generation_prompt,
        }  # NOTE: the variables Tokenizer.apply_chat_template gives the model's template
        try:
            render = self.template_sandbox.render(req.chat_template, variables, req._client)
            text = await self._unless_shutting_down(render)
        except TemplateRenderError as e:
            raise RequestError(str(e), param="chat_template") from e
        return await self.run_blocking(self._encode_rendered, text, req, literal)

    def _client_specials(
        self, mode: str, messages: list[dict[str, Any]], extra: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[str, Any], LiteralSpecials | None]:
        """Special-token strings in what the client sent the template (messages, tools, template
        variables): a 400 naming the first (``reject``), or the values masked (``text``)."""
        found = find_special(self.tokenizer, messages, "messages")
        for key, value in extra.items():
            if found is not None:
                break
            if key == "tools":
                found = find_special(self.tokenizer, value, "tools")
            else:  # NOTE: through find_special, which names no odd client key
                found = find_special(self.tokenizer, {key: value}, "chat_template_kwargs")
        if found is None:
            return messages, extra, None
        if mode == "reject":
            raise special_token_error(*found)
        literal = LiteralSpecials(self.tokenizer)
        masked = {k: literal.mask(v) for k, v in extra.items()}
        return literal.mask(messages), masked, literal

    def _encode_rendered(
        self, text: str, req: ChatCompletionRequest, literal: LiteralSpecials | None = None
    ) -> list[int]:
        checked = literal.restore(text) if literal is not None else text
        if has_surrogates(checked):  # e.g. a "\ud800" literal in a request's template
            raise RequestError("chat template produced invalid Unicode", param="chat_template")
        char = unrepresentable(checked, self._dropped_bytes)
        if char is not None:  # name the message that holds it, if one does
            param = next(
                (f"messages[{i}].content" for i, m in enumerate(req.template_messages())
                 if isinstance(m["content"], str) and char in m["content"]),
                "messages",
            )  # fmt: skip
            raise unrepresentable_error(param, char)
        return self._encode(text, False, "messages", literal)

    def _render_model_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
        assert isinstance(text, str)
        return text

    def _chat_logprob_entries(
        self, token_ids: list[int], logprobs: list[PositionLogprobs], top: int
    ) -> list[dict[str, Any]]:
        """OpenAI's chat shape: each token with its log-probability and the ``top`` most likely,
        as ``ChatTokenLogprob.model_dump()`` writes them.

        NOTE: dicts, not models: dumping a 3,000-token reply's models in one model_dump() call
        holds the GIL (the event loop with it) for ~0.3 s."""
        content = []
        for tok, d in zip(token_ids, logprobs):
            text = self._token_text(tok, d)
            ranked = sorted((v.rank or 0, k, v) for k, v in d.items() if (v.rank or 0) <= top)
            content.append(
                {
                    "token": text,
                    "logprob": float(d[tok].logprob),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (t := self._token_text(k, d)),
                            "logprob": v.logprob,
                            "bytes": list(t.encode("utf-8")),
                        }
                        for _, k, v in ranked
                    ],
                }
            )
        return content

    def _token_text(self, token_id: int, d: PositionLogprobs | None = None) -> str:
        lp = d.get(token_id) if d else None
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def _prompt_logprobs(out: RequestOutput) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs in JSON: None, then per prompt token id -> its figures."""
        if out.prompt_logprobs is None:
            return None
        return [
            None
            if d is None
            else {
                str(k): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                for k, v in d.items()
            }
            for d in out.prompt_logprobs
        ]

    async def _chat_chunks(
        self, req: ChatCompletionRequest, jobs: list[_Job], rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice], **kw: Any) -> str:
            return dump_chunk(
                ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **kw)
            )

        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        for i in range(jobs[0].sampling.n):
            yield chunk(
                [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]
            )
        last: dict[int, tuple[_Job, RequestOutput]] = {}
        top = req.top_logprobs or 0
        plan: ToolPlan | None = req._tool_plan
        aligners: dict[int, ProvenanceAligner] = {}
        async for index, job, out in _merged(jobs):
            last[index] = (job, out)
            c = out.outputs[0]
            logprobs = None
            if req.logprobs:
                entries = self._chat_logprob_entries(*_new_logprobs(out), top)
                logprobs = ChatChoiceLogprobs(content=entries)
            text, provenance = _provenance(req, aligners, index, out)
            delta, finish = DeltaMessage(content=text), c.finish_reason
            if plan is not None:
                # NOTE: calls are read from the whole text: it comes in one delta at the end
                if not out.finished:
                    continue
                message, finish = self._chat_message(plan, c.text, c.finish_reason)
                calls = [{"index": i, **call} for i, call in enumerate(message.tool_calls)]
                delta = DeltaMessage(content=message.content, tool_calls=calls or None)
            if not (delta.content or out.finished or (logprobs and logprobs.content) or provenance):
                continue
            choice = ChatStreamChoice(
                index=index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None,
                token_provenance=provenance,
            )
            yield chunk(
                [choice],
                usage=_usage(list(last.values())) if continuous else None,
                **self._finish_figures(job, out, req),
            )
        if req.include_usage and last:
            pairs = list(last.values())
            yield chunk([], usage=_usage(pairs), **self._figures(pairs, req))

    # ---- /v1/completions -----------------------------------------------------------------------
    async def create_completion(
        self, req: CompletionRequest, rid: str | None = None
    ) -> bytes | EventStream:
        rid = rid or random_id("cmpl")
        model = self._check_request(req)
        prompts: list[tuple[list[int], str | None]] = []
        mode = self.special_token_mode(req.special_tokens_in_content)
        for p in req.prompts():
            if isinstance(p, str):
                ids = await self.run_blocking(self._encode_prompt, p, True, mode)
                prompts.append((ids, p))
            else:
                prompts.append((list(p), None))
        budgets = [
            self._max_tokens(len(ids), req.max_tokens, "prompt", "max_tokens") for ids, _ in prompts
        ]
        jobs = await self._start(prompts, req, budgets, "prompt", rid)
        created = now()
        if req.stream:
            return self._sse(
                self._completion_chunks(req, jobs, rid, created, model), jobs, rid, req
            )
        grouped = await self._collect_jobs(jobs, req)
        return await self.run_respond(self._completion_body, req, grouped, rid, created, model)

    def _completion_body(
        self,
        req: CompletionRequest,
        grouped: list[tuple[_Job, list[RequestOutput]]],
        rid: str,
        created: int,
        model: str,
    ) -> bytes:
        """The non-streamed completion response, encoded (on the response pool)."""
        choices, every = [], []
        for job, outs in grouped:
            every.extend((job, o) for o in outs)
            merged = _merge(job, outs, rid)
            for c in merged.outputs:
                index = job.first_index + c.index
                choices.append(self._completion_choice(req, job, merged, c, index))
        body = CompletionResponse(
            id=rid, created=created, model=model, choices=[], usage=_usage(every),
            **self._figures(every, req),
        ).model_dump()  # fmt: skip
        body["choices"] = choices
        if body["metrics"] is None:
            del body["metrics"]
        return encode_json(body)

    def _echo_text(self, job: _Job) -> str:
        if job.prompt_text is not None:
            return job.prompt_text
        return self.tokenizer.decode(job.prompt_ids, skip_special_tokens=False)

    def _completion_choice(
        self,
        req: CompletionRequest,
        job: _Job,
        out: RequestOutput,
        c: CompletionOutput,
        index: int,
    ) -> dict[str, Any]:
        """One choice as ``CompletionChoice.model_dump()`` writes it; its logprobs lists go in
        as they are (plain values: one model_dump() over them holds the GIL for a long time)."""
        text = c.text
        if req.echo:
            text = self._echo_text(job) + text
        choice = CompletionChoice(
            index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason
        ).model_dump()
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if req.echo:
                self._add_prompt_logprobs(logprobs, job.prompt_ids, out.prompt_logprobs)
            self._add_logprobs(logprobs, c.token_ids, c.logprobs or [], len(self._text(logprobs)))
            choice["logprobs"] = {
                name: getattr(logprobs, name) for name in CompletionLogprobs.model_fields
            }
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(out)
        return choice

    @staticmethod
    def _text(logprobs: CompletionLogprobs) -> str:
        return "".join(logprobs.tokens)

    def _add_logprobs(
        self,
        into: CompletionLogprobs,
        token_ids: list[int],
        logprobs: list[PositionLogprobs],
        offset: int,
    ) -> int:
        """Append tokens, their log-probabilities, the top ones (vLLM's: the chosen token and
        the top-N) and text offsets; return the offset after them."""
        for tok, d in zip(token_ids, logprobs):
            text = self._token_text(tok, d)
            into.tokens.append(text)
            into.token_logprobs.append(d[tok].logprob)
            into.top_logprobs.append({self._token_text(k, d): v.logprob for k, v in d.items()})
            into.text_offset.append(offset)
            offset += len(text)
        return offset

    def _add_prompt_logprobs(
        self,
        into: CompletionLogprobs,
        prompt_ids: list[int],
        prompt_logprobs: list[PositionLogprobs | None] | None,
    ) -> None:
        """echo with logprobs: the prompt's tokens first (the first one has no log-probability)."""
        first = self._token_text(prompt_ids[0])
        into.tokens.append(first)
        into.token_logprobs.append(None)
        into.top_logprobs.append(None)
        into.text_offset.append(0)
        rest = [d for d in (prompt_logprobs or [])[1:] if d is not None]
        self._add_logprobs(into, prompt_ids[1 : 1 + len(rest)], rest, len(first))

    async def _completion_chunks(
        self, req: CompletionRequest, jobs: list[_Job], rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], **kw: Any) -> str:
            return dump_chunk(
                CompletionResponse(id=rid, created=created, model=model, choices=choices, **kw)
            )

        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        last: dict[int, tuple[_Job, RequestOutput]] = {}
        offsets: dict[int, int] = {}
        aligners: dict[int, ProvenanceAligner] = {}
        async for index, job, out in _merged(jobs):
            first = index not in last
            last[index] = (job, out)
            c = out.outputs[0]
            logprobs = None
            text, provenance = _provenance(req, aligners, index, out)
            if req.logprobs is not None:
                logprobs = CompletionLogprobs()
                if first and req.echo:
                    self._add_prompt_logprobs(logprobs, job.prompt_ids, out.prompt_logprobs)
                    offsets[index] = len(self._text(logprobs))
                offsets[index] = self._add_logprobs(
                    logprobs, *_new_logprobs(out), offsets.get(index, 0)
                )
            if first and req.echo:
                text = self._echo_text(job) + text
            if not (text or out.finished or (logprobs and logprobs.tokens) or provenance):
                continue
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None,
                prompt_logprobs=self._prompt_logprobs(out)
                if first and req.prompt_logprobs is not None
                else None,
                token_provenance=provenance,
            )
            yield chunk(
                [choice],
                usage=_usage(list(last.values())) if continuous else None,
                **self._finish_figures(job, out, req),
            )
        if req.include_usage and last:
            pairs = list(last.values())
            yield chunk([], usage=_usage(pairs), **self._figures(pairs, req))


def _provenance(
    req: _SamplingRequest, aligners: dict[int, ProvenanceAligner], index: int, out: RequestOutput
) -> tuple[str, list[list[int]] | None]:
    """A choice's text to stream now and, with return_token_provenance, its tokens' provenance
    (the text is then cut at token ends)."""
    if not req.return_token_provenance:
        return out.delta_text, None
    aligner = aligners.setdefault(index, ProvenanceAligner())
    return aligner.feed(out.delta_text, out.delta_provenance)


def _merge(job: _Job, outs: list[RequestOutput], rid: str) -> RequestOutput:
    """A job's samples as one output (best_of picks the n best)."""
    if len(outs) == 1:
        return outs[0]
    return merge_samples(rid, outs, job.sampling.n, job.sampling.logprobs is not None)


def _merge_all(outs: list[RequestOutput]) -> RequestOutput:
    """Outputs of several requests with their acceptance statistics summed (for spec_decode)."""
    if len(outs) == 1:
        return outs[0]
    return merge_samples(outs[0].request_id, outs, len(outs), True)


_ITEMS_PER_DUMP = 64  # list items per json.dumps() call in encode_json
_MAX_NESTING = 4  # response.choices[i].logprobs.content: where the long lists are


def encode_json(content: Any) -> bytes:
    """A JSON body exactly as Starlette's JSONResponse encodes it, written in pieces.

    NOTE: one json.dumps() call holds the GIL throughout: a 5 MB reply in one call stopped the
    event loop for ~0.15 s. Containers near the top are written key by key and long lists
    ``_ITEMS_PER_DUMP`` items at a time, which joins to the same bytes."""
    parts: list[str] = []
    _encode_into(content, parts, 0)
    return "".join(parts).encode("utf-8")


def _dumps(value: Any) -> str:
    return json.dumps(
        value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    )


def _encode_into(value: Any, parts: list[str], depth: int) -> None:
    if isinstance(value, list) and len(value) > _ITEMS_PER_DUMP:
        pieces = (
            _dumps(value[i : i + _ITEMS_PER_DUMP])[1:-1]
            for i in range(0, len(value), _ITEMS_PER_DUMP)
        )
        parts.append(f"[{','.join(pieces)}]")
    elif isinstance(value, list) and value and depth < _MAX_NESTING:
        for i, item in enumerate(value):
            parts.append("," if i else "[")
            _encode_into(item, parts, depth + 1)
        parts.append("]")
    elif (
        isinstance(value, dict)
        and value
        and depth < _MAX_NESTING
        and all(isinstance(key, str) for key in value)  # json.dumps writes 5 as "5"
    ):
        for i, (key, item) in enumerate(value.items()):
            parts.append(("," if i else "{") + _dumps(key) + ":")
            _encode_into(item, parts, depth + 1)
        parts.append("}")
    else:
        parts.append(_dumps(value))


def _error_event(err: RequestError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"
