"""N ``specdec serve`` engine processes on one host, each on its own cores, behind Unix sockets.

Each replica is a whole specdec server (its own AsyncLLM, prefix cache and drafter) started as
``python -m specdec.cli serve ... --uds DIR/replica-I.sock`` in a new session
(a terminal's Ctrl-C reaches the front only, which then stops the replicas in order), pinned to
its cores with one thread per core, and told to die with its parent (PR_SET_PDEATHSIG): a front
killed outright leaves no engine behind. The sockets live in a private 0700 directory: nothing
but the front can reach a replica, so replicas need no API key of their own. Each replica gets
the pool's random ``client_secret`` in its environment (never on its command line): the front
signs the caller it names in each relayed request with it (``server_common.client_lane``).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from specdec.entrypoints.openai.server_common import FORWARDED_CLIENT_SECRET_ENV

logger = logging.getLogger("specdec.entrypoints.replicas")

_PR_SET_PDEATHSIG = 1
MAX_BACKOFF_S = 30.0

# serve flags the front owns (its socket, TLS, key and Host/CORS policy): never passed on.
# (flag, number of values: -1 = all until the next flag)
FRONT_FLAGS: dict[str, int] = {
    "--data-parallel-size": 1, "-dp": 1, "--data-parallel-rank": 1, "-dpn": 1,
    "--host": 1, "--port": 1, "--uds": 1,
    "--root-path": 1, "--ssl-keyfile": 1, "--ssl-certfile": 1, "--ssl-ca-certs": 1,
    "--ssl-cert-reqs": 1, "--ssl-ciphers": 1, "--middleware": 1, "--api-key": -1,
    "--allowed-hosts": -1, "--allowed-origins": -1, "--replica-cpu-binding": 1, "--ray": 0,
    "--ray-address": 1, "--num-replicas": 1, "--min-replicas": 1, "--max-replicas": 1,
    "--target-ongoing-requests": 1, "--replica-routing": 1, "--autoscaling-policy": 1,
}  # fmt: skip


def replica_argv(argv: list[str]) -> list[str]:
    """``specdec serve``'s arguments without the flags the front owns."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag not in FRONT_FLAGS:
            out.append(argv[i])
            i += 1
            continue
        i += 1
        if "=" in argv[i - 1]:
            continue
        values = FRONT_FLAGS[flag]
        if values == -1:
            while i < len(argv) and not argv[i].startswith("-"):
                i += 1
        else:
            i += values
    return out


def _child_setup(cores: list[int]) -> None:
    """In the replica, before exec: its cores, and death with the front."""
    os.sched_setaffinity(0, cores)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class Replica:
    index: int
    cores: list[int]
    socket_path: str
    proc: subprocess.Popen | None = None
    up: bool = False
    ongoing: int = 0
    restarts: int = 0
    failures: int = 0  # deaths since it was last healthy (the restart backoff)
    respawn_at: float = 0.0
    client: Any = None  # an httpx.AsyncClient on its socket
    watcher: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


@dataclass
class ReplicaPool:
    """The replica processes; ``monitor()`` restarts any that dies (with a backoff)."""

    argv: list[str]
    core_groups: list[list[int]]
    threads: int | None = None  # None: one per core of the replica's group
    startup_timeout: float = 600.0
    on_restart: Any = None  # called with the replica index when a replica comes back empty
    replicas: list[Replica] = field(default_factory=list)
    stopping: bool = False
    # the replicas honour the caller the front names only when signed with this (never logged)
    client_secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)

    def __post_init__(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="specdec-replicas-")
        os.chmod(self.workdir, 0o700)
        for i, cores in enumerate(self.core_groups):
            path = os.path.join(self.workdir, f"replica-{i}.sock")
            self.replicas.append(Replica(i, cores, path))

    def command(self, r: Replica) -> list[str]:
        threads = self.threads or len(r.cores)
        return [
            sys.executable, "-m", "specdec.cli", "serve", *self.argv,
            "--uds", r.socket_path, "--threads", str(threads),
            "--data-parallel-rank", str(r.index),  # its KV events' rank and port offset
        ]  # fmt: skip

    def spawn(self, r: Replica) -> None:
        import httpx

        if os.path.exists(r.socket_path):
            os.unlink(r.socket_path)
        env = {k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEY"}
        env["SPECDEC_REPLICA"] = str(r.index)
        env[FORWARDED_CLIENT_SECRET_ENV] = self.client_secret
        r.proc = subprocess.Popen(
            self.command(r),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: _child_setup(r.cores),  # noqa: PLW1509
        )
        if r.client is None:
            transport = httpx.AsyncHTTPTransport(uds=r.socket_path)
            timeout = httpx.Timeout(None, connect=5.0)
            r.client = httpx.AsyncClient(
                transport=transport, base_url="http://localhost", timeout=timeout
            )
        logger.info("replica %d: pid %d on cores %s", r.index, r.proc.pid, _cores(r.cores))

    async def wait_healthy(self, r: Replica, timeout: float) -> bool:
        """Poll the replica's /health until it answers 200 (True), dies or times out."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping:
            if r.proc is None or r.proc.poll() is not None:
                return False
            try:
                resp = await r.client.get("/health", timeout=2.0)
                if resp.status_code == 200:
                    r.up, r.failures = True, 0
                    logger.info("replica %d: ready", r.index)
                    return True
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
        return False

    async def start(self) -> None:
        """Start every replica and wait until all are healthy (a replica that fails to start
        is a RuntimeError: its own log lines say why)."""
        for r in self.replicas:
            self.spawn(r)
        ready = await asyncio.gather(
            *(self.wait_healthy(r, self.startup_timeout) for r in self.replicas)
        )
        failed = [r.index for r, ok in zip(self.replicas, ready) if not ok]
        if failed:
            raise RuntimeError(f"replica(s) {failed} did not start (see their log lines above)")

    def mark_down(self, r: Replica) -> None:
        r.up = False

    def mark_lost(self, r: Replica) -> None:
        """A connection to ``r`` broke: no new requests until its /health answers again (a
        process that is exiting after a kill can take a while to be reaped, and requests routed
        to it meanwhile got a 503 where another replica was up); one that exits is restarted by
        the monitor as any other."""
        if not r.up or self.stopping:
            return
        r.up = False
        if r.watcher is None or r.watcher.done():
            r.watcher = asyncio.ensure_future(self.wait_healthy(r, self.startup_timeout))

    def serving(self) -> list[Replica]:
        """The replicas that take new requests: up, and alive now. One that died since the
        monitor's last look (it polls every 0.2 s) is marked down here: a pooled connection to
        it would fail only once a request was sent, a 503 instead of another replica."""
        for r in self.replicas:
            if r.up and r.proc is not None and r.proc.poll() is not None:
                self.mark_down(r)
        return [r for r in self.replicas if r.up]

    async def monitor(self, interval: float = 0.2) -> None:
        """Restart replicas that died, until ``stop``."""
        while not self.stopping:
            now = time.monotonic()
            for r in self.replicas:
                if r.proc is None or r.proc.poll() is None or self.stopping:
                    continue
                if r.up or r.respawn_at == 0.0:
                    r.up = False
                    r.failures += 1
                    r.respawn_at = now + min(MAX_BACKOFF_S, 0.5 * 2 ** (r.failures - 1))
                    logger.warning(
                        "replica %d (pid %d) exited with %s; restarting",
                        r.index, r.proc.pid, r.proc.returncode,
                    )  # fmt: skip
                elif now >= r.respawn_at:
                    r.respawn_at = 0.0
                    r.restarts += 1
                    if self.on_restart is not None:
                        self.on_restart(r.index)
                    self.spawn(r)
                    r.watcher = asyncio.ensure_future(self.wait_healthy(r, self.startup_timeout))
            await asyncio.sleep(interval)

    def terminate(self) -> None:
        """SIGTERM every replica (each drains its own requests); no restarts from now on."""
        self.stopping = True
        for r in self.replicas:
            r.up = False
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)

    async def stop(self, timeout: float) -> None:
        """Terminate, wait up to ``timeout`` s, kill what is left, remove the sockets."""
        self.terminate()
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            while r.proc is not None and r.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if r.proc is not None and r.proc.poll() is None:
                logger.warning("replica %d: killing pid %d", r.index, r.proc.pid)
                r.proc.kill()
                r.proc.wait()
            if r.client is not None:
                await r.client.aclose()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def kill_now(self) -> None:
        """Last resort (the front is exiting without its lifespan): kill by PID."""
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _cores(cores: list[int]) -> str:
    return ",".join(map(str, cores)) if len(cores) < 8 else f"{cores[0]}-{cores[-1]}"
