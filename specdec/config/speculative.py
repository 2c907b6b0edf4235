"""``SpeculativeConfig``: vLLM's ``speculative_config`` keys, validated on creation."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from typing import Any

from specdec.config.checks import check_int
from specdec.errors import ConfigError
from specdec.methods import METHODS, canonical_method

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# vLLM speculative_config keys about GPU execution (batch padding, kernels, block hashing,
# distributed drafting): accepted and logged once, they change nothing here.
VLLM_IGNORED_KEYS = (
    "disable_padded_drafter_batch", "disable_eagle_block_drop", "disable_lookahead_block_hashes",
    "enforce_eager", "attention_backend", "moe_backend", "index_share_for_mtp_iteration",
    "use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting",
    "draft_load_config", "code_revision", "max_model_len", "kv_cache_dtype",
    "draft_lm_head_quantization", "num_speculative_tokens_per_batch_size", "disable_log_stats",
    "disable_logprobs", "acceptance_method", "rejection_sample_method",
    "enable_adaptive_verification",
)  # fmt: skip
# vLLM's suffix decoding defaults: SpeculativeConfig's suffix_decoding_* keys and SuffixProposer's
# parameters of the same names
SUFFIX_MAX_TREE_DEPTH = 24
SUFFIX_MAX_CACHED_REQUESTS = 10000
SUFFIX_MAX_SPEC_FACTOR = 1.0
SUFFIX_MIN_TOKEN_PROB = 0.1
logger = logging.getLogger("specdec.config")


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys."""

    method: str = "ngram"
    # None: 32 for suffix (vLLM's default: it sizes its own drafts, this is only the cap), else 5
    num_speculative_tokens: int | None = None
    model: str | None = None
    # the revision (branch, tag, commit) of a hub id in `model` (vLLM's key); None: main
    revision: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_tensor_parallel_size: int = 1
    disable_by_batch_size: int | None = None
    adaptive: bool = True  # choose k per request and step (num_speculative_tokens is the cap)
    num_draft_layers: int | None = None  # layer_skip; None = all but the last 2 (measured best)
    draft_quantization: str | None = None
    # how model drafters draft for a sampled request (vLLM's key): "greedy" (the argmax, a point
    # mass: output identical to plain sampling) or "probabilistic" (sampled from q, Leviathan/Chen
    # acceptance: same distribution, not the same text). ngram and suffix drafts are point masses.
    draft_sample_method: str = "greedy"
    # suffix decoding (vLLM's names and defaults): tree depth caps match + draft length; the global
    # tree caches this many finished responses (FIFO, 0 = off); draft length <= factor * match
    # length; tokens are drafted while their estimated probability stays >= min_token_prob.
    suffix_decoding_max_tree_depth: int = SUFFIX_MAX_TREE_DEPTH
    suffix_decoding_max_cached_requests: int = SUFFIX_MAX_CACHED_REQUESTS
    suffix_decoding_max_spec_factor: float = SUFFIX_MAX_SPEC_FACTOR
    suffix_decoding_min_token_prob: float = SUFFIX_MIN_TOKEN_PROB
    # ours: suffix drafts repeat the replacements a response makes to the prompt it copies
    # (spec_decode/edits.py); False: vLLM's drafts
    suffix_decoding_edit_rules: bool = True
    # llama.cpp's --draft-min / --draft-p-min, the defaults of every request's
    # speculative_n_min / speculative_p_min (SamplingParams): fewer drafts than draft_min are not
    # verified; drafts whose draft probability q(x) is below draft_p_min are cut (drafters with q)
    draft_min: int = 0
    draft_p_min: float = 0.0

    def __post_init__(self) -> None:
        method = canonical_method(self.method) if isinstance(self.method, str) else None
        if method is None:
            raise ConfigError(
                f"unknown speculative_config.method {self.method!r}; allowed: "
                f"{', '.join(METHODS)} (and the aliases "
                f"{', '.join(a for m in METHODS.values() for a in m.aliases)})"
            )
        self.method = method
        info = METHODS[method]
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 32 if self.method == "suffix" else 5
        _check_int(self.num_speculative_tokens, "num_speculative_tokens", 1)
        _check_int(self.prompt_lookup_min, "prompt_lookup_min", 1)
        _check_int(self.prompt_lookup_max, "prompt_lookup_max", 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not isinstance(self.adaptive, bool):
            raise ConfigError(
                f"speculative_config.adaptive must be true or false, got {self.adaptive!r}"
            )
        if self.draft_tensor_parallel_size != 1:
            raise ConfigError("speculative_config.draft_tensor_parallel_size must be 1")
        if self.disable_by_batch_size is not None:
            _check_int(self.disable_by_batch_size, "disable_by_batch_size", 1)
        if self.num_draft_layers is not None:
            _check_int(self.num_draft_layers, "num_draft_layers", 1)
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ConfigError(
                f"speculative_config.draft_sample_method must be one of "
                f"{', '.join(DRAFT_SAMPLE_METHODS)}, got {self.draft_sample_method!r}"
            )
        if self.draft_sample_method != "greedy" and not info.samples_q:
            q_methods = ", ".join(m for m, i in METHODS.items() if i.samples_q)
            raise ConfigError(
                f"speculative_config.draft_sample_method '{self.draft_sample_method}' applies to "
                f"drafters with a distribution ({q_methods}); '{self.method}' drafts are "
                "point masses"
            )
        if info.needs_model and not self.model:
            raise ConfigError(f"speculative_config.model is required for method '{self.method}'")
        _check_int(self.suffix_decoding_max_tree_depth, "suffix_decoding_max_tree_depth", 1)
        _check_int(
            self.suffix_decoding_max_cached_requests, "suffix_decoding_max_cached_requests", 0
        )
        _check_number(
            self.suffix_decoding_max_spec_factor, "suffix_decoding_max_spec_factor", 0.0, None
        )
        _check_number(
            self.suffix_decoding_min_token_prob, "suffix_decoding_min_token_prob", 0.0, 1.0
        )
        if not isinstance(self.suffix_decoding_edit_rules, bool):
            raise ConfigError(
                "speculative_config.suffix_decoding_edit_rules must be true or false, got "
                f"{self.suffix_decoding_edit_rules!r}"
            )
        _check_int(self.draft_min, "draft_min", 0)
        _check_number(self.draft_p_min, "draft_p_min", 0.0, 1.0)

    @classmethod
    def from_any(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """Accept a config, a dict of vLLM keys, or a JSON string."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object")
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        d = {k.replace("-", "_") if isinstance(k, str) else k: v for k, v in d.items()}
        ignored = sorted(k for k in d if k in VLLM_IGNORED_KEYS)
        if ignored:
            logger.info("speculative_config: ignored on CPU: %s", ", ".join(ignored))
        for k in ignored:
            del d[k]
        tp = d.pop("tensor_parallel_size", 1)
        if tp != 1:
            raise ConfigError("speculative_config.tensor_parallel_size must be 1 (one device)")
        if "quantization" in d:
            d.setdefault("draft_quantization", d.pop("quantization"))
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ConfigError(
                f"unknown speculative_config key(s) {', '.join(unknown)}; allowed: "
                + ", ".join(sorted(allowed))
            )
        if "method" not in d:
            d["method"] = _infer_method(d.get("model"))
        if d.get("model") == "[ngram]":
            d["model"] = None
        return cls(**d)

    @classmethod
    def from_legacy(
        cls,
        speculative_model: str | None,
        num_speculative_tokens: int | None,
        ngram_prompt_lookup_max: int | None = None,
        ngram_prompt_lookup_min: int | None = None,
    ) -> SpeculativeConfig | None:
        """The older spellings: ``speculative_model="[ngram]"`` or a draft model path."""
        if speculative_model is None:
            return None
        d: dict[str, Any] = {"model": speculative_model}
        if num_speculative_tokens is not None:
            d["num_speculative_tokens"] = num_speculative_tokens
        if ngram_prompt_lookup_max is not None:
            d["prompt_lookup_max"] = ngram_prompt_lookup_max
        if ngram_prompt_lookup_min is not None:
            d["prompt_lookup_min"] = ngram_prompt_lookup_min
        return cls.from_dict(d)


def _infer_method(model: str | None) -> str:
    if model is None or model in ("[ngram]", "ngram"):
        return "ngram"
    if model in ("[layer_skip]", "layer_skip"):
        return "layer_skip"
    return "draft_model"


def _check_int(value: Any, key: str, minimum: int) -> None:
    check_int(f"speculative_config.{key}", value, minimum)


def _check_number(value: Any, key: str, minimum: float, maximum: float | None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"speculative_config.{key} must be a number {allowed}, got {value!r}")
