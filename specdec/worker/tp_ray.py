"""The ``ray`` backend's ranks: tensor-parallel ranks 1..N-1 as Ray actors, possibly on other
machines of the cluster.

Rank 0 stays in the engine process, as with ``mp``; only the way the workers start and how
their liveness is read differ. The actors go into a placement group (one ``{"CPU": threads}``
bundle per worker, ``PACK``: on rank 0's host when it has room). Each actor connects back to
rank 0 over TCP for its command stream (the same messages as the ``mp`` pipe) and joins the
gloo group through rank 0's store at its node address. When every bundle landed on rank 0's
host, the group uses the shared-memory all-reduce and each rank its share of the cores, as
``mp`` does; across hosts the all-reduce is gloo's (over the network: the order of a + b at two
ranks, rank order above; see ``specdec.distributed.comm.TPGroup.all_reduce``).

Every node must hold the model at the same path (vLLM asks the same). A worker that dies (its
actor's task ends) fails the next step with ``TPError``; the engine shuts down, removing the
actors and the placement group. A Ray cluster is used when ``ray.init`` finds one
(``RAY_ADDRESS``); otherwise a local one starts.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from specdec.distributed.faults import TIMEOUT_S, TPError, first_line
from specdec.distributed.shm import make_shm_file
from specdec.worker.tp import DriverGroup, LoadArgs, MpWorkers, worker_main

_HELLO = 4  # bytes: the rank an actor announces on its command connection


class _Rank:
    """One worker rank inside a Ray actor (made a Ray actor class by ``_actor_class``)."""

    def pid(self) -> int:
        return os.getpid()

    def serve(self, rank: int, size: int, host: str, store_port: int, cmd_port: int,
              load: LoadArgs, cores: list[int], threads: int, shm_path: str | None) -> None:  # fmt: skip
        sock = socket.create_connection((host, cmd_port), timeout=TIMEOUT_S)
        sock.settimeout(None)
        sock.sendall(rank.to_bytes(_HELLO, "little"))
        conn = Connection(sock.detach())
        worker_main(rank, size, store_port, load, cores, None, shm_path, conn, host, threads)


def _actor_class() -> Any:
    import ray

    return ray.remote(_Rank)


@dataclass
class RayWorkers(MpWorkers):
    """Ranks 1..N-1 as Ray actors; ``exit_code`` reads whether an actor's ``serve`` ended."""

    actors: list[Any] = field(default_factory=list)
    tasks: list[Any] = field(default_factory=list)
    actor_pids: list[int] = field(default_factory=list)
    group: Any = None  # the placement group

    @property
    def pids(self) -> list[int]:
        return list(self.actor_pids)

    def exit_code(self, i: int) -> int | None:
        import ray

        done, _ = ray.wait([self.tasks[i]], timeout=0)
        return 1 if done else None

    def _reap(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.tasks:
            ray.wait(self.tasks, num_returns=len(self.tasks), timeout=5)
        for a in self.actors:
            ray.kill(a)
        if self.group is not None:
            remove_placement_group(self.group)


def start_group_ray(load: LoadArgs, size: int, cores: list[list[int]], threads: int) -> DriverGroup:
    """Rank 0: place and start the worker actors, accept their command connections and form
    the gloo group (the actors then load their shards; ``wait_for('ready')`` waits)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    host = ray.util.get_node_ip_address()
    workers = RayWorkers()
    try:
        workers.group = placement_group([{"CPU": threads}] * (size - 1), strategy="PACK")
        if not workers.group.wait(TIMEOUT_S):
            raise TPError(f"the Ray cluster has no room for {size - 1} x {threads} CPUs")
        nodes = ray.util.placement_group_table(workers.group)["bundles_to_node_id"]
        local = all(n == ray.get_runtime_context().get_node_id() for n in nodes.values())
        shm_path = make_shm_file(size) if local else None
        listener = socket.create_server((host, 0))
        listener.settimeout(TIMEOUT_S)
        store = dist.TCPStore(
            host, 0, size, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False
        )
        actor = _actor_class()
        for rank in range(1, size):
            strategy = PlacementGroupSchedulingStrategy(workers.group, rank - 1)
            workers.actors.append(
                actor.options(num_cpus=threads, scheduling_strategy=strategy).remote()
            )
        # NOTE: before serve, which holds each actor until the engine stops
        workers.actor_pids = ray.get([a.pid.remote() for a in workers.actors], timeout=TIMEOUT_S)
        for rank, a in enumerate(workers.actors, start=1):
            workers.tasks.append(a.serve.remote(
                rank, size, host, store.port, listener.getsockname()[1], load,
                cores[rank] if local else [], threads, shm_path,
            ))  # fmt: skip
        workers.conns = _accept(listener, size)
        workers.wait_for("joined", time.monotonic() + TIMEOUT_S)
        pg = dist.ProcessGroupGloo(store, 0, size, timedelta(seconds=TIMEOUT_S))
        group = DriverGroup(size, pg, workers, shm_path, store)
    except (RuntimeError, OSError, TPError, ray.exceptions.RayError) as e:
        workers.stop()
        raise TPError(f"tensor-parallel group (ray) did not form: {first_line(e)}") from None
    finally:
        if "shm_path" in locals() and shm_path is not None:
            os.unlink(shm_path)
    return group


def _accept(listener: socket.socket, size: int) -> list[Connection]:
    """Each worker's command connection, in rank order."""
    conns: dict[int, Connection] = {}
    while len(conns) < size - 1:
        sock, _ = listener.accept()
        sock.settimeout(None)
        rank = int.from_bytes(sock.recv(_HELLO), "little")
        conns[rank] = Connection(sock.detach())
    listener.close()
    return [conns[r] for r in range(1, size)]
