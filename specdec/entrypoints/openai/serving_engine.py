"""The generation endpoints' shared base: request -> prompt ids + SamplingParams -> AsyncLLM.

Everything that can be checked before the engine sees the request is checked here, so a bad
request costs a 400 and nothing else; streaming responses only start once the engine accepted
the request. Parsing, template rendering and tokenization run on a small thread pool (and a
request's own template in a worker process), never on the event loop or the engine's thread.
The endpoint families build on it: ``serving_chat.py``, ``serving_completion.py``, and the
models / tokenize utilities in ``utility.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel

from specdec.engine.async_llm import AsyncLLM, EngineError, RequestStream
from specdec.engine.samples import plan_samples
from specdec.entrypoints.openai.chat_sandbox import TemplateSandbox
from specdec.entrypoints.openai.protocol import (
    ModelList,
    PromptLogprobs,
    RequestError,
    SamplingRequest,
    dump_chunk,
    random_id,
)
from specdec.entrypoints.openai.safety import (
    dropped_bytes,
    for_log,
    unrepresentable,
    unrepresentable_error,
)
from specdec.entrypoints.openai.server_common import until_done_or
from specdec.entrypoints.openai.serving_stream import (
    EventStream,
    Job,
    Streams,
    merge_all,
    merge_streams,
    stream_text,
    usage_info,
)
from specdec.entrypoints.openai.serving_utils import (
    DONE,
    encode_json,
    engine_error,
    error_event,
    internal_error,
    logger,
    shutting_down_error,
)
from specdec.entrypoints.openai.special_tokens import (
    LiteralSpecials,
    SpecialTokenMode,
    effective_mode,
    special_token_error,
)
from specdec.entrypoints.openai.stats import ProvenanceAligner, timings, vllm_spec_metrics
from specdec.entrypoints.openai.utility import model_list
from specdec.model.tokenizer import max_token_chars
from specdec.outputs import PositionLogprobs, RequestOutput
from specdec.sampling_params import SamplingParams

_T = TypeVar("_T")
Provenance = list[list[int]] | None  # a streamed choice's tokens' provenance, when asked


class OpenAIServingBase:
    """What every endpoint family shares. ``template_sandbox`` set: requests may send their own chat template
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
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.template_sandbox = template_sandbox
        # vLLM's --per-request-spec-decode-metrics: "summary" adds metrics.speculative_decoding
        self.per_request_spec_decode_metrics = per_request_spec_decode_metrics
        # special-token strings in client text (special_tokens.py): allow, text or reject
        self.special_tokens_in_content = special_tokens_in_content
        self._dropped_bytes = dropped_bytes(self.tokenizer)
        # NOTE: no token spells more characters than its vocabulary string has: a longer text
        # cannot fit the context, and is refused before the tokenizer spends seconds on it
        self._max_prompt_chars = self.max_model_len * max_token_chars(self.tokenizer)
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
        await until_done_or(work, asyncio.ensure_future(self._shutting_down.wait()))
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
        """``GET /v1/models`` (``utility.py``)."""
        return model_list(self)

    def _check_request(self, req: SamplingRequest, rid: str | None, prefix: str) -> tuple[str, str]:
        """The request's id (``rid``, else a new one starting ``prefix``) and the model it
        names, once the checks every endpoint starts with have passed."""
        rid = rid or random_id(prefix)
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
        return rid, req.model or self.served_model_names[0]

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
        req: SamplingRequest,
        max_tokens: list[int],
        param: str,
        rid: str,
    ) -> list[Job]:
        """Queue every prompt's samples (n / best_of: one engine request each, seeded seed + i;
        their prompt is prefilled once and shared through the prefix cache). On a refusal, what
        was queued is aborted."""
        jobs: list[Job] = []
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

    async def _compile_grammar(self, sampling: SamplingParams, req: SamplingRequest) -> None:
        """Compile the request's constraint off the engine's thread (a large schema can take
        100 ms+) and off the preparation pool: the compiler's own threads wait for its grammar
        workers (up to their deadline), so other requests' tokenization never waits behind."""
        params = sampling.structured_outputs
        assert params is not None
        try:
            future = self.llm.grammar_compiler.submit(params, req._client)
            params.compiled = await asyncio.wrap_future(future)
        except ValueError as e:
            raise req.error_for(str(e)) from e

    async def _prepare_bad_words(self, sampling: SamplingParams, req: SamplingRequest) -> None:
        """Tokenize and index bad_words on the preparation pool, not on the engine's thread."""
        assert sampling.bad_words
        try:
            sampling.compiled_bad_words = await self.run_blocking(
                self.llm.bad_words, sampling.bad_words
            )
        except ValueError as e:
            raise req.error_for(str(e)) from e

    async def _start_samples(
        self,
        ids: list[int],
        text: str | None,
        sampling: SamplingParams,
        req: SamplingRequest,
        prefix: str,
        earlier: list[Job],
    ) -> Job:
        """One prompt's engine requests (``engine/samples.py``): the warm-up prefill, finished
        first, then one per sample."""
        first = sum(j.sampling.n for j in earlier)
        job = Job(ids, text, [], sampling, first)
        plan = plan_samples(sampling, prefix, len(ids), self.llm.prefix_caching)
        if plan.warmup is not None:
            await self._collect(await self._add(ids, plan.warmup, f"{prefix}-prefill", req))
        for req_id, params in plan.samples:
            assert req_id is not None
            try:
                job.streams.append(await self._add(ids, params, req_id, req))
            except BaseException:
                for stream in job.streams:
                    stream.abort()
                raise
        return job

    async def _add(
        self, ids: list[int], sampling: SamplingParams, req_id: str, req: SamplingRequest
    ) -> RequestStream:
        self._check_admitting()
        try:
            return await self.llm.add_request(ids, sampling, req_id, req.cache_salt)
        except EngineError as e:
            raise engine_error(e, req_id) from e
        except ValueError as e:
            err = req.error_for(str(e))
            err.param = err.param or "prompt"
            raise err from e

    @staticmethod
    async def _collect(stream: RequestStream, req: SamplingRequest | None = None) -> RequestOutput:
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
        except EngineError as e:
            raise engine_error(e, stream.req_id, req) from e
        finally:
            stream.abort()  # no-op once finished; frees the KV if we were cancelled
        assert final is not None
        return final

    async def _collect_jobs(
        self, jobs: list[Job], req: SamplingRequest | None = None
    ) -> list[tuple[Job, list[RequestOutput]]]:
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
        jobs: list[Job],
        rid: str,
        req: SamplingRequest | None = None,
    ) -> EventStream:
        group = Streams(rid, [s for job in jobs for s in job.streams])
        return EventStream(self._sse_events(events, group, req), group)

    async def _sse_events(
        self, events: AsyncIterator[str], stream: Streams, req: SamplingRequest | None = None
    ) -> AsyncIterator[str]:
        """Wrap a chunk generator: a failure becomes an error event; always end with [DONE]."""
        try:
            async for event in events:
                yield event
        except EngineError as e:
            yield error_event(engine_error(e, stream.req_id, req))
        except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
            yield error_event(internal_error(e, stream.req_id))
        finally:
            stream.abort()
        yield DONE

    async def _stream_choices(
        self,
        req: SamplingRequest,
        jobs: list[Job],
        chunk: Callable[..., str],
        choice: Callable[[int, Job, RequestOutput, bool, str, Provenance], Any],
    ) -> AsyncIterator[str]:
        """The streaming loop of every endpoint: each sample's outputs as they come, one chunk
        per output holding the choice that ``choice(index, job, out, first, text, provenance)``
        builds (None: nothing to send yet), with the running usage when asked and a finished
        choice's figures; the usage chunk last."""
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        last: dict[int, tuple[Job, RequestOutput]] = {}
        aligners: dict[int, ProvenanceAligner] = {}
        async for index, job, out in merge_streams(jobs):
            first = index not in last
            last[index] = (job, out)
            text, provenance = stream_text(req, aligners, index, out)
            built = choice(index, job, out, first, text, provenance)
            if built is None:
                continue
            yield chunk(
                [built],
                usage=usage_info(list(last.values())) if continuous else None,
                **self._finish_figures(job, out, req),
            )
        if req.include_usage and last:
            pairs = list(last.values())
            yield chunk([], usage=usage_info(pairs), **self._figures(pairs, req))

    def _figures(
        self, pairs: list[tuple[Job, RequestOutput]], req: SamplingRequest
    ) -> dict[str, Any]:
        """A response's (or one finished choice's) per-request figures: our ``spec_decode``,
        llama.cpp's ``timings`` and, when the server was asked, vLLM's ``metrics``."""
        merged = merge_all([o for _, o in pairs])
        usage = usage_info(pairs)
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

    def _encode_response(
        self,
        cls: type[BaseModel],
        rid: str,
        created: int,
        model: str,
        pairs: list[tuple[Job, RequestOutput]],
        req: SamplingRequest,
        **fields: Any,
    ) -> bytes:
        """A non-streamed response, encoded: ``cls`` with the usage and figures of ``pairs``,
        then ``fields`` (the choices as plain dicts, as model_dump() writes them) put in as they
        are; ``metrics`` is left out where there are none."""
        body = cls(
            id=rid, created=created, model=model, choices=[], usage=usage_info(pairs),
            **self._figures(pairs, req),
        ).model_dump()  # fmt: skip
        body.update(fields)
        if body["metrics"] is None:
            del body["metrics"]
        return encode_json(body)

    @staticmethod
    def _chunk_writer(
        cls: type[BaseModel], rid: str, created: int, model: str
    ) -> Callable[..., str]:
        """One stream's chunk encoder: ``chunk(choices, **fields)`` -> ``cls`` around them,
        dumped as an SSE line."""

        def chunk(choices: list[Any], **fields: Any) -> str:
            return dump_chunk(cls(id=rid, created=created, model=model, choices=choices, **fields))

        return chunk

    def _finish_figures(self, job: Job, out: RequestOutput, req: SamplingRequest) -> dict[str, Any]:
        """A stream chunk's figures: a finished choice's; ``timings`` and ``metrics`` go on the
        usage chunk instead when there is one (they belong on the last chunk)."""
        if not out.finished:
            return {}
        figures = self._figures([(job, out)], req)
        return {"spec_decode": figures["spec_decode"]} if req.include_usage else figures

    def _spec_decode(self, out: RequestOutput, req: SamplingRequest) -> dict[str, Any]:
        """The response's ``spec_decode``: the request's acceptance figures, and the most drafts
        per step it allowed (its own cap within the engine's; 0: speculation off for it)."""
        d = out.spec_decode_stats.as_dict()
        spec = self.llm.speculative_config
        if spec is not None:
            own = req.num_speculative_tokens
            own = req.speculative_n_max if own is None else own
            k = spec.num_speculative_tokens
            d["num_speculative_tokens"] = k if own is None else min(own, k)
        return d

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
