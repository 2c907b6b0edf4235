"""The engine: add_request / abort_request / step()."""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.config import ConfigError, EngineConfig, SpeculativeConfig
from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.engine.request import Request
from specdec.engine.scheduler import Scheduler, SchedulerOutput
from specdec.engine.speculator import Speculator
from specdec.kernels import get_ops, int8_activations_fast, native_isa
from specdec.kv_cache.pool import KVCache
from specdec.kv_cache.sizing import plan_kv_slots
from specdec.model.llama import LlamaModel
from specdec.model.loader import load_checkpoint
from specdec.model.registry import resolve_model_path
from specdec.model.tokenizer import Tokenizer
from specdec.model.weight_cache import WeightCache
from specdec.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from specdec.sample.bad_words import BadWords
from specdec.sample.logprobs import LogitsAdjust, TokenLogprobs
from specdec.sample.random import normalize_seed
from specdec.sample.rejection_sampler import PenaltyState
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.metrics import SpecDecodeStats
from specdec.structured.grammar import GrammarCompiler
from specdec.worker.model_runner import ModelRunner

logger = logging.getLogger("specdec.engine")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": torch.float32,
}
DEFAULT_MAX_MODEL_LEN = 4096
# NOTE: decoding SmolLM2-135M on the torch kernels in bfloat16 against the native kernels'
# default (float32 activations, int8 for the GGUF's Q4_1 weights): 33 vs 334 tokens/s on the
# development machine (issue 20); 9 vs 61 on a loaded 2-core VM. Quoted when the slower one runs.
TORCH_HALF_SLOWDOWN = "33 vs 334 tokens/s decoding SmolLM2-135M, measured"


def _own_tokenizer(path: str, vocab_size: int) -> Tokenizer:
    """``tokenizer=``: a Hugging Face tokenizer folder or its tokenizer.json (one-line errors)."""
    try:
        tokenizer = Tokenizer.from_hf_folder(Path(path).expanduser())
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer: cannot load {path!r} ({type(e).__name__}: {e})") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer: {tokenizer.vocab_size} tokens do not fit the model's vocabulary of "
            f"{vocab_size}"
        )
    return tokenizer


def load_model(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    kernels: str,
    quantization: str,
    max_len: int | None,
    activation_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    tokenizer_path: str | None = None,
) -> tuple[LlamaModel, Tokenizer]:
    path = resolve_model_path(model)
    ckpt = load_checkpoint(path)
    if tokenizer_path is not None:
        tokenizer = _own_tokenizer(tokenizer_path, ckpt.arch.vocab_size)
    elif ckpt.gguf_metadata is not None:
        tokenizer = Tokenizer.from_gguf_metadata(ckpt.gguf_metadata)
    else:
        tokenizer = Tokenizer.from_hf_folder(path)
    if dtype != torch.float32 and kernels == "native":
        raise ConfigError(
            "native kernels run float32 only; use --kernels torch for bfloat16/float16"
        )
    ops = get_ops("torch" if dtype != torch.float32 else kernels, device)
    limit = ckpt.arch.max_position_embeddings
    max_len = max_len or min(DEFAULT_MAX_MODEL_LEN, limit)
    if max_len > limit:
        raise ConfigError(
            f"max_model_len {max_len} exceeds the model's context length {limit} "
            f"(--max-model-len {limit} or less)"
        )
    cache = None
    if ops.name == "native" and device.type == "cpu":
        settings = {
            "quantization": quantization, "activation_dtype": activation_dtype,
            "dtype": str(dtype), "isa": native_isa(), "int8_fast": int8_activations_fast(),
        }  # fmt: skip
        cache = WeightCache.for_model(path, settings)
    model = LlamaModel(ckpt, ops, device, dtype, quantization, max_len, activation_dtype, cache)
    if cache is not None and cache.hits:
        logger.info("weights mapped from the weight cache %s", cache.path)
    model.set_kv_dtype(kv_cache_dtype)
    return model, tokenizer


def resolve_dtype(config: EngineConfig) -> tuple[torch.dtype, str]:
    """(compute dtype, kernels) for the requested ``dtype`` and ``kernels``.

    bfloat16 / float16 need the torch kernels. Under ``kernels="auto"`` on a CPU with the native
    kernels built, they keep the native kernels instead (float32 activations, int8 for quantized
    weights; ~10x faster decoding), and say so: a pasted ``--dtype bfloat16`` never makes
    decoding silently slower. With ``kernels="torch"`` they run as asked, with a warning."""
    dtype = _DTYPES[config.dtype]
    if dtype == torch.float32 or config.device != "cpu":
        return dtype, config.kernels
    if config.kernels == "auto" and get_ops("auto", config.device).name == "native":
        logger.warning(
            "dtype %s: kept the native kernels, which compute in float32 (int8 activations for "
            "quantized weights; bfloat16/float16 weights stay 16-bit in memory): the torch "
            "kernels %s needs decode ~10x slower (%s); pass "
            "--kernels torch (kernels='torch') to compute in %s anyway",
            config.dtype, config.dtype, TORCH_HALF_SLOWDOWN, config.dtype,
        )  # fmt: skip
        return torch.float32, "native"
    if config.kernels != "native":
        logger.warning(
            "dtype %s runs on the torch kernels: decoding is ~10x slower than the native "
            "kernels' default (dtype auto: %s)",
            config.dtype, TORCH_HALF_SLOWDOWN,
        )  # fmt: skip
    return dtype, config.kernels


def describe_model(model: LlamaModel) -> str:
    """dtype, kernels, activations, weight format and KV format, for the start-up line."""
    formats: dict[str, int] = {}
    for lw in model.layers:
        for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
            formats[lin.weight.qtype] = formats.get(lin.weight.qtype, 0) + 1
    layers = "/".join(sorted(formats, key=lambda q: -formats[q]))
    isa = getattr(model.ops, "isa", None) if model.ops.name == "native" else None
    return (
        f"dtype {str(model.dtype).removeprefix('torch.')}, kernels {model.ops.name}"
        f"{f' ({isa})' if isa else ''}, activations {model.activation_dtype}, weights {layers} "
        f"(lm_head {model.lm_head.weight.qtype}), KV cache "
        f"{str(model.kv_dtype).removeprefix('torch.')}"
    )


@dataclass
class _LogprobCache:
    """A request's log-probability dicts as handed out (each position built once)."""

    output: list[PositionLogprobs] = field(default_factory=list)
    cumulative: float = 0.0
    prompt: list[PositionLogprobs | None] = field(default_factory=lambda: [None])


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        dtype, kernels = resolve_dtype(config)
        self._kernels = kernels
        self.model, self.tokenizer = load_model(
            config.model,
            self.device,
            dtype,
            kernels,
            config.quantization,
            config.max_model_len,
            config.activation_dtype,
            config.kv_cache_dtype,
            config.tokenizer,
        )
        self.max_model_len = self.model.max_len
        num_running_slots, num_cache_slots = self._num_kv_slots(config)
        self.kv = self.model.make_kv_cache(num_running_slots + num_cache_slots, self.max_model_len)
        self.kv.enable_prefix_caching = config.enable_prefix_caching
        self.scheduler = Scheduler(
            self.kv,
            num_running_slots,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.tokenizer.eog_token_ids,
        )
        # NOTE: requests without a seed draw one here, at admission, and then take the same
        # keyed path as seeded ones.
        self._seeds = random.Random(config.seed)
        self.spec: SpeculativeConfig | None = config.speculative
        self.speculator: Speculator | None = None
        if self.spec is not None:
            self.speculator = Speculator(
                self.spec, self.model, self.kv, self.scheduler, self._load_draft,
                config.max_num_batched_tokens,
            )  # fmt: skip
        hidden_layers = self.speculator.hidden_layers if self.speculator else ()
        self.runner = ModelRunner(self.model, self.kv, hidden_layers)
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens = 0
        self._ids = itertools.count()
        # per request with logprobs: the dicts built so far and the cumulative logprob
        self._logprob_dicts: dict[str, _LogprobCache] = {}
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprob dicts)
        logger.info(
            "engine: %s; %s; max_model_len %d; KV slots: %d running, %d prefix cache; "
            "speculation: %s",
            config.model, describe_model(self.model), self.max_model_len, num_running_slots,
            num_cache_slots,
            f"{self.spec.method} k={self.spec.num_speculative_tokens}" if self.spec else "off",
        )  # fmt: skip

    def _num_kv_slots(self, config: EngineConfig) -> tuple[int, int]:
        """Slots of max_model_len positions: (for running sequences, extra for the prefix
        cache); see ``plan_kv_slots``. Fewer running slots than max_num_seqs are logged."""
        cfg = self.model.cfg
        per_token = KVCache.bytes_per_token(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.model.kv_dtype
        )
        num_running, num_cache = plan_kv_slots(
            self.max_model_len, per_token, config.max_num_seqs, config.enable_prefix_caching,
            config.kv_cache_memory,
        )  # fmt: skip
        if num_running < config.max_num_seqs and config.kv_cache_memory is not None:
            logger.warning(
                "max_num_seqs %d lowered to %d: the KV budget (kv_cache_memory / "
                "gpu_memory_utilization %g) holds %d sequences of max_model_len %d; raise it or "
                "lower max_model_len",
                config.max_num_seqs, num_running, config.kv_cache_memory, num_running,
                self.max_model_len,
            )  # fmt: skip
        return num_running, num_cache

    def _load_draft(self, spec: SpeculativeConfig) -> LlamaModel:
        # NOTE: the draft takes the target's activation format where its weights allow, else its
        # own auto choice: a draft only proposes, so its arithmetic never changes the output, and
        # e.g. a BF16 target's bf16x2 must not fail on a quantized draft.
        try:
            draft, draft_tok = load_model(
                spec.model, self.device, self.model.dtype, self._kernels,
                spec.draft_quantization or self.config.quantization, self.max_model_len,
                "auto", self.config.kv_cache_dtype,
            )  # fmt: skip
        except ConfigError as e:
            # NOTE: the message must say it is the draft (a shorter context, above all)
            raise ConfigError(f"speculative_config.model (the draft model): {e}") from None
        if self.config.activation_dtype not in ("auto", draft.activation_dtype):
            try:
                draft.set_activation_dtype(self.config.activation_dtype)
            except ConfigError as e:
                logger.info("draft model keeps activations %s (%s)", draft.activation_dtype, e)
        if (
            draft.cfg.vocab_size != self.model.cfg.vocab_size
            or draft_tok.vocab_size != self.tokenizer.vocab_size
        ):
            raise ConfigError(
                f"speculative_config.model: the draft's vocabulary ({draft.cfg.vocab_size}) differs from "
                f"the target's ({self.model.cfg.vocab_size}); draft and target must share a tokenizer"
            )
        return draft

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        req_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request. ``cache_salt`` (vLLM's): prompts share cached prefixes only with
        requests of the same salt. Raises ValueError (the queue unchanged) for a bad request."""
        return self.enqueue(self.make_request(prompt, sampling, req_id, cache_salt))

    def make_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        req_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A checked request, not yet queued (``enqueue`` queues it)."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, not {type(sampling).__name__}"
            )
        sampling.validate()  # NOTE: fields may have been changed since it was made
        if sampling.num_samples > 1:
            raise ValueError(
                "n and best_of: one engine request is one sequence; LLM.generate and the server "
                "expand them (SamplingParams.for_sample)"
            )
        req_id = req_id or self.new_request_id()
        text = prompt if isinstance(prompt, str) else None
        ids = self._prompt_ids(prompt)
        self._check_prompt(ids)
        req = Request(
            req_id=req_id,
            prompt=text,
            prompt_token_ids=ids,
            sampling=sampling,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, sampling.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=time.monotonic()),
        )
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(64)
        req.seed = normalize_seed(seed)
        if sampling.has_penalties:
            vocab = self.model.cfg.vocab_size
            mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            mask[torch.tensor(ids, device=self.device)] = True
            req.penalty = PenaltyState(mask, torch.zeros(vocab, device=self.device))
        req.logits_adjust = self._logits_adjust(sampling)
        if sampling.structured_outputs is not None:
            req.grammar = self.grammar_compiler.compile(sampling.structured_outputs)
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError("cache_salt must be a non-empty string")
            digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()
            req.cache_salt = int.from_bytes(digest[:8], "little", signed=True) or 1
        return req

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints against this model's tokenizer."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.model.cfg.vocab_size, sorted(self.tokenizer.eog_token_ids)
            )
        return self._grammars

    def _logits_adjust(self, sampling: SamplingParams) -> LogitsAdjust | None:
        """logit_bias as tensors (token ids checked against the vocabulary) and bad_words as
        token sequences (vLLM's tokenization), or None."""
        if not sampling.logit_bias and not sampling.bad_words:
            return None
        adjust = LogitsAdjust()
        if sampling.logit_bias:
            vocab = self.model.cfg.vocab_size
            bad = [t for t in sampling.logit_bias if t >= vocab]
            if bad:
                raise ValueError(f"logit_bias: token id {bad[0]} is not in [0, {vocab})")
            ids = list(sampling.logit_bias)
            adjust.bias_token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            adjust.bias_values = torch.tensor(
                [float(sampling.logit_bias[t]) for t in ids], device=self.device
            )
        if sampling.bad_words:
            ready = sampling.compiled_bad_words
            if not (isinstance(ready, BadWords) and ready.words == tuple(sampling.bad_words)):
                ready = self.bad_words(sampling.bad_words)
            adjust.bad_words = ready
        return adjust

    def bad_words(self, words: list[str]) -> BadWords:
        """``words`` tokenized and indexed for ``SamplingParams.compiled_bad_words`` (thread-safe:
        the server calls it on its preparation pool). Raises ValueError naming bad_words."""
        return BadWords.build(words, lambda texts: self.tokenizer.encode_batch(texts, False))

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def enqueue(self, req: Request) -> str:
        """Queue a request made by ``make_request``. Raises (nothing queued, nothing kept) for a
        request id in use, or ``DrafterError`` when the drafter cannot take it."""
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        if self.speculator is not None:
            # NOTE: first, so that a drafter fault leaves the request nowhere
            self.speculator.add_request(req)
        self.requests[req.req_id] = req
        self.scheduler.add(req)
        self.num_prompt_tokens += len(req.prompt_token_ids)
        return req.req_id

    def _prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            for i, t in enumerate(prompt):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise ValueError(
                        f"prompt token ids must be integers; item {i} is {type(t).__name__}"
                    )
            return list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, not {type(prompt).__name__}"
        )

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, at or beyond max_model_len {self.max_model_len}"
            )
        vocab = self.model.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def abort_request(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return
        req.finish_reason = "abort"
        self._logprob_dicts.pop(req_id, None)
        try:
            self.scheduler.finish(req)
            if self.speculator is not None:
                self.speculator.remove_request(req, keep=True)
        finally:
            self.requests.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the running sequences' KV slots in use (cached prefixes are free)."""
        return self.kv.num_used_slots / max(1, self.scheduler.max_num_seqs)

    @property
    def num_prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)."""
        return self.kv.num_prefix_cache_queries

    @property
    def num_prefix_cache_hits(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (vLLM's prefix_cache_hits)."""
        return self.kv.num_prefix_cache_hits

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks: make a warm-up request leave no trace)."""
        self.kv.reset_prefix_cache()

    def reset_drafter_cache(self) -> None:
        """Forget what finished requests taught speculation (suffix decoding's global tree, the
        adaptive controller's learnt costs and rates), so a benchmark's warm-up or a repeated
        prompt is not measured as a repeated task. Running requests keep their drafter state."""
        if self.speculator is not None:
            self.speculator.reset_cache()

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Acceptance statistics of every request so far (empty without speculation)."""
        return self.speculator.stats if self.speculator is not None else SpecDecodeStats()

    @property
    def num_generation_tokens(self) -> int:
        return self.scheduler.num_generation_tokens

    @property
    def num_drafter_failures(self) -> int:
        """Drafter faults: requests whose drafting was switched off, hooks that raised."""
        return self.speculator.num_drafter_failures if self.speculator is not None else 0

    @property
    def num_failed_requests(self) -> int:
        """Requests that finished with finish_reason "error"."""
        return self.scheduler.num_failed_requests

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute (target forward + verification), update, propose; the outputs."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        out = self.runner.execute_model(sched)
        update = self.scheduler.update_from_output(
            sched, out.results, self.requests, out.prompt_logprobs
        )
        self._add_prompt_logprob_dicts(sched, out.prompt_logprobs)
        if self.speculator is not None:
            self.speculator.step(sched, out.results, out.hidden_states, update, self.requests)
            if self.runner.hidden_layers and not self.speculator.hidden_layers:
                self.runner.hidden_layers = ()  # the drafter stopped reading the target's states
        return [self._make_output(r) for r in update.changed]

    # ---- outputs -----------------------------------------------------------------------------
    def _make_output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        text = req.output_text
        if not finished and req.sampling.stop:
            # NOTE: hold back what could be the start of a stop string.
            hold = max(len(s) for s in req.sampling.stop) - 1
            text = text[: max(req.num_streamed_chars, len(text) - hold)]
        delta_text = text[req.num_streamed_chars :]
        req.num_streamed_chars = len(text)
        delta_ids = req.output_token_ids[req.num_streamed_tokens :]
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
            prompt_logprobs = self._prompt_logprobs(req)
        if finished:
            self.requests.pop(req.req_id, None)
            self._logprob_dicts.pop(req.req_id, None)
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
        )

    def _output_logprobs(self, req: Request) -> tuple[list[PositionLogprobs], float]:
        """vLLM's per-position dicts for the request's output so far (built once per position)
        and the cumulative log-probability of its tokens."""
        cache = self._logprob_dicts.setdefault(req.req_id, _LogprobCache())
        for t in req.output_logprobs[len(cache.output) :]:
            cache.output.append(self._logprob_dict(t))
            cache.cumulative += t.logprob
        return list(cache.output), cache.cumulative

    def _prompt_logprobs(self, req: Request) -> list[PositionLogprobs | None]:
        """None for the first prompt token, then each one's dict (built once)."""
        return list(self._prompt_logprob_cache(req).prompt)

    def _prompt_logprob_cache(self, req: Request) -> _LogprobCache:
        cache = self._logprob_dicts.setdefault(req.req_id, _LogprobCache())
        for t in req.prompt_logprobs[len(cache.prompt) - 1 :]:
            cache.prompt.append(self._logprob_dict(t))
        return cache

    def _add_prompt_logprob_dicts(
        self, sched: SchedulerOutput, rows: list[list[TokenLogprobs] | None]
    ) -> None:
        """This step's prompt rows as dicts now. NOTE: built at the first output instead, 2,700
        positions of top-20 took one step 0.2 s; per prefill chunk they cost that chunk's share."""
        for s, new in zip(sched.scheduled, rows):
            req = self.requests.get(s.req_id)
            if new and req is not None:
                self._prompt_logprob_cache(req)

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

    def abort_output(self, req_id: str) -> RequestOutput | None:
        req = self.requests.get(req_id)
        if req is None:
            return None
        self.abort_request(req_id)
        return self._make_output(req)
