"""``EngineArgs``: every engine option, the concerns' arguments in one dataclass, resolved into an
``EngineConfig``, and the flags derived from them."""

from __future__ import annotations

import argparse
import difflib
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from specdec.config.arg_spec import (
    _SINGLE_WHY,
    COMMON_ARGS,
    ENGINE,
    IGNORED,
    SINGLE,
    _cli_choice,
    _flag,
    _given,
    common,
    field_section,
    log_ignored,
    log_note,
    section_group,
)
from specdec.config.cache_args import CacheArgs
from specdec.config.checks import short
from specdec.config.compat_args import IgnoredArgs, RefusedArgs
from specdec.config.engine_config import EngineConfig
from specdec.config.model_args import ModelArgs
from specdec.config.parallel_args import ParallelArgs
from specdec.config.scheduler_args import SchedulerArgs
from specdec.config.server_args import ServerArgs
from specdec.config.speculative import SpeculativeConfig
from specdec.config.speculative_args import SpeculativeArgs
from specdec.errors import ConfigError
from specdec.model.registry import ALIASES


# NOTE: dataclasses order fields from the last base to the first: model and speculative_config
# (PositionalArgs), then model, cache, scheduler, speculative, parallel, server, refused and
# ignored arguments, each concern in its --help order
@dataclass
class EngineArgs(
    IgnoredArgs,
    RefusedArgs,
    ServerArgs,
    ParallelArgs,
    SpeculativeArgs,
    SchedulerArgs,
    CacheArgs,
    ModelArgs,
):
    """Every engine option, declared once with its type, default, choices and help, in the
    dataclass of its concern (``ModelArgs``, ``CacheArgs``, ``SchedulerArgs``,
    ``SpeculativeArgs``, ``ParallelArgs``, ``ServerArgs``; vLLM's and llama.cpp's options
    without effect in ``RefusedArgs`` / ``IgnoredArgs``).

    ``LLM(**kwargs)``, the flags of ``specdec generate`` / ``serve`` / ``bench`` and the
    benchmarks' engine options all derive from it (``from_kwargs``, ``add_cli_args``,
    ``from_cli_args``); ``create_engine_config`` validates and resolves it into EngineConfig.
    vLLM's keyword arguments and server flags that mean nothing on this hardware are accepted
    and logged once ("ignored on CPU: ..."); a parallel size above 1 fails with a clear message.
    """

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, where: str = "LLM()", **kwargs: Any) -> EngineArgs:
        """Keyword arguments as ``LLM()`` takes them; an unknown one is a TypeError that names the
        closest known argument."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{where} got an unexpected keyword argument {key!r}{hint}")
        return cls(**kwargs)

    @classmethod
    def names(cls, *kinds: str) -> list[str]:
        """The arguments of these kinds (all when none is given), in declaration order."""
        return [f.name for f in fields(cls) if not kinds or f.metadata["kind"] in kinds]

    def replace(self, **changes: Any) -> EngineArgs:
        return EngineArgs.from_kwargs("EngineArgs.replace()", **{**self.__dict__, **changes})

    def create_engine_config(self) -> EngineConfig:
        """Check, resolve the speculative config and the aliases, log ignored options once."""
        given = [f for f in fields(self) if _given(getattr(self, f.name), f.default)]
        for f in given:
            value, meta = getattr(self, f.name), f.metadata
            if meta["kind"] == SINGLE and value != 1:
                raise ConfigError(
                    f"{f.name} ({_flag(f.name)}) must be 1 here, got {value!r}: {_SINGLE_WHY.get(f.name, 'not supported')}"
                )
            reason = meta["check"](value) if meta["check"] else None
            if reason:
                raise ConfigError(f"{f.name} ({_flag(f.name)}) {short(value)}: {reason}")
        log_ignored([f.name for f in given if f.metadata["kind"] == IGNORED])
        for f in given:
            if f.metadata["note"]:
                log_note(f.name, f.metadata["note"].format(value=getattr(self, f.name)))
        engine = {n: getattr(self, n) for n in self.names(ENGINE)}
        if engine["kv_cache_memory"] is None:
            engine["kv_cache_memory"] = self.kv_cache_memory_bytes or self.gpu_memory_utilization
        speculative = self.speculative()
        # NOTE: hub ids become local paths here, once: the executor, its workers and the
        # drafters read files only, and --revision / --download-dir / --hf-token apply
        engine["model"] = self._local_model()
        engine["tokenizer"] = self._local_tokenizer()
        if speculative is not None:
            speculative = self._local_drafter(speculative)
        self.generation_defaults()  # a bad generation config fails before the model loads
        return EngineConfig(**engine, speculative=speculative)

    def _local_drafter(self, spec: SpeculativeConfig) -> SpeculativeConfig:
        """``speculative_config.model`` as a local path when it is a hub id: a draft model's
        files (draft_model, mtp) or a head's folder (eagle, eagle3, medusa, hybrid)."""
        from specdec.errors import ModelNotFoundError
        from specdec.model.hub import hub_model_path, is_hub_id

        if not spec.model or spec.model in ALIASES or not is_hub_id(spec.model):
            return spec
        kind = "model" if spec.method in ("draft_model", "mtp") else "head"
        try:
            path = hub_model_path(spec.model, self.hub_options(spec.revision), kind)
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"speculative_config.model: {e}") from None
        return replace(spec, model=str(path))

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        names: list[str] | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        """Add a flag per argument (``names``: only those), grouped by kind; ``defaults``
        overrides some defaults (a benchmark's batch size, say)."""
        defaults = defaults or {}
        for f in fields(cls):
            if names is not None and f.name not in names:
                continue
            meta = f.metadata
            kind = meta["kind"]
            flags = [_flag(f.name), *meta["flags"]]
            default = defaults.get(f.name, f.default if f.default is not MISSING else None)
            text = meta["help"]
            if kind == IGNORED:
                text = f"no effect here: {text}"
            kw: dict[str, Any] = {"dest": f.name, "default": default, "help": text}
            if meta["type"] is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif meta["nargs"] == "?":  # vLLM's --hf-token [TOKEN]
                kw.update(nargs="?", const=True, type=meta["type"])
            elif meta["nargs"]:
                kw.update(nargs=meta["nargs"], type=meta["type"])
            elif meta["choices"]:
                kw["type"] = _cli_choice(f.name, meta["choices"], meta["aliases"])
                kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
            else:
                kw["type"] = meta["type"]
            action = section_group(parser, field_section(f)).add_argument(*flags, **kw)
            if f.name in COMMON_ARGS:
                common(action, COMMON_ARGS[f.name])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments ``add_cli_args`` added (``serve``'s positional model wins over --model)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "model_tag", None):
            values["model"] = args.model_tag
        return cls(**values)


def help_section(name: str) -> str:
    """The --help section of an EngineArgs field."""
    return field_section(EngineArgs.__dataclass_fields__[name])
