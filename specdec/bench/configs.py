"""Benchmark configuration strings: ``plain``, ``ngram:k=5,max=4``, ``hf:prompt_lookup:k=10``.

Grammar: ``[backend:]method[:key=value,key=value...]``.

- backend ``specdec`` (implied): ``plain`` or any speculative method. Short keys ``k`` ->
  num_speculative_tokens, ``min``/``max`` -> prompt_lookup_min/max, ``layers`` ->
  num_draft_layers, ``quant`` -> draft_quantization; every other key passes through unchanged as a
  ``speculative_config`` key (so later methods need no change here).
- ``hf``: transformers ``generate`` on the same weights: ``hf:plain``,
  ``hf:prompt_lookup:k=10[,max=2]`` (prompt_lookup_num_tokens, max_matching_ngram_size),
  ``hf:assistant:model=M[,k=5]`` (assistant_model, num_assistant_tokens). Other keys pass through
  as ``generate`` keyword arguments.
- ``llama_cpp``: llama-cpp-python on the same GGUF: ``llama_cpp:plain``,
  ``llama_cpp:prompt_lookup:k=10[,max=2]`` (LlamaPromptLookupDecoding num_pred_tokens,
  max_ngram_size).

Values are parsed as int, then float, then ``true``/``false``, else kept as strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.config import ConfigError

BACKENDS = ("specdec", "hf", "llama_cpp")
PLAIN = "plain"

_SPECDEC_SHORT_KEYS = {
    "k": "num_speculative_tokens",
    "min": "prompt_lookup_min",
    "max": "prompt_lookup_max",
    "layers": "num_draft_layers",
    "quant": "draft_quantization",
}
_HF_SHORT_KEYS = {
    "prompt_lookup": {"k": "prompt_lookup_num_tokens", "max": "max_matching_ngram_size"},
    "assistant": {"k": "num_assistant_tokens", "model": "assistant_model"},
    "plain": {},
}
_LLAMA_CPP_SHORT_KEYS = {
    "prompt_lookup": {"k": "num_pred_tokens", "max": "max_ngram_size"},
    "plain": {},
}
_INT_KEYS = {
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "num_draft_layers",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "num_assistant_tokens",
    "num_pred_tokens",
    "max_ngram_size",
}


@dataclass
class BenchConfig:
    """One measured configuration; ``label`` is the string the user typed (trimmed)."""

    label: str
    backend: str  # "specdec" | "hf" | "llama_cpp"
    method: str  # "plain" or a method name
    options: dict[str, Any] = field(default_factory=dict)  # long key names

    @property
    def is_plain(self) -> bool:
        return self.method == PLAIN

    @property
    def is_reference(self) -> bool:
        """Our own plain decoding: what every other row is compared against."""
        return self.backend == "specdec" and self.is_plain

    @property
    def is_anchor(self) -> bool:
        return self.backend != "specdec"

    def speculative_config(self) -> dict[str, Any] | None:
        """The ``speculative_config`` dict for ``LLM`` (None for plain)."""
        if self.backend != "specdec":
            raise ValueError(f"{self.label} is not a specdec configuration")
        if self.is_plain:
            return None
        return {"method": self.method, **self.options}


def parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _parse_options(text: str, label: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ConfigError(f"bad config '{label}': expected key=value, got '{part}'")
        if key in options:
            raise ConfigError(f"bad config '{label}': key '{key}' given twice")
        options[key] = parse_value(value)
    return options


def _expand(options: dict[str, Any], short: dict[str, str], label: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options.items():
        long = short.get(key, key)
        if long in out:
            raise ConfigError(f"bad config '{label}': '{key}' and '{long}' name the same key")
        if long in _INT_KEYS and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"bad config '{label}': {key} must be an integer, got {value!r}")
        out[long] = value
    return out


def parse_config(text: str) -> BenchConfig:
    """Parse one configuration string; raises ConfigError with the offending part named."""
    label = text.strip()
    if not label:
        raise ConfigError("bad config '': empty configuration string")
    backend = "specdec"
    rest = label
    head, sep, tail = label.partition(":")
    if sep and head in BACKENDS:
        backend, rest = head, tail
    method, sep, opts = rest.partition(":")
    method = method.strip()
    if not method or "=" in method:
        raise ConfigError(f"bad config '{label}': missing method name (e.g. plain, ngram:k=5)")
    options = _parse_options(opts, label) if sep else {}
    if backend == "specdec":
        if method == PLAIN and options:
            raise ConfigError(f"bad config '{label}': plain takes no options")
        if "method" in options:
            raise ConfigError(f"bad config '{label}': give the method before ':', not as a key")
        return BenchConfig(label, backend, method, _expand(options, _SPECDEC_SHORT_KEYS, label))
    table = _HF_SHORT_KEYS if backend == "hf" else _LLAMA_CPP_SHORT_KEYS
    if method not in table:
        raise ConfigError(
            f"bad config '{label}': {backend} supports {', '.join(sorted(table))}, not '{method}'"
        )
    if method == PLAIN and options and backend == "llama_cpp":
        raise ConfigError(f"bad config '{label}': plain takes no options")
    if method == "assistant" and "model" not in options and "assistant_model" not in options:
        raise ConfigError(f"bad config '{label}': hf:assistant needs model=...")
    return BenchConfig(label, backend, method, _expand(options, table[method], label))


def parse_configs(texts: list[str]) -> list[BenchConfig]:
    """Parse and validate all strings; our ``plain`` first (added if missing), anchors last."""
    configs = [parse_config(t) for t in texts]
    labels = [c.label for c in configs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ConfigError(f"configuration(s) given twice: {', '.join(dupes)}")
    for c in configs:
        if c.backend == "specdec" and not c.is_plain:
            from specdec.config import SpeculativeConfig

            try:
                SpeculativeConfig.from_dict(c.speculative_config() or {})
            except TypeError as e:
                raise ConfigError(f"bad config '{c.label}': {e}") from e
            except ConfigError as e:
                raise ConfigError(f"bad config '{c.label}': {e}") from e
    plain = [c for c in configs if c.is_reference]
    if not plain:
        plain = [parse_config(PLAIN)]
    # NOTE: anchors last, grouped by backend, so each backend's models are loaded once and freed.
    rest = sorted(
        (c for c in configs if not c.is_reference), key=lambda c: BACKENDS.index(c.backend)
    )
    return plain + rest
