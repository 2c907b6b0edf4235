"""Tensor-parallel ranks on one host: the worker processes, their loop, and rank 0's driver
that commands them (the communicator the model sees is ``specdec.distributed.comm.TPGroup``).

Rank 0 lives in the engine process (scheduler, speculator, sampling, every drafter); ranks
1..N-1 are fresh interpreters (``python -m specdec.worker.tp``: never a re-import of the user's
script, so a snippet without a ``__main__`` guard works). The lockstep is at the model forward:
rank 0's ``LlamaModel.forward_capture`` calls ``DriverGroup.send_forward``, which sends each
forward's inputs (ids, positions, SeqBatch, layer count, which KV cache) down a pipe to every
worker, then all ranks run their shard and meet at two all-reduces per layer. Drafters that
call the target (layer skip, the adaptive controller's cost probe, EAGLE's hidden states)
therefore work unchanged at any TP. The executors (engine/mp_executor.py) start, watch and stop
the workers.

Faults: a worker that raises or dies makes rank 0's next collective fail (the peer's socket
closes) or time out; rank 0 raises ``TPError`` and the engine shuts down cleanly (no restart:
a half-written KV on one rank cannot be trusted). Workers die with the engine process
(a parent-pid watchdog thread) and on a closed pipe.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from specdec.distributed.binding import bind_rank
from specdec.distributed.comm import TPGroup
from specdec.distributed.faults import TIMEOUT_S, TPError, first_line
from specdec.distributed.shm import SHM_CAP, ShmAllReduce, make_shm_file
from specdec.model.model_loader import load_model

if TYPE_CHECKING:
    from specdec.kv_cache.pool import KVCache
    from specdec.model.llama import LlamaModel, SeqBatch

# NOTE: the communicator, the shared-memory reducer and the fault type moved to
# specdec.distributed; their names stay importable from here
__all__ = [
    "SHM_CAP", "TIMEOUT_S", "DriverGroup", "LoadArgs", "MpWorkers", "ShmAllReduce", "TPError",
    "TPGroup", "make_shm_file", "start_group", "worker_main",
]  # fmt: skip
logger = logging.getLogger("specdec.tp")


@dataclass
class LoadArgs:
    """What a worker needs to load its shard (the same choices as rank 0's ``load_model``)."""

    model: str
    dtype: str  # torch dtype name
    kernels: str
    quantization: str
    max_len: int | None
    activation_dtype: str
    kv_cache_dtype: str
    tokenizer: str | None


class DriverGroup(TPGroup):
    """Rank 0's group: the communicator of ``TPGroup``, and the workers it drives. Before each
    forward and each logits computation the model calls ``send_forward`` / ``send_logits``,
    which hand the same inputs to every worker; each KV cache the model uses is mirrored on
    the workers by id."""

    def __init__(
        self, size: int, pg: Any, workers: MpWorkers, shm_path: str | None, store: Any
    ) -> None:
        super().__init__(0, size, pg, shm_path, workers.check)
        self.workers = workers
        self.store = store  # NOTE: the store's server lives as long as the group
        self._kv_ids: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()

    def send_forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: SeqBatch,
        kv: KVCache,
        capture: tuple[int, ...],
        num_layers: int | None,
    ) -> None:
        """Hand one forward's inputs to every worker (they mirror ``kv`` by id)."""
        kv_id = self._kv_ids.get(kv)
        if kv_id is None:
            kv_id = self._kv_ids[kv] = len(self._kv_ids)
            self.workers.send(("make_kv", kv_id, (kv.k.shape[0], kv.num_slots, kv.max_len)))
            kv.mirror = self._mirror(kv_id)
        self.workers.send(("forward", kv_id, input_ids, positions, batch, capture, num_layers))

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Hand the rows whose logits rank 0 computes next to every worker."""
        self.workers.send(("logits", None, hidden))

    def send_key_transform(self) -> None:
        """Have every worker measure its heads' 8-bit key transform beside rank 0."""
        self.workers.send(("key_transform", None))

    def _mirror(self, kv_id: int) -> Callable[[str, tuple], None]:
        workers = self.workers

        def mirror(method: str, args: tuple) -> None:
            if not workers.closed:
                workers.send(("kv", kv_id, method, args))

        return mirror


@dataclass
class MpWorkers:
    """Ranks 1..N-1 as spawned processes, each with a command pipe."""

    procs: list[Any] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    closed: bool = False
    # rank 0's cores and torch threads before it bound itself, given back on stop
    restore: tuple[set[int], int] | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def exit_code(self, i: int) -> int | None:
        """Worker ``i`` (rank i + 1)'s exit status; None while it runs."""
        return self.procs[i].poll()

    def send(self, cmd: tuple) -> None:
        data = pickle.dumps(cmd)  # NOTE: plain pickle: tensors by value, not by shared fd
        try:
            for c in self.conns:
                c.send_bytes(data)
        except (OSError, ValueError) as e:
            raise TPError(f"tensor-parallel worker unreachable: {first_line(e)}") from None

    def check(self) -> None:
        """Raise ``TPError`` when a worker has exited."""
        for i, pid in enumerate(self.pids):
            code = self.exit_code(i)
            if code is not None:
                raise TPError(f"tensor-parallel rank {i + 1} (pid {pid}) exited ({code})")

    def wait_for(self, expected: str, deadline: float) -> None:
        """Wait (bounded, watching each worker) for every worker's ``expected`` message."""
        for i, c in enumerate(self.conns):
            while not c.poll(0.2):
                if self.exit_code(i) is not None or time.monotonic() > deadline:
                    raise TPError(f"tensor-parallel rank {i + 1} failed to start")
            kind, msg = c.recv()
            if kind != expected:
                raise TPError(f"tensor-parallel rank {i + 1}: {msg}")

    def stop(self) -> None:
        """Close the pipes, then terminate and reap every worker (bounded)."""
        if self.closed:
            return
        self.closed = True
        if self.restore is not None:
            os.sched_setaffinity(0, self.restore[0])
            torch.set_num_threads(self.restore[1])
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(None))
                c.close()
            except (OSError, ValueError):
                pass
        self._reap()

    def _reap(self) -> None:
        """Wait (bounded) for every worker to exit, killing those that do not."""
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start_group(load: LoadArgs, size: int, cores: list[list[int]]) -> DriverGroup:
    """Rank 0: start workers 1..size-1 and join them in a gloo group (they load their shards
    while rank 0 loads its own; ``MpWorkers.wait_for('ready')`` waits for them)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, size, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False
    )
    shm_path = make_shm_file(size)
    workers = MpWorkers()
    for rank in range(1, size):
        parent, child = socket.socketpair()
        args = (rank, size, store.port, load, cores[rank], os.getpid(), shm_path)
        p = subprocess.Popen(
            [sys.executable, "-m", "specdec.worker.tp", str(child.fileno())],
            stdin=subprocess.PIPE, pass_fds=(child.fileno(),), env=_worker_env(),
        )  # fmt: skip
        p.stdin.write(pickle.dumps(args))
        p.stdin.close()
        child.close()
        workers.procs.append(p)
        workers.conns.append(Connection(parent.detach()))
    try:
        workers.wait_for("joined", time.monotonic() + TIMEOUT_S)
        pg = dist.ProcessGroupGloo(store, 0, size, timedelta(seconds=TIMEOUT_S))
        group = DriverGroup(size, pg, workers, shm_path, store)
    except (RuntimeError, TPError) as e:
        workers.stop()
        raise TPError(f"tensor-parallel group did not form: {first_line(e)}") from None
    finally:
        if shm_path is not None:  # NOTE: every rank has it mapped: nothing left behind on a kill
            os.unlink(shm_path)
    return group


def _worker_env() -> dict[str, str]:
    """This process's environment, with the specdec it runs first on the path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the engine process is gone. NOTE: not PR_SET_PDEATHSIG, which fires when the
    parent *thread* exits: an engine built in a short-lived thread would lose its workers."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="specdec-tp-watchdog").start()


def worker_main(
    rank: int,
    size: int,
    port: int,
    load: LoadArgs,
    cores: list[int],
    parent_pid: int | None,
    shm_path: str | None,
    conn: Connection,
    host: str = "127.0.0.1",
    threads: int | None = None,
) -> None:
    """A worker rank: bind, join the group, load the shard, then run forwards until told to
    stop (or until the pipe closes). Any error ends the process: rank 0's collective fails.
    ``parent_pid`` None (a Ray actor): no parent watch, the closed connection ends it;
    ``cores`` empty: no binding, ``threads`` torch threads."""
    if parent_pid is not None:
        _die_with_parent(parent_pid)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: Ctrl-C is the engine's to handle
    if cores:
        bind_rank(cores, threads)
    elif threads:
        torch.set_num_threads(threads)
    try:
        store = dist.TCPStore(host, port, size, False, timeout=timedelta(seconds=TIMEOUT_S))
        group = TPGroup(rank, size, None, shm_path)  # maps the file before rank 0 unlinks it
        conn.send(("joined", None))
        group.join(dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=TIMEOUT_S)))
        model = _load_shard(load, group)
        conn.send(("ready", None))
    except Exception as e:  # noqa: BLE001 - reported to rank 0 in one line
        conn.send(("error", f"{type(e).__name__}: {first_line(e)}"))
        os._exit(1)
    _serve(model, conn, leave=parent_pid is not None)


def _load_shard(load: LoadArgs, group: TPGroup) -> LlamaModel:
    model, _ = load_model(
        load.model, torch.device("cpu"), getattr(torch, load.dtype), load.kernels,
        load.quantization, load.max_len, load.activation_dtype, load.kv_cache_dtype,
        load.tokenizer, tp=group,
    )  # fmt: skip
    return model


def _run(model: LlamaModel, kvs: dict[int, KVCache], cmd: tuple) -> None:
    """One command from rank 0: make a KV cache, mirror a change to one, run a forward,
    compute this rank's logits of some rows, or measure the 8-bit cache's key transform."""
    kind, kv_id, *args = cmd
    if kind == "make_kv":
        num_layers, num_slots, max_len = args[0]
        kvs[kv_id] = model.make_kv_cache(num_slots, max_len, num_layers)
    elif kind == "kv":
        method, margs = args
        getattr(kvs[kv_id], method)(*margs)
    elif kind == "logits":
        model.compute_logits(args[0])
    elif kind == "key_transform":
        model.set_key_transform(*model.measure_key_transform())
    else:
        input_ids, positions, batch, capture, num_layers = args
        model.forward_capture(input_ids, positions, batch, kvs[kv_id], capture, num_layers)


def _serve(model: LlamaModel, conn: Connection, leave: bool = True) -> None:
    """Run rank 0's commands until told to stop; then exit the process (``leave``), or return
    (a Ray actor, which the engine then removes)."""
    kvs: dict[int, KVCache] = {}
    while True:
        try:
            cmd = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            cmd = None
        if cmd is None:
            conn.close()
            if leave:
                os._exit(0)
            return
        try:
            _run(model, kvs, cmd)
        except Exception as e:  # noqa: BLE001 - the peer's failed collective reports it
            logger.error("tensor-parallel rank %d failed: %s", model.tp.rank, first_line(e))
            os._exit(1)


if __name__ == "__main__":
    worker_main(*pickle.loads(sys.stdin.buffer.read()), Connection(int(sys.argv[1])))
