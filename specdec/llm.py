"""LLM: the offline entry point, shaped like vLLM's."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from specdec.config import EngineArgs, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.model.registry import DEFAULT_MODEL
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.metrics import SpecDecodeStats

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, str]


class LLM:
    """``LLM("smollm2-135m", speculative_config={...}).generate(prompts, SamplingParams(...))``.

    Keyword arguments are ``EngineArgs``' fields (``specdec.config``): the engine options,
    vLLM's older speculative keys (``speculative_model``, ``num_speculative_tokens``, ...), and
    vLLM's GPU options (``tensor_parallel_size=1``, ``enforce_eager``, ``trust_remote_code``, ...),
    accepted and logged once as ignored on CPU. An unknown keyword is a TypeError naming the
    closest known one."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        **kwargs: Any,
    ) -> None:
        args = EngineArgs.from_kwargs(
            "LLM()", model=model, speculative_config=speculative_config, **kwargs
        )
        self.engine = LLMEngine(args.create_engine_config())

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args.create_engine_config())
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        """Acceptance statistics over everything this LLM generated."""
        return self.engine.spec_stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a batch: strings, token id lists, or vLLM's dicts
        ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` with an optional ``"cache_salt"``.

        Every request is checked first; a bad one raises ValueError naming ``prompts[i]`` or
        ``sampling_params[i]``, with nothing queued. A request that fails while running (say,
        non-finite logits) comes back with ``finish_reason == "error"`` and ``.error``; the
        others are unaffected."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # NOTE: every request is checked before any is queued: a bad one raises naming its
        # index, and nothing of the call is left behind.
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams")
            try:
                sp.validate()
            except ValueError as e:
                raise ValueError(f"sampling_params[{i}]: {e}") from e
            try:
                salt = None
                if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt
                    salt = p.get("cache_salt")
                    p = p.get("prompt_token_ids") or p.get("prompt")
                reqs.append(self.engine.make_request(p, sp, cache_salt=salt))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
        return self._run([self.engine.enqueue(r) for r in reqs], use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts: list[Prompt] = [
            tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=True)
            for c in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until this call's requests finish. If a step raises (or the user interrupts),
        the call's unfinished requests are aborted, so none of them runs in a later call."""
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(req_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for i in req_ids:
                if i not in done:
                    self.engine.abort_request(i)
            raise
        finally:
            bar.close()
        return [done[i] for i in req_ids if i in done]


def _signature() -> inspect.Signature:
    """``LLM.__init__``'s signature as help() and IDEs show it: every EngineArgs field."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in fields(EngineArgs):
        kind = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if f.name in ("model", "speculative_config")
            else inspect.Parameter.KEYWORD_ONLY
        )
        params.append(inspect.Parameter(f.name, kind, default=f.default))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
