"""Model loading for the engine: the target and a draft model from a name, a file or a folder,
their kernels and compute dtype, and the one-line description the engine logs at start-up."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from specdec.config import ConfigError, EngineConfig, SpeculativeConfig
from specdec.kernels import get_ops, int8_activations_fast, kquant_int8_fast, native_isa
from specdec.model.llama import LlamaModel
from specdec.model.loader import load_checkpoint, release_freed_heap
from specdec.model.registry import resolve_model_path
from specdec.model.tokenizer import Tokenizer
from specdec.model.weight_cache import WeightCache
from specdec.worker.binding import bind_rank, parse_cpu_binding
from specdec.worker.shard import plan_shard, shard_checkpoint
from specdec.worker.tp import LoadArgs, TPGroup, start_group

logger = logging.getLogger("specdec.engine")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": torch.float32,
}
DEFAULT_MAX_MODEL_LEN = 4096
TP_START_TIMEOUT_S = 600.0  # workers spawn, import torch and load their shards
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
    tp: TPGroup | None = None,
) -> tuple[LlamaModel, Tokenizer]:
    """``tp``: load only this rank's shard (tensor parallelism; worker/shard.py)."""
    path = resolve_model_path(model)
    ckpt = load_checkpoint(path)
    if tp is not None:
        ckpt = shard_checkpoint(ckpt, tp.rank, tp.size)
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
            # NOTE: whether K-quants stay native (AVX2 kernels too, now): older
            # files of K-quants converted to Q8_0 are not reused
            "kquant_int8": kquant_int8_fast(),
        }  # fmt: skip
        if tp is not None:  # NOTE: one cache file per rank's shard
            settings["tensor_parallel"] = f"{tp.rank}/{tp.size}"
        cache = WeightCache.for_model(path, settings)
    model = LlamaModel(ckpt, ops, device, dtype, quantization, max_len, activation_dtype, cache, tp)
    if cache is not None and cache.hits:
        logger.info("weights mapped from the weight cache %s", cache.path)
    model.set_kv_dtype(kv_cache_dtype)
    del ckpt  # NOTE: its metadata (a vocabulary's strings) before the heap is trimmed
    release_freed_heap()
    return model, tokenizer


def resolve_dtype(config: EngineConfig) -> tuple[torch.dtype, str]:
    """(compute dtype, kernels) for the requested ``dtype`` and ``kernels``.

    bfloat16 / float16 need the torch kernels. Under ``kernels="auto"`` on a CPU with the native
    kernels built, they keep the native kernels instead (float32 activations, int8 for quantized
    weights; ~10x faster decoding), and say so: a pasted ``--dtype bfloat16`` never makes
    decoding silently slower. With ``kernels="torch"`` they run as asked, with a warning."""
    dtype = _DTYPES[config.dtype]
    if config.device != "cpu":  # NOTE: GPUs compute in bfloat16 unless told otherwise
        return (torch.bfloat16 if config.dtype == "auto" else dtype), config.kernels
    if dtype == torch.float32:
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
            if lin is None:  # a mixture-of-experts layer: its experts are in model.linears()
                continue
            formats[lin.weight.qtype] = formats.get(lin.weight.qtype, 0) + 1
    layers = "/".join(sorted(formats, key=lambda q: -formats[q]))
    isa = getattr(model.ops, "isa", None) if model.ops.name == "native" else None
    return (
        f"dtype {str(model.dtype).removeprefix('torch.')}, kernels {model.ops.name}"
        f"{f' ({isa})' if isa else ''}, activations {model.activation_dtype}, weights {layers} "
        f"(lm_head {model.lm_head.weight.qtype}), KV cache "
        f"{str(model.kv_dtype).removeprefix('torch.')}"
    )


def load_draft(
    spec: SpeculativeConfig,
    config: EngineConfig,
    target: LlamaModel,
    tokenizer: Tokenizer,
    kernels: str,
) -> LlamaModel:
    """``speculative_config.model`` for ``target``: same vocabulary, same context length.

    NOTE: the draft takes the target's activation format where its weights allow, else its own
    auto choice: a draft only proposes, so its arithmetic never changes the output, and e.g. a
    BF16 target's bf16x2 must not fail on a quantized draft."""
    try:
        draft, draft_tok = load_model(
            spec.model, target.device, target.dtype, kernels,
            spec.draft_quantization or config.quantization, target.max_len, "auto",
            config.kv_cache_dtype,
        )  # fmt: skip
    except ConfigError as e:
        # NOTE: the message must say it is the draft (a shorter context, above all)
        raise ConfigError(f"speculative_config.model (the draft model): {e}") from None
    if config.activation_dtype == "float32" and draft.slow_float_kquants():
        # NOTE: its K-quant weights would run on the scalar twins (~50x slower here), and a
        # drafter that slow never pays: the controller would keep the engine plain
        logger.info(
            "draft model keeps activations %s (float ones run its K-quant weights slowly here)",
            draft.activation_dtype,
        )
    elif config.activation_dtype not in ("auto", draft.activation_dtype):
        try:
            draft.set_activation_dtype(config.activation_dtype)
        except ConfigError as e:
            logger.info("draft model keeps activations %s (%s)", draft.activation_dtype, e)
    if (
        draft.cfg.vocab_size != target.cfg.vocab_size
        or draft_tok.vocab_size != tokenizer.vocab_size
    ):
        raise ConfigError(
            f"speculative_config.model: the draft's vocabulary ({draft.cfg.vocab_size}) differs "
            f"from the target's ({target.cfg.vocab_size}); draft and target must share a tokenizer"
        )
    return draft


def load_target(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, kernels: str
) -> tuple[LlamaModel, Tokenizer]:
    """The target model, as rank 0 of ``tensor_parallel_size`` ranks when that is above 1
    (the workers start first and load their shards while rank 0 loads its own)."""
    size = config.tensor_parallel_size
    if size == 1:
        return load_model(
            config.model, device, dtype, kernels, config.quantization, config.max_model_len,
            config.activation_dtype, config.kv_cache_dtype, config.tokenizer,
        )  # fmt: skip
    cores = parse_cpu_binding(config.cpu_binding, size)
    load = LoadArgs(
        config.model, str(dtype).removeprefix("torch."), kernels, config.quantization,
        config.max_model_len, config.activation_dtype, config.kv_cache_dtype, config.tokenizer,
    )  # fmt: skip
    plan_shard(load_checkpoint(resolve_model_path(config.model)).arch, 0, size)  # before spawning
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    if config.distributed_executor_backend == "ray":
        from specdec.worker.tp_ray import start_group_ray

        group = start_group_ray(load, size, cores, config.threads or len(cores[-1]))
    else:
        group = start_group(load, size, cores)
    group.workers.restore = before
    bind_rank(cores[0], config.threads)
    try:
        out = load_model(
            config.model, device, dtype, kernels, config.quantization, config.max_model_len,
            config.activation_dtype, config.kv_cache_dtype, config.tokenizer, tp=group,
        )  # fmt: skip
        group.workers.wait_for("ready", time.monotonic() + TP_START_TIMEOUT_S)
    except BaseException:
        group.workers.stop()
        raise
    logger.info("tensor parallel: %d ranks (workers %s), cores %s", size, group.workers.pids, cores)
    return out
