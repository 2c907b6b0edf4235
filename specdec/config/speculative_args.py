"""The speculative engine arguments: vLLM's older keyword arguments and ``--spec-*`` flags and
llama.cpp's draft flags, and how they fold with ``speculative_config`` into one
``SpeculativeConfig``."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from specdec.config.arg_spec import SPECULATIVE, _arg, _cli_names
from specdec.config.model_args import PositionalArgs
from specdec.config.speculative import SpeculativeConfig
from specdec.errors import ConfigError


@dataclass
class SpeculativeArgs(PositionalArgs):
    """``speculative_config`` (vLLM's keys) and the other spellings that refine or replace it."""

    # -- vLLM's older speculative keyword arguments / flags, and llama.cpp's
    speculative_model: str | None = _arg(
        None, "vLLM < 0.7: draft model, or [ngram]", kind=SPECULATIVE
    )
    num_speculative_tokens: int | None = _arg(
        None, "vLLM < 0.7: drafts per step", type=int, kind=SPECULATIVE
    )
    speculative_draft_tensor_parallel_size: int | None = _arg(
        None, "vLLM < 0.7: 1 only", type=int, kind=SPECULATIVE
    )
    ngram_prompt_lookup_max: int | None = _arg(
        None, "vLLM < 0.7: prompt_lookup_max", type=int, kind=SPECULATIVE
    )
    ngram_prompt_lookup_min: int | None = _arg(
        None, "vLLM < 0.7: prompt_lookup_min", type=int, kind=SPECULATIVE
    )
    speculative_disable_by_batch_size: int | None = _arg(
        None, "vLLM < 0.7: disable_by_batch_size", type=int, kind=SPECULATIVE
    )
    spec_method: str | None = _arg(None, "vLLM: speculative_config.method", kind=SPECULATIVE)
    spec_model: str | None = _arg(None, "vLLM: speculative_config.model", kind=SPECULATIVE)
    spec_tokens: int | None = _arg(
        None, "vLLM: speculative_config.num_speculative_tokens", type=int, kind=SPECULATIVE
    )
    model_draft: str | None = _arg(
        None,
        "llama.cpp: draft model (method draft_model): a file, folder or hub id (-hfd org/name)",
        flags=("-md", "-hfd", "-hfrd", "--hf-repo-draft"),
        kind=SPECULATIVE,
    )
    draft_max: int | None = _arg(
        None,
        "llama.cpp: drafts per step (num_speculative_tokens)",
        type=int,
        flags=("--draft", "--draft-n"),
        kind=SPECULATIVE,
    )
    draft_min: int | None = _arg(
        None,
        "llama.cpp: fewer drafts than this are not verified (each request's default "
        "speculative_n_min)",
        type=int,
        flags=("--draft-n-min",),
        kind=SPECULATIVE,
    )
    draft_p_min: float | None = _arg(
        None,
        "llama.cpp: drafts whose draft probability is below this are cut (drafters that report "
        "one; each request's default speculative_p_min)",
        type=float,
        kind=SPECULATIVE,
    )

    def speculative(self) -> SpeculativeConfig | None:
        """The SpeculativeConfig from ``speculative_config``, or from vLLM's older keys
        (``speculative_model`` ...) or llama.cpp's (``-md``, ``--draft-max`` ...): one source
        names the method, the other keys refine it (a key given twice must agree)."""
        value = self._speculative_config_value()
        # NOTE: a speculative_config that names no method and no model only refines the method
        # another option names (`-md M --draft 5 --speculative-config '{"adaptive": false}'`)
        refines = isinstance(value, dict) and not {"method", "model"} & set(value)
        sources = [
            name
            for name in ("speculative_config", "speculative_model", "model_draft")
            if getattr(self, name) is not None and not (refines and name == "speculative_config")
        ]
        if len(sources) > 1:
            raise ConfigError(f"give one of {', '.join(sources)}, not several")
        overrides = {
            "num_speculative_tokens": self._agreeing("num_speculative_tokens", "draft_max"),
            "draft_tensor_parallel_size": self.speculative_draft_tensor_parallel_size,
            "prompt_lookup_max": self.ngram_prompt_lookup_max,
            "prompt_lookup_min": self.ngram_prompt_lookup_min,
            "disable_by_batch_size": self.speculative_disable_by_batch_size,
            "draft_min": self.draft_min,
            "draft_p_min": self.draft_p_min,
        }
        given = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(value, SpeculativeConfig):
            return replace(value, **given) if given else value
        if refines and sources:
            for key, v in value.items():
                if key in given and given[key] != v:
                    raise ConfigError(
                        f"speculative_config.{key} is {v!r} but another option sets {given[key]!r}"
                    )
            given, value = {**value, **given}, None
        if value is None and self.speculative_model is not None:
            value = {"model": self.speculative_model}
        if value is None and self.model_draft is not None:
            value = {"method": "draft_model", "model": self.model_draft}
        if value is None:
            if given:
                raise ConfigError(
                    f"{', '.join(_cli_names(given))} need a speculative method: "
                    "speculative_config, speculative_model or -md/--model-draft"
                )
            return None
        d = dict(value)
        for key, v in given.items():
            if key in d and d[key] != v:
                raise ConfigError(
                    f"speculative_config.{key} is {d[key]!r} but another option sets {v!r}"
                )
            d[key] = v
        return SpeculativeConfig.from_dict(d)

    def _speculative_config_value(self) -> SpeculativeConfig | dict | None:
        value = self.speculative_config
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from e
        if value is not None and not isinstance(value, (dict, SpeculativeConfig)):
            raise ConfigError("speculative_config must be a JSON object")
        flat = {"method": self.spec_method, "model": self.spec_model,
                "num_speculative_tokens": self.spec_tokens}  # fmt: skip
        flat = {k: v for k, v in flat.items() if v is not None}
        if not flat:
            return value
        # NOTE: vLLM's --spec-method / --spec-model / --spec-tokens are keys of
        # speculative_config; one key given both ways is an error, as in vLLM
        if isinstance(value, SpeculativeConfig):
            raise ConfigError("give --spec-* flags or a SpeculativeConfig, not both")
        d = dict(value or {})
        for key, v in flat.items():
            if key in d:
                raise ConfigError(
                    f"--spec-{key.split('_')[-1]} and speculative_config.{key} are both given; "
                    "give one"
                )
            d[key] = v
        return d

    def _agreeing(self, a: str, b: str) -> Any:
        va, vb = getattr(self, a), getattr(self, b)
        if va is not None and vb is not None and va != vb:
            raise ConfigError(f"{a} ({va}) and {b} ({vb}) disagree; give one")
        return va if va is not None else vb

    # ---- command line ------------------------------------------------------------------------
