"""Output building: the engine's per-step messages become the ``RequestOutput``s handed out.

The output processor never reads the scheduler's ``Request``: it keeps its own state per request
(registered when the request is queued, dropped when it finishes or is aborted) and builds each
output from an ``EngineCoreOutput`` (vLLM v1's ``OutputProcessor.process_outputs``). Deltas for
streaming (a possible stop string held back), vLLM's log-probability dicts (each position built
once, prompt rows per prefill chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.core_output import EngineCoreOutput
from specdec.engine.request import Request
from specdec.engine.scheduler import SchedulerOutput
from specdec.model.tokenizer import Tokenizer
from specdec.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    TokenProvenance,
)
from specdec.sample.logprobs import TokenLogprobs


@dataclass
class _LogprobCache:
    """A request's log-probability dicts as handed out (each position built once)."""

    output: list[PositionLogprobs] = field(default_factory=list)
    cumulative: float = 0.0
    prompt: list[PositionLogprobs | None] = field(default_factory=lambda: [None])


@dataclass
class RequestState:
    """What the output processor keeps of one request between its outputs."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stop: list[str] | None
    logprobs: bool  # output log-probabilities asked for
    prompt_logprobs: bool
    output_token_ids: list[int] = field(default_factory=list)
    num_streamed_chars: int = 0  # of the output text, handed out as deltas


class OutputProcessor:
    """Builds ``RequestOutput``s from ``EngineCoreOutput``s; keeps per request its own state."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}
        # per request with logprobs: the dicts built so far and the cumulative logprob
        self._logprob_dicts: dict[str, _LogprobCache] = {}
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprob dicts)

    def add_request(self, req: Request) -> None:
        """Start following a queued request (what its outputs repeat: prompt, sampling flags)."""
        sp = req.sampling
        self._states[req.req_id] = RequestState(
            req.req_id, req.prompt, req.prompt_token_ids, sp.stop or None,
            sp.logprobs is not None, sp.prompt_logprobs is not None,
        )  # fmt: skip

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """One step's messages as outputs (requests no longer followed are skipped)."""
        made = (self.make_output(o) for o in outputs)
        return [out for out in made if out is not None]

    def make_output(self, core: EngineCoreOutput) -> RequestOutput | None:
        """The request's output now: full text and ids, and the delta since the last one."""
        state = self._states.get(core.req_id)
        if state is None:
            return None
        finished = core.finished
        text = core.output_text
        if not finished and state.stop:
            # NOTE: hold back what could be the start of a stop string.
            hold = max(len(s) for s in state.stop) - 1
            text = text[: max(state.num_streamed_chars, len(text) - hold)]
        delta_text = text[state.num_streamed_chars :]
        state.num_streamed_chars = len(text)
        state.output_token_ids.extend(core.new_token_ids)
        completion = CompletionOutput(
            index=0,
            text=core.output_text if finished else text,
            token_ids=list(state.output_token_ids),
            finish_reason=core.finish_reason,
            stop_reason=core.stop_reason,
        )
        if state.logprobs:
            completion.logprobs, completion.cumulative_logprob = self._output_logprobs(core)
        prompt_logprobs = None
        if state.prompt_logprobs:
            prompt_logprobs = list(self._cache(core.req_id).prompt)
        if finished:
            self.forget(core.req_id)
        return RequestOutput(
            request_id=core.req_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            spec_decode_stats=core.spec_stats,
            metrics=core.metrics,
            num_cached_tokens=core.num_cached_tokens,
            error=core.error,
            delta_text=delta_text,
            delta_token_ids=core.new_token_ids,
            prompt_logprobs=prompt_logprobs,
            delta_provenance=_provenance(core),
        )

    def forget(self, req_id: str) -> None:
        """Stop following a finished or aborted request."""
        self._states.pop(req_id, None)
        self._logprob_dicts.pop(req_id, None)

    def add_prompt_logprobs(
        self, sched: SchedulerOutput, rows: list[list[TokenLogprobs] | None]
    ) -> None:
        """This step's prompt rows as dicts now. NOTE: built at the first output instead, 2,700
        positions of top-20 took one step 0.2 s; per prefill chunk they cost that chunk's share."""
        for s, new in zip(sched.scheduled, rows):
            if new and s.req_id in self._states:
                cache = self._cache(s.req_id)
                cache.prompt.extend(self._logprob_dict(t) for t in new)

    def _cache(self, req_id: str) -> _LogprobCache:
        return self._logprob_dicts.setdefault(req_id, _LogprobCache())

    def _output_logprobs(self, core: EngineCoreOutput) -> tuple[list[PositionLogprobs], float]:
        """vLLM's per-position dicts for the request's output so far (built once per position)
        and the cumulative log-probability of its tokens."""
        cache = self._cache(core.req_id)
        for t in core.new_logprobs:
            cache.output.append(self._logprob_dict(t))
            cache.cumulative += t.logprob
        return list(cache.output), cache.cumulative

    def _logprob_dict(self, t: TokenLogprobs) -> PositionLogprobs:
        """The chosen token, then the top-N: token id -> Logprob (rank, decoded text)."""
        out: PositionLogprobs = {
            t.token_id: Logprob(t.logprob, t.rank, self._token_text(t.token_id))
        }
        for rank, (tok, lp) in enumerate(zip(t.top_token_ids, t.top_logprobs), start=1):
            if tok != t.token_id:
                out[tok] = Logprob(lp, rank, self._token_text(tok))
        return out

    def _token_text(self, token_id: int) -> str:
        # NOTE: remembered: 2,700 prompt positions of top-20 are 57k decodes (0.4 s) otherwise
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text


def _provenance(core: EngineCoreOutput) -> list[TokenProvenance]:
    """Provenance of the new tokens. Once finished, text ends are clipped to the final text (a
    stop string cut it) and the last token owns whatever text is left (bytes a finalize()
    flushed)."""
    ends = core.new_char_ends
    if core.finished and ends:
        final = len(core.output_text)
        ends = [min(e, final) for e in ends]
        ends[-1] = final
    return [TokenProvenance(e, d) for e, d in zip(ends, core.new_from_draft)]
