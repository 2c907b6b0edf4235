"""LLM: the offline entry point, shaped like vLLM's."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from specdec.config import EngineArgs, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.request import Request
from specdec.model.registry import DEFAULT_MODEL
from specdec.outputs import RequestOutput, merge_samples
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
        served_model_name: str | list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """``served_model_name``: the names a server would answer to (vLLM's argument; offline
        it only names the model: ``served_model_names``, default the model as given)."""
        names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
        if names is not None and (not names or not all(isinstance(n, str) and n for n in names)):
            raise ValueError("served_model_name must be a non-empty name or list of names")
        args = EngineArgs.from_kwargs(
            "LLM()", model=model, speculative_config=speculative_config, **kwargs
        )
        self.engine = LLMEngine(args.create_engine_config())
        self._generation_defaults = args.generation_defaults()
        self.served_model_names: list[str] = list(names) if names else [model]

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.served_model_names = [args.model]
        llm.engine = LLMEngine(args.create_engine_config())
        llm._generation_defaults = args.generation_defaults()
        return llm

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without SamplingParams: vLLM's generation_config /
        override_generation_config defaults, else SamplingParams()."""
        return SamplingParams(**self._generation_defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it)."""
        return self.engine

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        """Acceptance statistics over everything this LLM generated."""
        return self.engine.spec_stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a batch: strings, token id lists, or vLLM's dicts
        ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` with an optional ``"cache_salt"``.

        Every request is checked first; a bad one raises ValueError naming ``prompts[i]`` or
        ``sampling_params[i]``, with nothing queued. A request that fails while running (say,
        non-finite logits) comes back with ``finish_reason == "error"`` and ``.error``; the
        others are unaffected."""
        prompts = _split_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # NOTE: every request is checked before any is queued: a bad one raises naming its
        # index, and nothing of the call is left behind.
        groups: list[tuple[list[Request], str | None]] = []  # per prompt: its samples, its salt
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams")
            try:
                sp.validate()
            except ValueError as e:
                raise ValueError(f"sampling_params[{i}]: {e}") from e
            try:
                prompt, salt = _unpack_prompt(p)
                groups.append((self._make_samples(prompt, sp, salt), salt))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
        warm = self._shared_prefills(groups)
        if warm:
            self._run(self._enqueue_all(warm), use_tqdm=False)
        req_ids = self._enqueue_all([r for samples, _ in groups for r in samples])
        done = {o.request_id: o for o in self._run(req_ids, use_tqdm)}
        outs = []
        for (samples, _), sp in zip(groups, params):
            finished = [done[r.req_id] for r in samples if r.req_id in done]
            if len(samples) == 1 or not finished:
                outs.extend(finished)
                continue
            group_id = samples[0].req_id.rsplit("-", 1)[0]
            outs.append(merge_samples(group_id, finished, sp.n, sp.logprobs is not None))
        return outs

    def _make_samples(self, prompt: object, sp: SamplingParams, salt: str | None) -> list[Request]:
        """One request, or for n / best_of one per sample (ids ``{group}-{i}``, seeds seed + i)."""
        if sp.num_samples == 1:
            return [self.engine.make_request(prompt, sp, cache_salt=salt)]
        group = self.engine.new_request_id()
        return [
            self.engine.make_request(prompt, sp.for_sample(i), f"{group}-{i}", salt)
            for i in range(sp.num_samples)
        ]

    def _shared_prefills(self, groups: list[tuple[list[Request], str | None]]) -> list[Request]:
        """For prompts with several samples, one prefill each (one token, greedy) that leaves the
        prompt's KV in the prefix cache, so the samples copy it instead of each computing it."""
        if not self.engine.kv.enable_prefix_caching:
            return []
        warm = []
        for samples, salt in groups:
            ids = samples[0].prompt_token_ids
            if len(samples) > 1 and len(ids) > 1 and samples[0].sampling.prompt_logprobs is None:
                sp = SamplingParams(temperature=0.0, max_tokens=1, seed=0)
                warm.append(self.engine.make_request(ids, sp, cache_salt=salt))
        return warm

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Render one conversation or a list of them with the chat template, then generate (vLLM's
        signature). ``chat_template`` replaces the model's; ``chat_template_kwargs`` (and
        ``tools``) become template variables (``enable_thinking=False``, ...);
        ``continue_final_message`` continues the last (assistant) message instead of opening a
        new turn. Text content parts (``[{"type": "text", "text": ...}]``) are joined."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        del chat_template_content_format  # NOTE: text parts are joined whatever the format
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages (or of conversations)")
        single = isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        if chat_template is not None:
            extra["chat_template"] = chat_template
        prompts: list[Prompt] = []
        texts: list[str] = []
        for i, conv in enumerate(conversations):
            try:
                text = self._render_chat(conv, add_generation_prompt, continue_final_message, extra)
                prompts.append(self.engine.tokenizer.encode(text, add_special_tokens=False))
            except (ValueError, TypeError) as e:
                where = "messages" if single else f"messages[{i}]"
                raise ValueError(f"{where}: {e}") from e
            texts.append(text)
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text  # NOTE: the rendered conversation, as vLLM's LLM.chat reports it
        return outs

    def _render_chat(
        self,
        conv: object,
        add_generation_prompt: bool,
        continue_final_message: bool,
        extra: dict[str, Any],
    ) -> str:
        """The conversation rendered with the chat template (the text, not yet tokenized)."""
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ValueError("a conversation must be a non-empty list of message dicts")
        msgs = [_text_message(m, j) for j, m in enumerate(conv)]
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=False, **dict(extra)
        )
        if continue_final_message:
            final = msgs[-1].get("content")
            if not isinstance(final, str) or final not in text:
                raise ValueError(
                    "continue_final_message: the final message's text is not in the render"
                )
            text = text[: text.rindex(final) + len(final)]
        return text

    def _enqueue_all(self, reqs: list[Request]) -> list[str]:
        """Queue every request, or none: if one cannot be queued (the drafter refused it), those
        queued before it are aborted and the error goes on."""
        req_ids: list[str] = []
        try:
            for r in reqs:
                req_ids.append(self.engine.enqueue(r))
        except BaseException:
            for i in req_ids:
                self.engine.abort_request(i)
            raise
        return req_ids

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


def _is_token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _split_prompts(prompts: object) -> list[object]:
    """One prompt (a string, a list of token ids, a prompt dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(_is_token_id(t) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise ValueError(
        "prompts must be a string, a list of token ids, a prompt dict or a list of these, not "
        f"{type(prompts).__name__}"
    )


def _unpack_prompt(p: object) -> tuple[object, str | None]:
    """(text or token ids, cache salt) of one prompt; vLLM's TextPrompt / TokensPrompt dicts."""
    if not isinstance(p, dict):
        return p, None
    salt = p.get("cache_salt")
    if "prompt_token_ids" in p:
        ids = p["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(
                f"prompt_token_ids must be a list of token ids, not {type(ids).__name__}"
            )
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        return list(ids), salt
    if "prompt" in p:
        if not isinstance(p["prompt"], str):
            raise ValueError(f"prompt must be a string, not {type(p['prompt']).__name__}")
        return p["prompt"], salt
    raise ValueError(
        f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids'; got keys {sorted(p)}"
    )


def _text_message(m: object, j: int) -> dict[str, Any]:
    """A message dict for the template; text content parts joined into one string."""
    if not isinstance(m, dict):
        raise ValueError(f"message {j} must be a dict, not {type(m).__name__}")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"message {j}: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        m = {**m, "content": "".join(texts)}
    return m
