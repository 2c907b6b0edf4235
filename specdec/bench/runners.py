"""One request at a time through our engine or an anchor (transformers, llama.cpp).

Every runner turns prompt token ids into a ``TurnResult`` with wall-clock seconds from submitting
the request to its last token (prefill included) and the time to the first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from specdec.bench.configs import BenchConfig
from specdec.bench.dataset import BenchItem, PromptBuilder
from specdec.spec_decode.metrics import SpecDecodeStats


class AnchorUnavailable(RuntimeError):
    """An optional anchor cannot run here (package missing, model format unsupported)."""


@dataclass
class GenParams:
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class EngineArgs:
    model: str
    kernels: str = "auto"
    quantization: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    activation_dtype: str = "auto"
    kv_cache_dtype: str = "auto"


@dataclass
class TurnResult:
    num_prompt_tokens: int
    output_token_ids: list[int]
    seconds: float
    ttft_s: float | None
    finish_reason: str | None = None
    spec: SpecDecodeStats | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Runner(Protocol):
    def generate(self, prompt_ids: list[int], params: GenParams) -> TurnResult: ...

    def reset_prefix_cache(self) -> None: ...

    def close(self) -> None: ...


def run_item(
    runner: Runner, builder: PromptBuilder, item: BenchItem, params: GenParams, config: BenchConfig
) -> dict:
    """All turns of one item, each reply fed back; one per-prompt record (see results.json)."""
    replies: list[str] = []
    turns: list[TurnResult] = []
    error = None
    try:
        for _ in item.turns:
            result = runner.generate(builder.prompt_ids(item, replies), params)
            turns.append(result)
            replies.append(builder.reply_text(result.output_token_ids))
    except ValueError as e:  # e.g. the prompt (with history) exceeds max_model_len
        error = str(e)
    return make_record(item, config, turns, error)


def make_record(
    item: BenchItem, config: BenchConfig, turns: list[TurnResult], error: str | None = None
) -> dict:
    spec = None
    if not config.is_plain and config.backend == "specdec":
        spec = SpecDecodeStats()
        for t in turns:
            if t.spec is not None:
                spec.merge(t.spec)
    return {
        "id": item.id,
        "category": item.category,
        "config": config.label,
        "backend": config.backend,
        "num_turns": len(item.turns),
        "prompt_tokens": sum(t.num_prompt_tokens for t in turns),
        "cached_prompt_tokens": sum(t.num_cached_tokens for t in turns),
        "output_tokens": sum(len(t.output_token_ids) for t in turns),
        "seconds": sum(t.seconds for t in turns),
        "ttft_s": turns[0].ttft_s if turns else None,
        "turns": [
            {
                "prompt_tokens": t.num_prompt_tokens,
                "cached_prompt_tokens": t.num_cached_tokens,
                "output_tokens": len(t.output_token_ids),
                "seconds": t.seconds,
                "ttft_s": t.ttft_s,
                "finish_reason": t.finish_reason,
                "output_token_ids": list(t.output_token_ids),
            }
            for t in turns
        ],
        "spec_decode": _spec_dict(spec) if spec is not None else None,
        "identical_to_plain": None,
        "first_mismatch": None,
        "error": error,
    }


def _spec_dict(spec: SpecDecodeStats) -> dict:
    return {
        **spec.as_dict(),
        "acceptance_rate_per_pos": [round(x, 4) for x in spec.acceptance_rate_per_pos()],
    }


# ---- our engine ---------------------------------------------------------------------------------
class SpecdecRunner:
    def __init__(self, config: BenchConfig, engine: EngineArgs) -> None:
        from specdec.llm import LLM

        self.llm = LLM(
            engine.model,
            speculative_config=config.speculative_config(),
            kernels=engine.kernels,
            quantization=engine.quantization,
            activation_dtype=engine.activation_dtype,
            max_model_len=engine.max_model_len,
            max_num_seqs=1,  # NOTE: batch size 1; one running slot (plus prefix cache slots)
            seed=engine.seed,
            enable_prefix_caching=engine.enable_prefix_caching,
            kv_cache_dtype=engine.kv_cache_dtype,
        )

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def generate(self, prompt_ids: list[int], params: GenParams) -> TurnResult:
        from specdec.sampling_params import SamplingParams

        sp = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            seed=None if params.greedy else params.seed,
            ignore_eos=params.ignore_eos,
        )
        engine = self.llm.engine
        start = time.perf_counter()
        req_id = engine.add_request(prompt_ids, sp)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == req_id and out.finished:
                    final = out
        seconds = time.perf_counter() - start
        if final is None:
            raise RuntimeError(f"request {req_id} did not finish")
        ttft = final.metrics.time_to_first_token if final.metrics is not None else None
        completion = final.outputs[0]
        return TurnResult(
            len(prompt_ids),
            list(completion.token_ids),
            seconds,
            ttft,
            completion.finish_reason,
            final.spec_decode_stats,
            final.num_cached_tokens,
        )

    def reset_prefix_cache(self) -> None:
        self.llm.engine.reset_prefix_cache()

    def close(self) -> None:
        self.llm = None  # type: ignore[assignment]


# ---- transformers -----------------------------------------------------------------------------
def load_hf_model(path: Path, cache: dict[str, Any]):
    """``AutoModelForCausalLM`` in float32 from a GGUF file or a Hugging Face folder (cached)."""
    key = str(path)
    if key not in cache:
        try:
            import transformers
        except ImportError as e:
            raise AnchorUnavailable(
                "transformers is not installed (pip install transformers accelerate)"
            ) from e
        auto = transformers.AutoModelForCausalLM
        if path.is_file():
            model = auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        else:
            model = auto.from_pretrained(str(path), dtype=torch.float32)
        cache[key] = model.eval()
    return cache[key]


class _FirstTokenTimer:
    """A transformers streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2:  # the first put is the prompt
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


class HFRunner:
    def __init__(
        self, config: BenchConfig, model_path: Path, eog_token_ids: set[int], cache: dict[str, Any]
    ) -> None:
        from specdec.model.registry import resolve_model_path

        self.model = load_hf_model(model_path, cache)
        self.kwargs = dict(config.options)
        if "assistant_model" in self.kwargs:
            self.kwargs["assistant_model"] = load_hf_model(
                resolve_model_path(str(self.kwargs["assistant_model"])), cache
            )
        self.eog = sorted(eog_token_ids)

    def generate(self, prompt_ids: list[int], params: GenParams) -> TurnResult:
        kwargs: dict[str, Any] = dict(self.kwargs)
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            torch.manual_seed(params.seed)
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=1.0, top_k=0)
        if params.ignore_eos:
            kwargs["min_new_tokens"] = params.max_tokens
        timer = _FirstTokenTimer()
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=params.max_tokens,
                eos_token_id=self.eog or None,
                pad_token_id=self.eog[0] if self.eog else None,
                streamer=timer,
                **kwargs,
            )
        seconds = time.perf_counter() - start
        new = out[0, len(prompt_ids) :].tolist()
        ttft = None if timer.first_token_time is None else timer.first_token_time - start
        finish = "stop" if new and new[-1] in self.eog and not params.ignore_eos else "length"
        return TurnResult(len(prompt_ids), new, seconds, ttft, finish)

    def reset_prefix_cache(self) -> None:
        pass  # nothing is cached across generate calls

    def close(self) -> None:
        self.model = None


# ---- llama.cpp ----------------------------------------------------------------------------------
class LlamaCppRunner:
    def __init__(
        self, config: BenchConfig, model_path: Path, eog_token_ids: set[int], n_ctx: int, seed: int
    ) -> None:
        try:
            import llama_cpp
        except ImportError as e:
            raise AnchorUnavailable(
                "llama-cpp-python is not installed (pip install llama-cpp-python)"
            ) from e
        if model_path.suffix != ".gguf":
            raise AnchorUnavailable(f"llama.cpp needs a GGUF file, not {model_path}")
        draft = None
        if config.method == "prompt_lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(**config.options)
        threads = torch.get_num_threads()
        # NOTE: logits_all=True: with a draft model and the default, llama-cpp-python crashes past
        # 512 tokens of context (see ANCHORS.md).
        self.llm = llama_cpp.Llama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            draft_model=draft,
            seed=seed,
            verbose=False,
        )
        self.eog = set(eog_token_ids) | {self.llm.token_eos()}

    def generate(self, prompt_ids: list[int], params: GenParams) -> TurnResult:
        self.llm.reset()  # NOTE: no prompt-prefix reuse across requests (ours has prefix caching)
        tokens: list[int] = []
        first = None
        finish = "length"
        start = time.perf_counter()
        gen = self.llm.generate(
            prompt_ids, top_k=1 if params.greedy else 0, top_p=1.0, min_p=0.0, temp=params.temperature,
            repeat_penalty=1.0, reset=True,
        )  # fmt: skip
        for tok in gen:
            if first is None:
                first = time.perf_counter()
            tokens.append(int(tok))
            if not params.ignore_eos and tok in self.eog:
                finish = "stop"
                break
            if len(tokens) >= params.max_tokens:
                break
        seconds = time.perf_counter() - start
        return TurnResult(
            len(prompt_ids), tokens, seconds, None if first is None else first - start, finish
        )

    def reset_prefix_cache(self) -> None:
        pass  # reset() before every request

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()
        self.llm = None
