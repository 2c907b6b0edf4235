"""``POST /v1/completions``: prompts (text or token ids, one or many), echo, and the completion
reply shapes with OpenAI's legacy logprobs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from specdec.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now,
)
from specdec.entrypoints.openai.serving_engine import OpenAIServingBase, Provenance
from specdec.entrypoints.openai.serving_stream import (
    EventStream,
    Job,
    merge_job,
    new_logprobs,
)
from specdec.outputs import CompletionOutput, PositionLogprobs, RequestOutput


class OpenAIServingCompletion(OpenAIServingBase):
    """The completions endpoint."""

    async def create_completion(
        self, req: CompletionRequest, rid: str | None = None
    ) -> bytes | EventStream:
        rid, model = self._check_request(req, rid, "cmpl")
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
        grouped: list[tuple[Job, list[RequestOutput]]],
        rid: str,
        created: int,
        model: str,
    ) -> bytes:
        """The non-streamed completion response, encoded (on the response pool)."""
        choices, every = [], []
        for job, outs in grouped:
            every.extend((job, o) for o in outs)
            merged = merge_job(job, outs, rid)
            for c in merged.outputs:
                index = job.first_index + c.index
                choices.append(self._completion_choice(req, job, merged, c, index))
        return self._encode_response(
            CompletionResponse, rid, created, model, every, req, choices=choices
        )

    def _echo_text(self, job: Job) -> str:
        if job.prompt_text is not None:
            return job.prompt_text
        return self.tokenizer.decode(job.prompt_ids, skip_special_tokens=False)

    def _completion_choice(
        self,
        req: CompletionRequest,
        job: Job,
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
        self, req: CompletionRequest, jobs: list[Job], rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        chunk = self._chunk_writer(CompletionResponse, rid, created, model)
        offsets: dict[int, int] = {}

        def choice(
            index: int, job: Job, out: RequestOutput, first: bool, text: str, provenance: Provenance
        ) -> CompletionChoice | None:
            c = out.outputs[0]
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobs()
                if first and req.echo:
                    self._add_prompt_logprobs(logprobs, job.prompt_ids, out.prompt_logprobs)
                    offsets[index] = len(self._text(logprobs))
                offsets[index] = self._add_logprobs(
                    logprobs, *new_logprobs(out), offsets.get(index, 0)
                )
            if first and req.echo:
                text = self._echo_text(job) + text
            if not (text or out.finished or (logprobs and logprobs.tokens) or provenance):
                return None
            return CompletionChoice(
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

        async for event in self._stream_choices(req, jobs, chunk, choice):
            yield event
