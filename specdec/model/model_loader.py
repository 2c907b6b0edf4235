"""Model loading: a checkpoint from a name, a file or a folder, its tokenizer, its kernels and
compute dtype; under tensor parallelism, one rank's shard of it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specdec.distributed.comm import TPGroup
from specdec.errors import ConfigError
from specdec.kernels import get_ops, int8_activations_fast, kquant_int8_fast, native_isa
from specdec.model.llama import LlamaModel
from specdec.model.loader import load_checkpoint, release_freed_heap
from specdec.model.registry import resolve_model_path
from specdec.model.shard import shard_checkpoint
from specdec.model.tokenizer import Tokenizer
from specdec.model.weight_cache import WeightCache

logger = logging.getLogger("specdec.engine")  # NOTE: the engine's start-up lines, as before
DEFAULT_MAX_MODEL_LEN = 4096


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
    """The model at ``model`` (an alias, a file or a folder) and its tokenizer (its own, or
    ``tokenizer_path``), on ``kernels`` in ``dtype``. ``tp``: load only this rank's shard
    (tensor parallelism; distributed/shard.py plans it, model/shard.py cuts it)."""
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
