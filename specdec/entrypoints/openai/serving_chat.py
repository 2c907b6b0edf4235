"""``POST /v1/chat/completions``: the conversation rendered with the chat template (the model's,
or on a trusting server the request's own, in the sandbox), tools, and the chat reply shapes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from specdec.entrypoints.openai.chat_sandbox import TemplateRenderError
from specdec.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    RequestError,
    now,
)
from specdec.entrypoints.openai.safety import (
    has_surrogates,
    unrepresentable,
    unrepresentable_error,
)
from specdec.entrypoints.openai.serving_engine import OpenAIServingBase, Provenance
from specdec.entrypoints.openai.serving_stream import (
    EventStream,
    Job,
    merge_job,
    new_logprobs,
)
from specdec.entrypoints.openai.special_tokens import (
    LiteralSpecials,
    find_special,
    special_token_error,
)
from specdec.entrypoints.openai.tools import ToolPlan, plan_tools
from specdec.entrypoints.openai.tools import template_messages as tool_template_messages
from specdec.model.tokenizer import prepare_messages
from specdec.outputs import PositionLogprobs, RequestOutput

_RESERVED_TEMPLATE_KEYS = ("messages", "add_generation_prompt", "tokenize", "chat_template")


class OpenAIServingChat(OpenAIServingBase):
    """The chat endpoint (the Responses API runs on it too: ``responses.py``)."""

    async def create_chat_completion(
        self, req: ChatCompletionRequest, rid: str | None = None
    ) -> bytes | EventStream:
        rid, model = self._check_request(req, rid, "chatcmpl")
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
        job: Job,
        outs: list[RequestOutput],
        rid: str,
        created: int,
        model: str,
    ) -> bytes:
        """The non-streamed chat response, encoded (on the response pool)."""
        plan: ToolPlan | None = req._tool_plan
        merged = merge_job(job, outs, rid)
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
        return self._encode_response(
            ChatCompletionResponse, rid, created, model, [(job, o) for o in outs], req,
            choices=choices, prompt_logprobs=self._prompt_logprobs(merged),
        )  # fmt: skip

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

    async def _chat_chunks(
        self, req: ChatCompletionRequest, jobs: list[Job], rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        chunk = self._chunk_writer(ChatCompletionChunk, rid, created, model)
        for i in range(jobs[0].sampling.n):
            yield chunk(
                [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]
            )
        top = req.top_logprobs or 0
        plan: ToolPlan | None = req._tool_plan

        def choice(
            index: int, job: Job, out: RequestOutput, first: bool, text: str, provenance: Provenance
        ) -> ChatStreamChoice | None:
            c = out.outputs[0]
            logprobs = None
            if req.logprobs:
                entries = self._chat_logprob_entries(*new_logprobs(out), top)
                logprobs = ChatChoiceLogprobs(content=entries)
            delta, finish = DeltaMessage(content=text), c.finish_reason
            if plan is not None:
                # NOTE: calls are read from the whole text: it comes in one delta at the end
                if not out.finished:
                    return None
                message, finish = self._chat_message(plan, c.text, c.finish_reason)
                calls = [{"index": i, **call} for i, call in enumerate(message.tool_calls)]
                delta = DeltaMessage(content=message.content, tool_calls=calls or None)
            if not (delta.content or out.finished or (logprobs and logprobs.content) or provenance):
                return None
            return ChatStreamChoice(
                index=index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None,
                token_provenance=provenance,
            )

        async for event in self._stream_choices(req, jobs, chunk, choice):
            yield event
