"""``specdec serve``'s flags: the engine's (``EngineArgs``), the server's, vLLM's server flags by
disposition (honoured, ignored with one log line, refused with one line naming the flag), and the
checks they get before anything loads."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from specdec.config import ConfigError, EngineArgs, common, json_value, section_group
from specdec.entrypoints.openai import error_backoff, response_store
from specdec.entrypoints.openai.connection import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_HEADER_READ_TIMEOUT_S,
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_MAX_PENDING_PER_CLIENT,
)
from specdec.entrypoints.utils import add_sampling_args

API_KEY_ENV = "SPECDEC_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0


# vLLM's server flags beyond those make_arg_parser spells out, by disposition: (name, how the
# value parses: bool is --X/--no-X, "+" a list, "append" repeatable, else the value's type).
# Honoured: read by cmd_serve (uvicorn's socket, TLS and logging; the app's root path,
# middleware and docs). Prompt token details (cached_tokens) are always reported.
HONOURED_SERVER_FLAGS = (
    ("root_path", str), ("uds", str), ("ssl_keyfile", str), ("ssl_certfile", str),
    ("ssl_ca_certs", str), ("ssl_cert_reqs", int), ("ssl_ciphers", str),
    ("disable_uvicorn_access_log", bool), ("h11_max_incomplete_event_size", int),
    ("middleware", "append"), ("disable_fastapi_docs", bool),
    ("enable_prompt_tokens_details", bool),
)  # fmt: skip
# Without effect here: accepted, logged once when given.
IGNORED_SERVER_FLAGS = (
    ("disable_log_requests", bool), ("enable_log_requests", bool), ("enable_log_outputs", bool),
    ("enable_log_deltas", bool), ("max_log_len", int), ("log_config_file", str),
    ("log_error_stack", bool), ("disable_frontend_multiprocessing", bool),
    ("enable_auto_tool_choice", bool), ("tool_call_parser", str), ("tool_parser_plugin", str),
    ("exclude_tools_when_tool_choice_none", bool), ("tool_server", str),
    ("enable_request_id_headers", bool), ("api_server_count", int),
    ("default_chat_template_kwargs", json_value), ("return_tokens_as_token_ids", bool),
    ("enable_per_request_metrics", bool), ("enable_server_load_tracking", bool),
    ("enable_force_include_usage", bool), ("enable_tokenizer_info_endpoint", bool),
    ("cohere_is_reasoning_model", bool), ("cohere_format", str), ("tokens_only", bool),
    ("fingerprint_mode", str), ("fingerprint_value", str),
    ("data_parallel_supervisor_port", int), ("dp_supervisor_probe_interval_s", float),
    ("dp_supervisor_probe_timeout_s", float), ("dp_supervisor_probe_failure_threshold", int),
    ("disable_access_log_for_endpoints", str), ("allow_credentials", bool),
    ("allowed_methods", json_value), ("allowed_headers", json_value),
    ("enable_ssl_refresh", bool), ("h11_max_header_count", int), ("enable_offline_docs", bool),
    ("enable_flash_late_interaction", bool),
)  # fmt: skip
# Values that would change what clients get and cannot be honoured: (name, parse, the values
# accepted, why others are refused).
REFUSED_SERVER_FLAGS = (
    ("lora_modules", "+", (None,), "specdec loads no LoRA adapters"),
    ("response_role", str, (None, "assistant"), "replies always have role 'assistant'"),
    ("chat_template_content_format", str, (None, "auto", "string"),
     "message content reaches the chat template as text ('string')"),
    ("headless", bool, (None, False), "specdec serve always runs its API server"),
    ("grpc", bool, (None, False), "specdec serves HTTP only"),
    ("config", str, (None,), "no YAML option files; give the options as flags"),
)  # fmt: skip
# the vLLM server flags whose default is on (--no-X turns them off)
_ON_BY_DEFAULT = ("enable_log_deltas", "cohere_is_reasoning_model", "enable_flash_late_interaction")
_SHORT_FLAGS = {"api_server_count": ("-asc",)}


# what the honoured vLLM server flags do here
_HONOURED_HELP = {
    "root_path": "the app's path prefix behind a proxy",
    "uds": "listen on this Unix domain socket instead of --host/--port",
    "ssl_keyfile": "TLS: the private key file",
    "ssl_certfile": "TLS: the certificate file",
    "ssl_ca_certs": "TLS: CA certificates that client certificates are checked against",
    "ssl_cert_reqs": "TLS: client certificates (Python's ssl.CERT_*: 0 none, 2 required)",
    "ssl_ciphers": "TLS: the ciphers allowed",
    "disable_uvicorn_access_log": "no access log line per request",
    "h11_max_incomplete_event_size": "the largest incomplete HTTP event, in bytes",
    "middleware": "an ASGI middleware class (import path) to add; repeatable",
    "disable_fastapi_docs": "no /docs, /redoc or /openapi.json",
    "enable_prompt_tokens_details": "accepted: prompt token details are always reported",
}


def _add_vllm_flag(group: Any, name: str, parse: Any, help: str) -> None:
    """One of vLLM's server flags, parsed as vLLM parses it."""
    flags = (f"--{name.replace('_', '-')}", *_SHORT_FLAGS.get(name, ()))
    if parse is bool:
        default = True if name in _ON_BY_DEFAULT else None
        group.add_argument(
            *flags, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help
        )
    elif parse in ("+", "append"):
        nargs = "+" if parse == "+" else None
        action = "append" if parse == "append" else None
        group.add_argument(*flags, dest=name, nargs=nargs, action=action, default=None, help=help)
    else:
        group.add_argument(*flags, dest=name, type=parse, default=None, help=help)


def make_arg_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine flags (EngineArgs, as ``specdec generate``) plus vLLM's server flags, and
    llama.cpp's server sampling defaults (--temp, --top-k, --top-p, --repeat-penalty)."""
    EngineArgs.add_cli_args(p)
    add_sampling_args(p, {}, "the default of requests that set none")
    server = section_group(p, "server")
    _add_access_flags(server)
    _add_request_flags(server)
    _add_limit_flags(server)
    _add_vllm_server_flags(p, server)
    _add_replica_flags(p)
    return p


def _add_access_flags(server: Any) -> None:
    """Where the server listens, under which names, and who may call it."""
    common(server.add_argument("--host", default="127.0.0.1", help="address to bind"))
    common(server.add_argument("--port", type=int, default=8000, help="port to listen on"))
    common(server.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="name(s) clients use; default: the model",
    ))  # fmt: skip
    common(server.add_argument(
        "--api-key", nargs="+", default=None,
        help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV}); one key",
    ), "require 'Authorization: Bearer KEY'")  # fmt: skip
    server.add_argument(
        "--allowed-hosts",
        nargs="+",
        type=_name_list,
        default=None,
        help="Host header names to accept ('*' any, '*.example.com' its subdomains); default: "
        "the loopback names when bound to a loopback address, any otherwise",
    )
    server.add_argument(
        "--allowed-origins",
        nargs="+",
        type=_name_list,
        default=None,
        help="origins (https://app.example.com, or '*') that browsers may call from (CORS); "
        "default: none, CORS off",
    )


def _add_request_flags(server: Any) -> None:
    """Chat templates, shutdown, and special tokens in client text."""
    common(server.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template itself) used instead of the model's: "
        "for base models, or to give a model's tools a template that lists them",
    ), "a chat template (a file, or the text) instead of the model's")  # fmt: skip
    server.add_argument(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accept a chat_template in requests (rendered in a sandboxed worker process with "
        "bounded time and memory); refused by default",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds running requests may take to finish before they are ended "
        f"with an error (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    server.add_argument(
        "--special-tokens-in-content",
        choices=["allow", "text", "reject"],
        default="allow",
        help="special-token strings (a chat turn marker such as <|im_start|>) in client text "
        "(message content, tools, completion prompts): 'allow' reads them as the special tokens "
        "(as vLLM; default), 'text' as plain characters, 'reject' answers 400; a request may ask "
        "for a stricter one in its special_tokens_in_content field",
    )


def _add_limit_flags(server: Any) -> None:
    """Request-head limits, the responses store, metrics names and logging."""
    server.add_argument(
        "--header-read-timeout",
        type=float,
        default=DEFAULT_HEADER_READ_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection must send its complete request head (request line and headers) "
        "within this many seconds of opening or of its request's first byte, else it is closed "
        f"(408); responses are not timed (default {DEFAULT_HEADER_READ_TIMEOUT_S:g}; 0 off)",
    )
    server.add_argument(
        "--body-read-timeout",
        type=float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        metavar="SECONDS",
        help="a request's body must arrive within this many seconds of its head, else the "
        f"connection is closed (408) (default {DEFAULT_BODY_READ_TIMEOUT_S:g}; 0 off)",
    )
    server.add_argument(
        "--error-backoff",
        type=float,
        default=error_backoff.DEFAULT_MAX_DELAY_S,
        metavar="SECONDS",
        help="a client whose requests keep failing (4xx) gets its further error answers late "
        f"while others are being served: after {error_backoff.FREE_FAILURES:g} recent failures, "
        f"{1000 * error_backoff.STEP_S:g} ms more per failure, at most this long (default "
        f"{error_backoff.DEFAULT_MAX_DELAY_S:g}; 0 off)",
    )
    server.add_argument(
        "--max-pending-connections-per-client",
        type=int,
        default=DEFAULT_MAX_PENDING_PER_CLIENT,
        metavar="N",
        help="connections one client address may hold open without a complete request head; "
        f"those beyond are closed (429) (default {DEFAULT_MAX_PENDING_PER_CLIENT}; 0 no cap)",
    )
    server.add_argument(
        "--max-request-head-bytes",
        type=int,
        default=DEFAULT_MAX_HEAD_BYTES,
        metavar="BYTES",
        help=f"the largest request head accepted (431 beyond) (default {DEFAULT_MAX_HEAD_BYTES}; 0 "
        "no limit)",
    )
    server.add_argument(
        "--responses-store-size",
        type=int,
        default=response_store.DEFAULT_STORE_SIZE,
        metavar="N",
        help="/v1/responses kept in memory for previous_response_id and GET (all clients "
        f"together; least recently used out first) (default {response_store.DEFAULT_STORE_SIZE}; 0: "
        "none kept)",
    )
    server.add_argument(
        "--responses-store-bytes",
        type=int,
        default=response_store.DEFAULT_STORE_BYTES,
        metavar="BYTES",
        help="the stored responses' JSON, all clients together "
        f"(default {response_store.DEFAULT_STORE_BYTES})",
    )
    server.add_argument(
        "--metrics-prefix",
        choices=["both", "specdec", "vllm"],
        default="both",
        help="/metrics names: specdec:*, vLLM's vllm:* (what dashboards built for vLLM query), "
        "or both (default)",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )


def _add_vllm_server_flags(p: argparse.ArgumentParser, server: Any) -> None:
    """vLLM's server flags: honoured (in ``server``), ignored and refused (under ``ignored``)."""
    for name, parse in HONOURED_SERVER_FLAGS:
        _add_vllm_flag(server, name, parse, f"vLLM: {_HONOURED_HELP[name]}")
    ignored = section_group(p, "ignored")
    for name, parse in IGNORED_SERVER_FLAGS:
        _add_vllm_flag(ignored, name, parse, "no effect here: a vLLM server option")
    for name, parse, accepted, why in REFUSED_SERVER_FLAGS:
        shown = ", ".join(repr(v) for v in accepted if v is not None)
        what = f"accepted as {shown} only" if shown else "refused if given"
        _add_vllm_flag(ignored, name, parse, f"vLLM: {what} ({why})")


def _add_replica_flags(p: argparse.ArgumentParser) -> None:
    """Replicas on one host (--data-parallel-size) and on Ray Serve."""
    parallel = section_group(p, "parallel")
    parallel.add_argument(
        "--replica-cpu-binding",
        default=None,
        help="with --data-parallel-size N: each replica's cores, '0-3|4-7' (one group per "
        "replica); default: the usable cores split evenly",
    )
    parallel.add_argument(
        "--replica-routing",
        choices=["affinity", "round_robin"],
        default="affinity",
        help="with --data-parallel-size: session, prefix and load affinity (default), or round "
        "robin (a baseline)",
    )
    ray = section_group(p, "ray")
    ray.add_argument("--ray", action="store_true", help="deploy on Ray Serve: one engine per replica behind one OpenAI ingress")  # fmt: skip
    ray.add_argument("--ray-address", default=None, help="join this Ray cluster ('auto': the local one started by `ray start`); default: start a local Ray")  # fmt: skip
    ray.add_argument("--num-replicas", type=int, default=1, help="engine replicas (fixed)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale from this many replicas")  # fmt: skip
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")  # fmt: skip
    ray.add_argument("--target-ongoing-requests", type=float, default=2.0, help="autoscaling target: ongoing requests per replica")  # fmt: skip
    ray.add_argument("--autoscaling-policy", default=None, metavar="MODULE:FUNCTION", help="a custom Ray Serve autoscaling policy (import path); it may read each replica's mean TTFT as ctx.aggregated_metrics['ttft_mean_s']")  # fmt: skip


def _name_list(value: str) -> list[str]:
    """One flag value: a name, or (as vLLM's flags take them) a JSON list of names."""
    if value.lstrip().startswith("["):
        names = json.loads(value)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return names
    return [value]


def flatten_names(groups: list[list[str]] | None) -> list[str] | None:
    return None if groups is None else [name for group in groups for name in group]


def check_serve_args(args: argparse.Namespace) -> tuple[Any, Any, list[str] | None]:
    """Every flag checked (a bad one: exit 2) before anything loads: (engine args, engine
    config, accepted Host names). ``--data-parallel-size`` is the replicas' (one engine each)."""
    if not args.shutdown_timeout >= 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    head_limits(args)
    _check_server_flags(args)
    from specdec.entrypoints.openai.safety import default_allowed_hosts

    allowed_hosts = flatten_names(args.allowed_hosts)
    if allowed_hosts is None:
        allowed_hosts = default_allowed_hosts(args.host)
    args.model = getattr(args, "model_tag", None) or args.model
    num_replicas = args.data_parallel_size
    if num_replicas < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {num_replicas}")
    args.data_parallel_size = 1
    try:
        # NOTE: every engine flag is checked (bad JSON, method, parallel size) before loading
        engine_args = EngineArgs.from_cli_args(args)
        config = engine_args.create_engine_config()
    finally:
        args.data_parallel_size = num_replicas
    return engine_args, config, allowed_hosts


def head_limits(args: argparse.Namespace) -> Any:
    """The request-head limits the flags give (a ConfigError naming a bad one)."""
    from specdec.entrypoints.openai.connection import HeadLimits

    timeout, body = args.header_read_timeout, args.body_read_timeout
    for flag, value in (
        ("--header-read-timeout", timeout),
        ("--body-read-timeout", body),
        ("--error-backoff", args.error_backoff),
    ):
        if not 0 <= value < float("inf"):
            raise ConfigError(f"{flag} must be a number of seconds >= 0, got {value}")
    for flag, value in (
        ("--max-pending-connections-per-client", args.max_pending_connections_per_client),
        ("--max-request-head-bytes", args.max_request_head_bytes),
    ):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    return HeadLimits(
        timeout_s=timeout,
        max_pending_per_client=args.max_pending_connections_per_client,
        max_head_bytes=args.max_request_head_bytes,
        body_timeout_s=body,
    )


def api_key_from(args: argparse.Namespace) -> str | None:
    return (args.api_key or [None])[0] or os.environ.get(API_KEY_ENV) or None


def _given(args: argparse.Namespace, name: str, parse: Any) -> bool:
    """A vLLM server flag was given a value other than its default."""
    value = getattr(args, name)
    default = (name in _ON_BY_DEFAULT) if parse is bool else None
    return value is not None and value != default


def _check_server_flags(args: argparse.Namespace) -> None:
    """One line naming the flag for a value specdec cannot honour (before anything loads)."""
    for name, _, accepted, why in REFUSED_SERVER_FLAGS:
        value = getattr(args, name)
        if value not in accepted:
            shown = " ".join(value) if isinstance(value, list) else value
            raise ConfigError(f"--{name.replace('_', '-')} {shown}: {why}")
    if args.api_key is not None and len(args.api_key) > 1:
        raise ConfigError("--api-key: specdec takes one key, got several")
    for flag in ("responses_store_size", "responses_store_bytes"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0")


def ignored_flags_given(args: argparse.Namespace) -> list[str]:
    """The ignored vLLM server flags given a value other than their default."""
    return [name for name, parse in IGNORED_SERVER_FLAGS if _given(args, name, parse)]
