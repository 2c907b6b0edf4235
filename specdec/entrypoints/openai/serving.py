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
from collections.abc import AsyncIterator, Callable
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
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokenUsageInfo,
    RequestError,
    UsageInfo,
    _SamplingRequest,
    dump_chunk,
    now,
    random_id,
)
from specdec.entrypoints.openai.safety import for_log, has_surrogates
from specdec.model.tokenizer import prepare_messages
from specdec.outputs import RequestOutput

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
_RESERVED_TEMPLATE_KEYS = ("messages", "add_generation_prompt", "tokenize", "chat_template")
_T = TypeVar("_T")


def _engine_error(e: EngineError, req_id: str) -> RequestError:
    """The response for a request the engine could not finish (logged as one line)."""
    if isinstance(e, EngineDeadError):
        logger.warning("request %s ended: %s", req_id, for_log(e))
        return RequestError(str(e), status=503, code=None, type="service_unavailable")
    if not isinstance(e, RequestFailed):  # NOTE: the engine logs its per-request failures
        logger.error("request %s failed: %s", req_id, for_log(e))
    return RequestError(str(e), status=500, code=None, type="internal_server_error")


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


def _usage(out: RequestOutput) -> UsageInfo:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return UsageInfo(
        prompt_tokens=n_prompt,
        completion_tokens=n_out,
        total_tokens=n_prompt + n_out,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=out.num_cached_tokens),
    )


def _new_logprobs(out: RequestOutput) -> tuple[list[int], list[float]]:
    """The token ids of this output's delta and their log-probabilities."""
    lps = out.outputs[0].logprobs or []
    ids = out.delta_token_ids
    return ids, lps[len(lps) - len(ids) :] if ids else []


@dataclass
class EventStream:
    """A streaming response: SSE events, and the request to abort if the client goes away."""

    events: AsyncIterator[str]
    stream: RequestStream

    async def close(self) -> None:
        await self.events.aclose()  # type: ignore[attr-defined]
        self.stream.abort()


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
    ) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.llm = llm
        self.served_model_names = list(served_model_names)
        self.model_root = model_root
        self.tokenizer = llm.engine.tokenizer
        self.max_model_len = llm.engine.max_model_len
        self.template_sandbox = template_sandbox
        # the server's defaults for sampling fields a request leaves out (llama.cpp's --temp ...)
        self.sampling_defaults = dict(sampling_defaults or {})
        self._pool = ThreadPoolExecutor(num_prepare_threads, thread_name_prefix="specdec-prepare")

    async def run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the preparation pool: parsing, templates, tokenization."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.template_sandbox is not None:
            await self.template_sandbox.close()

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # NOTE: encode_batch releases the GIL while it works, encode does not: a 3 MB prompt held
        # the event loop (and /health) for 1.6 s through encode, 24 ms at most through this.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

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
        self, prompt_ids: list[int], req: _SamplingRequest, max_tokens: int, param: str, rid: str
    ) -> RequestStream:
        sampling = req.to_sampling_params(max_tokens, self.sampling_defaults)
        try:
            return await self.llm.add_request(prompt_ids, sampling, rid, req.cache_salt)
        except EngineError as e:
            raise _engine_error(e, rid) from e
        except ValueError as e:
            raise RequestError(str(e), param=req.field_named_by(str(e)) or param) from e

    @staticmethod
    async def _collect(stream: RequestStream) -> RequestOutput:
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
        except EngineError as e:
            raise _engine_error(e, stream.req_id) from e
        finally:
            stream.abort()  # no-op once finished; frees the KV if we were cancelled
        assert final is not None
        return final

    def _sse(self, events: AsyncIterator[str], stream: RequestStream) -> EventStream:
        return EventStream(self._sse_events(events, stream), stream)

    async def _sse_events(
        self, events: AsyncIterator[str], stream: RequestStream
    ) -> AsyncIterator[str]:
        """Wrap a chunk generator: a failure becomes an error event; always end with [DONE]."""
        try:
            async for event in events:
                yield event
        except EngineError as e:
            yield _error_event(_engine_error(e, stream.req_id))
        except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
            yield _error_event(internal_error(e, stream.req_id))
        finally:
            stream.abort()
        yield DONE

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

    def _token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def create_chat_completion(
        self, req: ChatCompletionRequest, rid: str | None = None
    ) -> dict[str, Any] | EventStream:
        rid = rid or random_id("chatcmpl")
        model = self._check_request(req)
        prompt_ids = await self._chat_prompt_ids(req)
        max_param = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = self._max_tokens(
            len(prompt_ids), req.requested_max_tokens, "messages", max_param
        )
        stream = await self._start(prompt_ids, req, max_tokens, "messages", rid)
        created = now()
        if req.stream:
            return self._sse(self._chat_chunks(req, stream, rid, created, model), stream)
        out = await self._collect(stream)
        c = out.outputs[0]
        logprobs = self._chat_logprobs(c.token_ids, c.logprobs or []) if req.logprobs else None
        choice = ChatCompletionChoice(
            message=ChatResponseMessage(content=c.text),
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        return ChatCompletionResponse(
            id=rid, created=created, model=model, choices=[choice], usage=_usage(out),
            spec_decode=self._spec_decode(out, req),
        ).model_dump()  # fmt: skip

    async def _chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """Render the conversation with the model's template (a thread) or, on a server that
        trusts them, the request's own (the sandbox process), then tokenize it (a thread)."""
        messages = req.template_messages()
        extra = {
            k: v
            for k, v in (req.chat_template_kwargs or {}).items()
            if k not in _RESERVED_TEMPLATE_KEYS
        }
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
            return await self.run_blocking(self._encode, text, False)
        if self.template_sandbox is None:
            raise RequestError(
                "chat_template was sent with the request, but the server was not started with "
                "--trust-request-chat-template: refused",
                param="chat_template",
                code="untrusted_chat_template",
            )
        variables = {
            "tools": None,
            "documents": None,
            **self.tokenizer.special_tokens_map,
            **extra,
            "messages": prepare_messages(messages),
            "add_generation_prompt": req.add_generation_prompt,
        }  # NOTE: the variables Tokenizer.apply_chat_template gives the model's template
        try:
            text = await self.template_sandbox.render(req.chat_template, variables)
        except TemplateRenderError as e:
            raise RequestError(str(e), param="chat_template") from e
        return await self.run_blocking(self._encode_rendered, text)

    def _encode_rendered(self, text: str) -> list[int]:
        if has_surrogates(text):  # e.g. a "\ud800" literal in the template
            raise RequestError("chat template produced invalid Unicode", param="chat_template")
        return self._encode(text, False)

    def _render_model_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
        assert isinstance(text, str)
        return text

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> ChatChoiceLogprobs:
        content = [
            ChatTokenLogprob(token=s, logprob=lp, bytes=list(s.encode("utf-8")))
            for s, lp in zip(self._token_strings(token_ids), logprobs)
        ]
        return ChatChoiceLogprobs(content=content)

    async def _chat_chunks(
        self, req: ChatCompletionRequest, stream: RequestStream, rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice], **kw: Any) -> str:
            return dump_chunk(
                ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **kw)
            )

        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        yield chunk([ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))])
        out: RequestOutput | None = None
        async for out in stream:
            c = out.outputs[0]
            logprobs = self._chat_logprobs(*_new_logprobs(out)) if req.logprobs else None
            if not (out.delta_text or out.finished or (logprobs and logprobs.content)):
                continue
            choice = ChatStreamChoice(
                delta=DeltaMessage(content=out.delta_text),
                logprobs=logprobs,
                finish_reason=c.finish_reason if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None,
            )
            yield chunk(
                [choice],
                usage=_usage(out) if continuous else None,
                spec_decode=self._spec_decode(out, req) if out.finished else None,
            )
        if req.include_usage and out is not None:
            yield chunk([], usage=_usage(out), spec_decode=self._spec_decode(out, req))

    # ---- /v1/completions -----------------------------------------------------------------------
    async def create_completion(
        self, req: CompletionRequest, rid: str | None = None
    ) -> dict[str, Any] | EventStream:
        rid = rid or random_id("cmpl")
        model = self._check_request(req)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = await self.run_blocking(self._encode, prompt, True)
        else:
            prompt_ids = list(prompt)
        max_tokens = self._max_tokens(len(prompt_ids), req.max_tokens, "prompt", "max_tokens")
        stream = await self._start(prompt_ids, req, max_tokens, "prompt", rid)
        created = now()
        if req.stream:
            return self._sse(self._completion_chunks(req, stream, rid, created, model), stream)
        out = await self._collect(stream)
        c = out.outputs[0]
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._completion_logprobs(c.token_ids, c.logprobs or [], 0)
        choice = CompletionChoice(
            text=c.text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason
        )
        return CompletionResponse(
            id=rid, created=created, model=model, choices=[choice], usage=_usage(out),
            spec_decode=self._spec_decode(out, req),
        ).model_dump()  # fmt: skip

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[float], offset: int
    ) -> CompletionLogprobs:
        tokens = self._token_strings(token_ids)
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=list(logprobs),
            top_logprobs=[None] * len(tokens),
            text_offset=offsets,
        )

    async def _completion_chunks(
        self, req: CompletionRequest, stream: RequestStream, rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], **kw: Any) -> str:
            return dump_chunk(
                CompletionResponse(id=rid, created=created, model=model, choices=choices, **kw)
            )

        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        out: RequestOutput | None = None
        offset = 0
        async for out in stream:
            c = out.outputs[0]
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(*_new_logprobs(out), offset)
                offset = (
                    logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    if logprobs.tokens
                    else offset
                )
            if not (out.delta_text or out.finished or (logprobs and logprobs.tokens)):
                continue
            choice = CompletionChoice(
                text=out.delta_text,
                logprobs=logprobs,
                finish_reason=c.finish_reason if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None,
            )
            yield chunk(
                [choice],
                usage=_usage(out) if continuous else None,
                spec_decode=self._spec_decode(out, req) if out.finished else None,
            )
        if req.include_usage and out is not None:
            yield chunk([], usage=_usage(out), spec_decode=self._spec_decode(out, req))


def _error_event(err: RequestError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"
