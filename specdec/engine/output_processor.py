"""Output building: a ``Request`` after a step becomes the ``RequestOutput`` handed out.

Deltas for streaming (a possible stop string held back), vLLM's log-probability dicts (each
position built once, prompt rows per prefill chunk), and the request forgotten when it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


class OutputProcessor:
    """Builds ``RequestOutput``s; keeps per request only its log-probability dicts."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # per request with logprobs: the dicts built so far and the cumulative logprob
        self._logprob_dicts: dict[str, _LogprobCache] = {}
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprob dicts)

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output now: full text and ids, and the delta since the last one."""
        finished = req.is_finished
        text = req.output_text
        if not finished and req.sampling.stop:
            # NOTE: hold back what could be the start of a stop string.
            hold = max(len(s) for s in req.sampling.stop) - 1
            text = text[: max(req.num_streamed_chars, len(text) - hold)]
        delta_text = text[req.num_streamed_chars :]
        req.num_streamed_chars = len(text)
        delta_ids = req.output_token_ids[req.num_streamed_tokens :]
        provenance = _provenance(req, req.num_streamed_tokens)
        req.num_streamed_tokens = len(req.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=req.output_text if finished else text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        if req.sampling.logprobs is not None:
            completion.logprobs, completion.cumulative_logprob = self._output_logprobs(req)
        prompt_logprobs = None
        if req.sampling.prompt_logprobs is not None:
            prompt_logprobs = list(self._prompt_logprob_cache(req).prompt)
        if finished:
            self.forget(req.req_id)
        return RequestOutput(
            request_id=req.req_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            spec_decode_stats=req.spec_stats.copy(),
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            prompt_logprobs=prompt_logprobs,
            delta_provenance=provenance,
        )

    def forget(self, req_id: str) -> None:
        """Drop a finished or aborted request's dicts."""
        self._logprob_dicts.pop(req_id, None)

    def add_prompt_logprobs(
        self,
        sched: SchedulerOutput,
        rows: list[list[TokenLogprobs] | None],
        requests: dict[str, Request],
    ) -> None:
        """This step's prompt rows as dicts now. NOTE: built at the first output instead, 2,700
        positions of top-20 took one step 0.2 s; per prefill chunk they cost that chunk's share."""
        for s, new in zip(sched.scheduled, rows):
            req = requests.get(s.req_id)
            if new and req is not None:
                self._prompt_logprob_cache(req)

    def _output_logprobs(self, req: Request) -> tuple[list[PositionLogprobs], float]:
        """vLLM's per-position dicts for the request's output so far (built once per position)
        and the cumulative log-probability of its tokens."""
        cache = self._logprob_dicts.setdefault(req.req_id, _LogprobCache())
        for t in req.output_logprobs[len(cache.output) :]:
            cache.output.append(self._logprob_dict(t))
            cache.cumulative += t.logprob
        return list(cache.output), cache.cumulative

    def _prompt_logprob_cache(self, req: Request) -> _LogprobCache:
        """None for the first prompt token, then each one's dict (built once)."""
        cache = self._logprob_dicts.setdefault(req.req_id, _LogprobCache())
        for t in req.prompt_logprobs[len(cache.prompt) - 1 :]:
            cache.prompt.append(self._logprob_dict(t))
        return cache

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


def _provenance(req: Request, start: int) -> list[TokenProvenance]:
    """Provenance of the output tokens from ``start`` on. Once finished, text ends are clipped
    to the final text (a stop string cut it) and the last token owns whatever text is left
    (bytes a finalize() flushed)."""
    ends = req.output_char_ends[start:]
    drafts = req.output_from_draft[start:]
    if req.is_finished and ends:
        final = len(req.output_text)
        ends = [min(e, final) for e in ends]
        ends[-1] = final
    return [TokenProvenance(e, d) for e, d in zip(ends, drafts)]
