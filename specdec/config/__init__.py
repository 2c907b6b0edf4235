"""Engine configuration, validated on creation.

``speculative`` (SpeculativeConfig), ``kv_events`` (KVEventsConfig), ``engine_config``
(EngineConfig, its choice tables, executor_backend); ``arg_spec`` (how an engine argument is
declared: ``_arg``, its kinds, the --help sections); the arguments by concern (``model_args``,
``cache_args``, ``scheduler_args``, ``speculative_args``, ``parallel_args``, ``server_args``,
``compat_args``: vLLM's and llama.cpp's options without effect) and ``engine_args``
(EngineArgs, all of them). Everything is re-exported here: import from ``specdec.config``.
"""

from specdec.config.arg_spec import (
    _LOGGED_IGNORED,
    ALIAS,
    COMMON_ARGS,
    ENGINE,
    HELP_SECTIONS,
    HUB,
    IGNORED,
    REFUSED,
    SERVER,
    SINGLE,
    SPECULATIVE,
    common,
    human_int,
    json_value,
    log_ignored,
    log_note,
    section_group,
)
from specdec.config.cache_args import CacheArgs
from specdec.config.compat_args import IgnoredArgs, RefusedArgs
from specdec.config.engine_args import EngineArgs, help_section
from specdec.config.engine_config import (
    ACTIVATION_DTYPES,
    DEVICE_ALIASES,
    DEVICES,
    DTYPE_ALIASES,
    DTYPES,
    EXECUTOR_BACKENDS,
    KERNELS,
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    QUANTIZATION_ALIASES,
    QUANTIZATIONS,
    EngineConfig,
    executor_backend,
)
from specdec.config.kv_events import KV_EVENTS_PUBLISHERS, KV_EVENTS_SCHEMES, KVEventsConfig
from specdec.config.model_args import (
    GENERATION_CONFIG_KEYS,
    OVERRIDE_GENERATION_KEYS,
    ModelArgs,
    PositionalArgs,
)
from specdec.config.parallel_args import ParallelArgs
from specdec.config.scheduler_args import SchedulerArgs
from specdec.config.server_args import ServerArgs
from specdec.config.speculative import DRAFT_SAMPLE_METHODS, VLLM_IGNORED_KEYS, SpeculativeConfig
from specdec.config.speculative_args import SpeculativeArgs
from specdec.errors import ConfigError

__all__ = [
    "ACTIVATION_DTYPES",
    "ALIAS",
    "COMMON_ARGS",
    "DEVICE_ALIASES",
    "DEVICES",
    "DRAFT_SAMPLE_METHODS",
    "DTYPE_ALIASES",
    "DTYPES",
    "ENGINE",
    "EXECUTOR_BACKENDS",
    "GENERATION_CONFIG_KEYS",
    "HELP_SECTIONS",
    "HUB",
    "IGNORED",
    "KERNELS",
    "KV_CACHE_DTYPES",
    "KV_CACHE_DTYPE_ALIASES",
    "KV_EVENTS_PUBLISHERS",
    "KV_EVENTS_SCHEMES",
    "OVERRIDE_GENERATION_KEYS",
    "QUANTIZATIONS",
    "QUANTIZATION_ALIASES",
    "REFUSED",
    "SERVER",
    "SINGLE",
    "SPECULATIVE",
    "VLLM_IGNORED_KEYS",
    "_LOGGED_IGNORED",
    "CacheArgs",
    "ConfigError",
    "EngineArgs",
    "EngineConfig",
    "IgnoredArgs",
    "KVEventsConfig",
    "ModelArgs",
    "ParallelArgs",
    "PositionalArgs",
    "RefusedArgs",
    "SchedulerArgs",
    "ServerArgs",
    "SpeculativeArgs",
    "SpeculativeConfig",
    "common",
    "executor_backend",
    "help_section",
    "human_int",
    "json_value",
    "log_ignored",
    "log_note",
    "section_group",
]
