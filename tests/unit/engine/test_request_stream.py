"""``RequestStream`` merges the outputs a slow consumer left queued: every delta field of the
merged output is the concatenation of the merged ones (the streamed text's provenance included),
and a finished output is never merged past."""

from __future__ import annotations

import asyncio
import dataclasses

from specdec.engine.async_llm import RequestStream
from specdec.outputs import CompletionOutput, RequestOutput, TokenProvenance


def _output(step: int, finished: bool = False) -> RequestOutput:
    ids = [10 * step + 1, 10 * step + 2]
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1],
        outputs=[CompletionOutput(index=0, text="", token_ids=[])],
        finished=finished,
        delta_text=f"s{step}",
        delta_token_ids=ids,
        delta_provenance=[
            TokenProvenance(2 * step + 1, True),
            TokenProvenance(2 * step + 2, False),
        ],
    )


async def _read(outputs: list[RequestOutput]) -> list[RequestOutput]:
    stream = RequestStream("r", owner=None)  # type: ignore[arg-type]  # abort() is not called
    for out in outputs:
        stream._queue.put_nowait(out)  # all queued before the consumer reads: it fell behind
    return [out async for out in stream]


def test_merged_outputs_carry_every_delta_field():
    outputs = [_output(0), _output(1), _output(2, finished=True), _output(3)]
    read = asyncio.run(_read(outputs))
    assert len(read) == 1 and read[0].finished
    deltas = [f.name for f in dataclasses.fields(RequestOutput) if f.name.startswith("delta_")]
    assert {"delta_text", "delta_token_ids", "delta_provenance"} <= set(deltas)
    for name in deltas:
        want = getattr(outputs[0], name) + getattr(outputs[1], name) + getattr(outputs[2], name)
        assert getattr(read[0], name) == want, name
    assert len(read[0].delta_provenance) == len(read[0].delta_token_ids) == 6
