"""The model's engine arguments: what to load and how to compute (``ModelArgs``, with hub ids'
downloads and default sampling), and ``PositionalArgs``, the two arguments ``LLM()`` takes by
position."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.config.arg_spec import (
    HUB,
    SERVER,
    SPECULATIVE,
    _arg,
    human_int,
    json_value,
    log_note,
)
from specdec.config.checks import json_option
from specdec.config.engine_config import (
    ACTIVATION_DTYPES,
    DEVICE_ALIASES,
    DEVICES,
    DTYPE_ALIASES,
    DTYPES,
    KERNELS,
    QUANTIZATION_ALIASES,
    QUANTIZATIONS,
)
from specdec.errors import ConfigError
from specdec.model.registry import ALIASES, DEFAULT_MODEL

if TYPE_CHECKING:
    from pathlib import Path

    from specdec.model.hub import HubOptions

# the generation_config.json keys vLLM reads for default sampling, as SamplingParams names
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "min_p": "min_p", "repetition_penalty": "repetition_penalty"}  # fmt: skip
# override_generation_config keys specdec applies (vLLM's names); max_tokens defaults are not
OVERRIDE_GENERATION_KEYS = (*GENERATION_CONFIG_KEYS, "presence_penalty", "frequency_penalty")


@dataclass
class PositionalArgs:
    """``model`` and ``speculative_config``: ``LLM(model, speculative_config)`` takes them by
    position (vLLM's order), so they lead ``EngineArgs``' fields."""

    model: str = _arg(
        DEFAULT_MODEL,
        "model: an alias, a .gguf file, a Hugging Face folder or hub id (org/name; a GGUF "
        "repository's file by quantization: org/name-GGUF:Q4_K_M, llama.cpp's -hf)",
        flags=("-m", "-hf", "-hfr", "--hf-repo"),
    )
    speculative_config: Any = _arg(
        None,
        "speculative decoding, vLLM's keys as JSON, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 5}\'',
        flags=("-sc",),
        kind=SPECULATIVE,
    )


@dataclass
class ModelArgs(PositionalArgs):
    """The model: its files (a hub id's revision, download folder, token), tokenizer, weight
    format, compute dtype, kernels, context length, seed and default sampling."""

    tokenizer: str | None = _arg(
        None,
        "a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json), its "
        "tokenizer.json, or a hub id (org/name: its tokenizer files), instead of the model's "
        "own; its vocabulary must fit the model's",
    )
    dtype: str = _arg(
        "auto",
        "compute dtype. auto: float32 activations on the native kernels (int8 for quantized "
        "weights where fast). bfloat16/float16 keep the native kernels under --kernels auto "
        "(the torch kernels they need decode ~10x slower; logged); --kernels torch honours them",
        choices=DTYPES,
        aliases=DTYPE_ALIASES,
    )
    device: str = _arg(
        "cpu", "cpu or cuda (auto: cuda where a GPU is, else cpu)", choices=("auto", *DEVICES),
        aliases=DEVICE_ALIASES,
    )  # fmt: skip
    kernels: str = _arg(
        "auto", "native (C++, batch-invariant) or torch; auto: native when built", choices=KERNELS
    )
    quantization: str = _arg(
        "auto",
        "weight format: the file's own (auto, vLLM's gguf), or converted to fp32/q8_0/q4_0/q4_1",
        choices=QUANTIZATIONS,
        aliases=QUANTIZATION_ALIASES,
        flags=("-q",),
    )
    activation_dtype: str = _arg(
        "auto",
        "int8: llama.cpp-style 8-bit activations for quantized weights (fast on AVX-512 VNNI and AVX2); "
        "bf16x2: activations as two bfloat16s on AMX-BF16 tiles for f16/bf16 weights (~2-3x "
        "faster prefill; f16 decode slower); float32: exact float activations (matches "
        "transformers); auto: int8 for quantized weights where fast, bf16x2 for bf16 weights "
        "on AMX-BF16 CPUs, else float32",
        choices=ACTIVATION_DTYPES,
    )
    max_model_len: int | None = _arg(
        None,
        "context length (prompt + output; 4096, 32k or 32K); default min(4096, the model's)",
        type=human_int,
        flags=("-c", "--ctx-size"),
    )
    seed: int = _arg(
        0,
        "engine seed: requests without a seed draw theirs from it (llama.cpp's -s)",
        type=int,
        flags=("-s",),
    )
    # -- hub ids: where their files come from (model/hub.py)
    revision: str | None = _arg(
        None, "vLLM: the branch, tag or commit of a hub id model (default main)", kind=HUB
    )
    download_dir: str | None = _arg(
        None,
        "vLLM: download hub models into this folder (the Hugging Face cache layout) instead "
        "of the Hugging Face cache (HF_HUB_CACHE)",
        kind=HUB,
    )
    hf_token: Any = _arg(
        None,
        "vLLM / llama.cpp: the token for gated and private hub repositories (default: HF_TOKEN, "
        "else the stored login; the flag alone: the stored login)",
        nargs="?",
        flags=("-hft",),
        kind=HUB,
    )
    tokenizer_revision: str | None = _arg(
        None, "vLLM: the branch, tag or commit of a hub id --tokenizer (default main)", kind=HUB
    )
    hf_file: str | None = _arg(
        None,
        "llama.cpp: the file of the -hf repository to load, instead of the one the "
        "quantization picks",
        flags=("-hff",),
        kind=HUB,
    )
    # -- honoured by `specdec serve` (server sampling defaults; explicit --temp etc. win)
    generation_config: str | None = _arg(
        None,
        "vLLM: 'auto' reads the model folder's generation_config.json for default sampling "
        "(temperature, top_p, top_k, min_p, repetition_penalty); a folder reads that one's; "
        "'vllm' or none: neutral defaults",
        kind=SERVER,
    )
    override_generation_config: Any = _arg(
        None,
        "vLLM: JSON default sampling (temperature, top_p, top_k, min_p, repetition_penalty, "
        "presence_penalty, frequency_penalty) over generation_config's",
        type=json_value,
        kind=SERVER,
    )
    enforce_eager: bool = _arg(
        False, "CUDA: run every step eagerly (no CUDA graphs; fixed shapes stay)", type=bool
    )
    static_shapes: bool | None = _arg(
        None,
        "fixed-shape forwards: every step at [slots x 8 rows], prompts in 128-row pieces, so a "
        "row's result never depends on its batch (speculation exact on GPUs) and a step is one "
        "CUDA graph; default: on for device cuda",
        type=bool,
    )

    def hub_options(self, revision: str | None = None, filename: str | None = None) -> HubOptions:
        """The HubOptions (model/hub.py) of these arguments: ``download_dir``, ``hf_token``."""
        from specdec.model.hub import HubOptions

        return HubOptions(revision, self.download_dir, self.hf_token, filename)

    def model_path(self) -> Path:
        """The model's local path: an alias's file, a path, or a hub id's files in
        the cache (downloaded on first use, with ``revision`` and ``hf_file``)."""
        from specdec.model.registry import resolve_model_path

        return resolve_model_path(self.model, self.hub_options(self.revision, self.hf_file))

    def _local_model(self) -> str:
        from specdec.model.hub import is_hub_id

        if not is_hub_id(self.model) or self.model in ALIASES:
            if self.hf_file:
                raise ConfigError(
                    f"hf_file (--hf-file) names a file of a hub repository; the model "
                    f"{self.model!r} is not a hub id (-hf org/name)"
                )
            return self.model
        return str(self.model_path())

    def _local_tokenizer(self) -> str | None:
        """``tokenizer`` as a local folder when it is a hub id (its tokenizer files only)."""
        from specdec.errors import ModelNotFoundError
        from specdec.model.hub import hub_model_path, is_hub_id

        if not self.tokenizer or not is_hub_id(self.tokenizer):
            return self.tokenizer
        options = self.hub_options(self.tokenizer_revision)
        try:
            return str(hub_model_path(self.tokenizer, options, "tokenizer"))
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"tokenizer (--tokenizer): {e}") from None

    def generation_defaults(self) -> dict[str, Any]:
        """Default sampling (SamplingParams names) from ``generation_config`` (vLLM's 'auto':
        the model folder's generation_config.json; a folder: its file) under
        ``override_generation_config``; ``specdec serve`` and ``LLM.generate`` apply them where
        a request does not set its own."""
        defaults = _generation_file_defaults(self.generation_config, self.model_path)
        override = self.override_generation_config
        if isinstance(override, str):
            override = json_option("override_generation_config", override)
        if override in (None, {}):
            return defaults
        if not isinstance(override, dict):
            raise ConfigError("override_generation_config must be a JSON object")
        unknown = sorted(set(override) - set(OVERRIDE_GENERATION_KEYS))
        if unknown:
            raise ConfigError(
                f"override_generation_config: {', '.join(unknown)} cannot be applied; "
                f"allowed: {', '.join(OVERRIDE_GENERATION_KEYS)}"
            )
        return {**defaults, **override}


def _generation_file_defaults(value: str | None, model_path: Callable[[], Path]) -> dict[str, Any]:
    """vLLM's --generation-config: None / 'vllm': no defaults; 'auto': the model folder's
    generation_config.json if it has one (a GGUF file has none: logged); else a folder."""
    if value in (None, "vllm"):
        return {}
    from pathlib import Path

    if value == "auto":
        folder = model_path()
        path = folder / "generation_config.json" if folder.is_dir() else None
        if path is None or not path.is_file():
            log_note("generation_config", "generation_config auto: the model has no "
                     "generation_config.json; neutral sampling defaults")  # fmt: skip
            return {}
    else:
        path = Path(value).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ConfigError(f"generation_config: no generation_config.json in {value}")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"generation_config: cannot read {path}: {e}") from None
    return {ours: data[key] for key, ours in GENERATION_CONFIG_KEYS.items() if key in data}
