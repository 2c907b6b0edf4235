"""The two generation endpoints: request -> prompt ids + SamplingParams -> AsyncLLM -> response.

Everything that can be checked before the engine sees the request is checked here, so a bad
request costs a 400 and nothing else; streaming responses only start once the engine accepted
the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from specdec.engine.async_llm import AsyncLLM, EngineDeadError, EngineError, RequestStream
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
from specdec.outputs import RequestOutput

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
_RESERVED_TEMPLATE_KEYS = ("messages", "add_generation_prompt", "tokenize", "chat_template")


def _engine_error(e: EngineError) -> RequestError:
    status = 503 if isinstance(e, EngineDeadError) else 500
    return RequestError(str(e), status=status, code=None, type="internal_server_error")


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
    def __init__(
        self, llm: AsyncLLM, served_model_names: list[str], model_root: str | None = None
    ) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.llm = llm
        self.served_model_names = list(served_model_names)
        self.model_root = model_root
        self.tokenizer = llm.engine.tokenizer
        self.max_model_len = llm.engine.max_model_len

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
            logger.warning("ignoring unknown request field(s): %s", ", ".join(req.ignored_fields))
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
        self, prompt_ids: list[int], req: _SamplingRequest, max_tokens: int, param: str
    ) -> RequestStream:
        sampling = req.to_sampling_params(max_tokens)
        try:
            return await self.llm.add_request(prompt_ids, sampling, random_id("req"))
        except EngineError as e:
            raise _engine_error(e) from e
        except ValueError as e:
            raise RequestError(str(e), param=param) from e

    @staticmethod
    async def _collect(stream: RequestStream) -> RequestOutput:
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
        except EngineError as e:
            raise _engine_error(e) from e
        finally:
            stream.abort()  # no-op once finished; frees the KV if we were cancelled
        assert final is not None
        return final

    def _sse(self, events: AsyncIterator[str], stream: RequestStream) -> EventStream:
        return EventStream(self._sse_events(events, stream), stream)

    async def _sse_events(
        self, events: AsyncIterator[str], stream: RequestStream
    ) -> AsyncIterator[str]:
        """Wrap a chunk generator: engine errors become an error event; always end with [DONE]."""
        try:
            async for event in events:
                yield event
        except EngineError as e:
            err = _engine_error(e)
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            stream.abort()
        yield DONE

    def _token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def create_chat_completion(
        self, req: ChatCompletionRequest
    ) -> dict[str, Any] | EventStream:
        model = self._check_request(req)
        messages = req.template_messages()
        extra = {
            k: v
            for k, v in (req.chat_template_kwargs or {}).items()
            if k not in _RESERVED_TEMPLATE_KEYS
        }
        if req.chat_template:
            extra["chat_template"] = req.chat_template
        try:
            prompt_ids = await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                tokenize=True,
                **extra,
            )
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), param="messages") from e
        max_param = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = self._max_tokens(
            len(prompt_ids), req.requested_max_tokens, "messages", max_param
        )
        stream = await self._start(prompt_ids, req, max_tokens, "messages")
        rid, created = random_id("chatcmpl"), now()
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
            spec_decode=out.spec_decode_stats.as_dict(),
        ).model_dump()  # fmt: skip

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
                spec_decode=out.spec_decode_stats.as_dict() if out.finished else None,
            )
        if req.include_usage and out is not None:
            yield chunk([], usage=_usage(out), spec_decode=out.spec_decode_stats.as_dict())

    # ---- /v1/completions -----------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest) -> dict[str, Any] | EventStream:
        model = self._check_request(req)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            prompt_ids = list(prompt)
        max_tokens = self._max_tokens(len(prompt_ids), req.max_tokens, "prompt", "max_tokens")
        stream = await self._start(prompt_ids, req, max_tokens, "prompt")
        rid, created = random_id("cmpl"), now()
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
            spec_decode=out.spec_decode_stats.as_dict(),
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
                spec_decode=out.spec_decode_stats.as_dict() if out.finished else None,
            )
        if req.include_usage and out is not None:
            yield chunk([], usage=_usage(out), spec_decode=out.spec_decode_stats.as_dict())
