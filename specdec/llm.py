"""LLM: the offline entry point, shaped like vLLM's."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from specdec.beam_search import BeamSearchOutput, BeamSearchSequence, get_beam_search_score
from specdec.config import EngineArgs, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.request import Request
from specdec.engine.samples import merge_group, plan_samples, warmup_sampling
from specdec.inputs import TextPrompt, TokensPrompt
from specdec.metrics import EngineMetrics
from specdec.metrics_reader import Metric, snapshot
from specdec.model.registry import DEFAULT_MODEL
from specdec.outputs import PositionLogprobs, RequestOutput
from specdec.sampling_params import BeamSearchParams, SamplingParams
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
        self._start(args, list(names) if names else [model])

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._start(args, [args.model])
        return llm

    def _start(self, args: EngineArgs, served_model_names: list[str]) -> None:
        self.served_model_names: list[str] = served_model_names
        self.engine = LLMEngine(args.create_engine_config())
        self._generation_defaults = args.generation_defaults()
        # NOTE: vLLM's names only, as vLLM's LLM.get_metrics reads them; disable_log_stats
        # turns them off (as in vLLM)
        self._metrics = (
            None
            if args.disable_log_stats
            else EngineMetrics(served_model_names[0], prefixes=("vllm",))
        )

    def get_metrics(self) -> list[Metric]:
        """The engine's Prometheus metrics with vLLM's names (``vllm:prompt_tokens``,
        ``vllm:generation_tokens``, ``vllm:time_to_first_token_seconds``, ...) as vLLM's
        reader dataclasses (``specdec.metrics_reader``: Counter, Gauge, Histogram, Vector),
        totals over everything this LLM ran. Off with ``disable_log_stats=True``."""
        if self._metrics is None:
            raise RuntimeError("get_metrics: stat logging is disabled (disable_log_stats=True)")
        self._metrics.update(self.engine)
        return snapshot(self._metrics.registry)

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
        warm = self._shared_prefills(groups, params)
        if warm:
            self._run(self._enqueue_all(warm), use_tqdm=False)
        req_ids = self._enqueue_all([r for samples, _ in groups for r in samples])
        done = {o.request_id: o for o in self._run(req_ids, use_tqdm)}
        outs = []
        for (samples, _), sp in zip(groups, params):
            finished = [done[r.req_id] for r in samples if r.req_id in done]
            if finished:
                outs.append(merge_group(samples[0].req_id.rsplit("-", 1)[0], finished, sp))
        return outs

    def _make_samples(self, prompt: object, sp: SamplingParams, salt: str | None) -> list[Request]:
        """One request, or for n / best_of one per sample (``engine/samples.py``)."""
        group = None if sp.num_samples == 1 else self.engine.new_request_id()
        plan = plan_samples(sp, group, 0, False)
        return [self.engine.make_request(prompt, s, i, salt) for i, s in plan.samples]

    def _shared_prefills(
        self, groups: list[tuple[list[Request], str | None]], params: list[SamplingParams]
    ) -> list[Request]:
        """For prompts with several samples, one prefill each (one token, greedy) that leaves the
        prompt's KV in the prefix cache, so the samples copy it instead of each computing it."""
        warm = []
        for (samples, salt), sp in zip(groups, params):
            ids = samples[0].prompt_token_ids
            warmup = warmup_sampling(sp, len(ids), self.engine.prefix_caching)
            if warmup is not None:
                warm.append(self.engine.make_request(ids, warmup, cache_salt=salt))
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

    def beam_search(
        self,
        prompts: TextPrompt | TokensPrompt | str | Sequence[TextPrompt | TokensPrompt | str],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search, as vLLM's ``LLM.beam_search``: per prompt the ``params.beam_width`` best
        sequences (``BeamSearchOutput.sequences``, best first; ``tokens`` and ``text`` include
        the prompt). Each step runs every live beam once through the engine (its prefix comes
        from the prefix cache), expands it by its top ``2 * beam_width`` tokens and keeps the
        ``beam_width`` best by length-penalised cumulative log-probability; a beam that draws
        an end-of-generation token is finished. ``concurrency_limit``: prompts searched
        together (default all)."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params must be a BeamSearchParams")
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        starts = []
        for i, p in enumerate(items):
            try:
                prompt, salt = _unpack_prompt(p)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
            ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            starts.append((list(ids), salt))
        limit = concurrency_limit or len(starts) or 1
        outputs: list[BeamSearchOutput] = []
        for lo in range(0, len(starts), limit):
            outputs.extend(self._beam_search(starts[lo : lo + limit], params, use_tqdm))
        return outputs

    def _beam_search(
        self,
        starts: list[tuple[list[int], str | None]],
        params: BeamSearchParams,
        use_tqdm: bool,
    ) -> list[BeamSearchOutput]:
        """Beam search over a few prompts together: (prompt token ids, cache salt) each."""
        tok = self.engine.tokenizer
        eos = set() if params.ignore_eos else set(tok.eog_token_ids)
        max_len = self.engine.max_model_len

        def score(b: BeamSearchSequence) -> float:
            return get_beam_search_score(b.tokens, b.cum_logprob, eos, params.length_penalty)

        step = SamplingParams(
            temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width
        )
        live = [[BeamSearchSequence(tokens=list(ids))] for ids, _ in starts]
        done: list[list[BeamSearchSequence]] = [[] for _ in starts]
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            for i, beams in enumerate(live):  # NOTE: no room for another token: finished
                done[i] += [_ended(b, "length") for b in beams if len(b.tokens) >= max_len]
                live[i] = [b for b in beams if len(b.tokens) < max_len]
            batch = [(i, b) for i, beams in enumerate(live) for b in beams]
            if not batch:
                break
            prompts = [_tokens_prompt(b.tokens, starts[i][1]) for i, b in batch]
            results = self.generate(prompts, step, use_tqdm=False)
            grown: list[list[BeamSearchSequence]] = [[] for _ in starts]
            for (i, beam), result in zip(batch, results):
                for new in _expand(beam, result.outputs[0].logprobs[0]):
                    if new.tokens[-1] in eos:
                        done[i].append(_ended(new, "stop"))
                    else:
                        grown[i].append(new)
            live = [sorted(g, key=score, reverse=True)[: params.beam_width] for g in grown]
        outputs = []
        for beams, finished in zip(live, done):
            ranked = sorted(
                finished + [_ended(b, "length") for b in beams], key=score, reverse=True
            )
            best = ranked[: params.beam_width]
            for b in best:
                keep = b.tokens
                if b.finish_reason == "stop" and not params.include_stop_str_in_output:
                    keep = keep[:-1]
                b.text = tok.decode(keep, skip_special_tokens=False)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs

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
                        self._observe(out)
                        bar.update(1)
        except BaseException:
            for i in req_ids:
                if i not in done:
                    self.engine.abort_request(i)
            raise
        finally:
            bar.close()
            if self._metrics is not None:
                self._metrics.update(self.engine)
        return [done[i] for i in req_ids if i in done]

    def _observe(self, out: RequestOutput) -> None:
        """A finished request's latencies into the metrics (failures: the engine counts)."""
        if self._metrics is not None and out.outputs[0].finish_reason != "error":
            self._metrics.observe_first_token(out)
            self._metrics.observe_finished(out)


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


def _tokens_prompt(ids: list[int], salt: str | None) -> TokensPrompt:
    return (
        {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
    )


def _expand(beam: BeamSearchSequence, top: PositionLogprobs) -> list[BeamSearchSequence]:
    """``beam`` extended by each of its next step's top tokens (``top``: that step's
    log-probabilities, the sampled token's and the top ones)."""
    return [
        BeamSearchSequence(
            tokens=[*beam.tokens, token_id],
            logprobs=[*beam.logprobs, top],
            cum_logprob=beam.cum_logprob + lp.logprob,
        )
        for token_id, lp in top.items()
    ]


def _ended(beam: BeamSearchSequence, finish_reason: str) -> BeamSearchSequence:
    beam.finish_reason = finish_reason
    return beam


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
