"""Loading for the engine: the compute dtype and kernels a config asks for, the draft model,
and the one-line description the engine logs at start-up. The target is loaded by the executor
(engine/executor.py, engine/mp_executor.py: its workers load their shards), through
``specdec.model.model_loader.load_model``, re-exported here."""

from __future__ import annotations

import logging

import torch

from specdec.config import ConfigError, EngineConfig, SpeculativeConfig
from specdec.kernels import get_ops
from specdec.model.llama import LlamaModel
from specdec.model.model_loader import DEFAULT_MAX_MODEL_LEN, load_model
from specdec.model.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MAX_MODEL_LEN", "describe_model", "load_draft", "load_model", "resolve_dtype",
]  # fmt: skip

logger = logging.getLogger("specdec.engine")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": torch.float32,
}
# NOTE: decoding SmolLM2-135M on the torch kernels in bfloat16 against the native kernels'
# default (float32 activations, int8 for the GGUF's Q4_1 weights): 33 vs 334 tokens/s on the
# development machine (issue 20); 9 vs 61 on a loaded 2-core VM. Quoted when the slower one runs.
TORCH_HALF_SLOWDOWN = "33 vs 334 tokens/s decoding SmolLM2-135M, measured"


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
