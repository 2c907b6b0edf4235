"""``specdec serve MODEL --data-parallel-size N``: N engine processes behind one front."""

from __future__ import annotations

import argparse
import logging
import os

from specdec.entrypoints.replicas.cores import split_cores
from specdec.entrypoints.replicas.pool import ReplicaPool, replica_argv

logger = logging.getLogger("specdec.entrypoints.replicas")


def serve_replicas(
    args: argparse.Namespace, argv: list[str], api_key: str | None, allowed_hosts: list[str] | None
) -> int:
    """Start the replicas and the front (``--host``/``--port``); serve until interrupted."""
    import uvicorn

    from specdec.entrypoints.openai.api_server import FLUSH_TIMEOUT_S, head_limits, make_server
    from specdec.entrypoints.openai.connection import guarded_protocol
    from specdec.entrypoints.replicas.front import build_front_app
    from specdec.entrypoints.replicas.router import Router, RouterConfig

    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: not a line per health poll
    num = args.data_parallel_size
    groups = split_cores(num, args.replica_cpu_binding, "--replica-cpu-binding")
    pool = ReplicaPool(replica_argv(argv), groups, threads=args.threads)
    router = Router(RouterConfig(policy=args.replica_routing))
    pool.on_restart = router.reset
    app = build_front_app(
        pool, router, api_key, allowed_hosts=allowed_hosts, shutdown_timeout=args.shutdown_timeout,
        error_backoff_s=args.error_backoff,
    )  # fmt: skip
    logger.info(
        "%d replicas of %s (cores %s) behind http://%s:%d/v1; API key: %s",
        num, args.model, " | ".join(",".join(map(str, g)) for g in groups), args.host,
        args.port, "required" if api_key else "none",
    )  # fmt: skip
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S, http=guarded_protocol(head_limits(args)),
    )  # fmt: skip
    server = make_server(config)
    try:
        server.run()
    finally:
        pool.kill_now()  # NOTE: a no-op after a clean lifespan shutdown
    return 0 if server.started else 1


def check_replica_binding(args: argparse.Namespace) -> None:
    """Replicas and ranks: each replica's ranks split that replica's own cores, so a per-rank
    binding (``--cpu-binding``, or its environment variable), which every replica would take
    whole, is refused with ``--data-parallel-size``; so is ``-dp`` with ``--ray``."""
    from specdec.config import ConfigError
    from specdec.distributed.binding import BIND_ENV

    if args.data_parallel_size == 1:
        return
    if args.ray:
        raise ConfigError("--data-parallel-size with --ray: use --num-replicas")
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    if getattr(args, "cpu_binding", None) or (tp > 1 and os.environ.get(BIND_ENV)):
        raise ConfigError(
            f"--cpu-binding (or {BIND_ENV}) with --data-parallel-size: each replica's ranks "
            "split its own cores; choose the replicas' cores with --replica-cpu-binding"
        )


def cmd_serve_any(args: argparse.Namespace) -> int:
    """``specdec serve``: one engine, ``--data-parallel-size N`` replicas, or ``--ray``."""
    from specdec.entrypoints.openai.api_server import api_key_from, check_serve_args, cmd_serve
    from specdec.entrypoints.replicas.ray_app import check_ray_args
    from specdec.entrypoints.utils import LOG_FORMAT

    check_ray_args(args)
    check_replica_binding(args)
    if not args.ray and args.data_parallel_size == 1:
        return cmd_serve(args)
    _, _, allowed_hosts = check_serve_args(args)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    argv = list(getattr(args, "raw_argv", []))
    if args.ray:
        from specdec.entrypoints.replicas.ray_app import serve_ray

        return serve_ray(args, argv, api_key_from(args), allowed_hosts)
    return serve_replicas(args, argv, api_key_from(args), allowed_hosts)
