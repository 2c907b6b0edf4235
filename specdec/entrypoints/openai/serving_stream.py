"""The engine requests behind one response, as the endpoints stream and count them.

A response is one or more jobs (one per prompt), each one or more engine requests (one per
sample of n / best_of, ``engine/samples.py``). Their streams are read as one (``merged``), aborted
as one (``Streams``), counted once per prompt (``usage``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specdec.engine.async_llm import RequestStream
from specdec.engine.samples import merge_group
from specdec.entrypoints.openai.protocol import PromptTokenUsageInfo, SamplingRequest, UsageInfo
from specdec.entrypoints.openai.stats import ProvenanceAligner
from specdec.outputs import PositionLogprobs, RequestOutput, merge_samples
from specdec.sampling_params import SamplingParams


def usage_info(pairs: list[tuple[Job, RequestOutput]]) -> UsageInfo:
    """Usage of one response: each prompt once, every generated sample (best_of's included)."""
    jobs: dict[int, tuple[Job, int]] = {}  # id(job) -> (job, its most cached tokens)
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


def new_logprobs(out: RequestOutput) -> tuple[list[int], list[PositionLogprobs]]:
    """The token ids of this output's delta and their log-probability dicts."""
    lps = out.outputs[0].logprobs or []
    ids = out.delta_token_ids
    return ids, lps[len(lps) - len(ids) :] if ids else []


class Streams:
    """The engine requests behind one response (samples, prompts) as one stream to abort."""

    def __init__(self, req_id: str, streams: list[RequestStream]) -> None:
        self.req_id = req_id
        self.streams = streams

    def abort(self) -> None:
        for s in self.streams:
            s.abort()


@dataclass
class Job:
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
    stream: RequestStream | Streams

    async def close(self) -> None:
        await self.events.aclose()  # type: ignore[attr-defined]
        self.stream.abort()


_END = object()


async def merge_streams(jobs: list[Job]) -> AsyncIterator[tuple[int, Job, RequestOutput]]:
    """(choice index, its job, output) from every sample's stream, as they come."""
    pairs = [(job.first_index + i, job, s) for job in jobs for i, s in enumerate(job.streams)]
    if len(pairs) == 1:
        index, job, stream = pairs[0]
        async for out in stream:
            yield index, job, out
        return
    queue: asyncio.Queue[tuple[int, Job, object]] = asyncio.Queue()

    async def pump(index: int, job: Job, stream: RequestStream) -> None:
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


def stream_text(
    req: SamplingRequest, aligners: dict[int, ProvenanceAligner], index: int, out: RequestOutput
) -> tuple[str, list[list[int]] | None]:
    """A choice's text to stream now and, with return_token_provenance, its tokens' provenance
    (the text is then cut at token ends)."""
    if not req.return_token_provenance:
        return out.delta_text, None
    aligner = aligners.setdefault(index, ProvenanceAligner())
    return aligner.feed(out.delta_text, out.delta_provenance)


def merge_job(job: Job, outs: list[RequestOutput], rid: str) -> RequestOutput:
    """A job's samples as one output (best_of picks the n best)."""
    return merge_group(rid, outs, job.sampling)


def merge_all(outs: list[RequestOutput]) -> RequestOutput:
    """Outputs of several requests with their acceptance statistics summed (for spec_decode)."""
    if len(outs) == 1:
        return outs[0]
    return merge_samples(outs[0].request_id, outs, len(outs), True)
