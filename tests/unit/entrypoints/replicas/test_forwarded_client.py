"""The caller a front names to its replicas: signed with the front's secret, honoured only with
it; the pool hands the secret to its replicas by environment, never on a command line; the
front routes a tenant's /v1/responses to one replica among those up."""

import asyncio
from types import SimpleNamespace

import pytest

from specdec.entrypoints.openai.server_common import (
    CLIENT_HEADER,
    CLIENT_SIGNATURE_HEADER,
    FORWARDED_CLIENT_SECRET_ENV,
    client_lane,
    forwarded_client,
    forwarded_client_headers,
)
from specdec.entrypoints.replicas.router import rendezvous

SECRET = "f" * 64


def _request(headers: dict, host: str | None = "10.0.0.9") -> SimpleNamespace:
    client = SimpleNamespace(host=host) if host else None
    return SimpleNamespace(headers={k.lower(): v for k, v in headers.items()}, client=client)


def test_a_signed_caller_is_honoured_only_with_the_secret():
    named = forwarded_client_headers("key:0123456789abcdef", SECRET)
    assert set(named) == {CLIENT_HEADER, CLIENT_SIGNATURE_HEADER}
    assert SECRET not in "".join(named.values())  # a signature, never the secret
    assert client_lane(_request(named), SECRET) == "key:0123456789abcdef"
    assert forwarded_client(named, SECRET) == "key:0123456789abcdef"
    assert client_lane(_request(named)) == "host:10.0.0.9"  # a server without the secret
    assert client_lane(_request(named), "e" * 64) == "host:10.0.0.9"  # another front's


@pytest.mark.parametrize(
    "headers",
    [
        {CLIENT_HEADER: "host:10.0.0.1"},  # no signature
        {CLIENT_HEADER: "host:10.0.0.1", CLIENT_SIGNATURE_HEADER: ""},
        {CLIENT_HEADER: "host:10.0.0.1", CLIENT_SIGNATURE_HEADER: "0" * 64},
        {CLIENT_HEADER: "host:10.0.0.1", CLIENT_SIGNATURE_HEADER: "é"},
        # another caller's signature
        {CLIENT_HEADER: "host:10.0.0.1",
         CLIENT_SIGNATURE_HEADER: forwarded_client_headers("host:10.0.0.2", SECRET)[CLIENT_SIGNATURE_HEADER]},
    ],
)  # fmt: skip
def test_an_unsigned_or_forged_caller_is_ignored(headers):
    assert client_lane(_request(headers), SECRET) == "host:10.0.0.9"
    keyed = _request({**headers, "Authorization": "Bearer k"}, host=None)
    assert client_lane(keyed, SECRET).startswith("key:")


def test_the_pool_passes_its_secret_by_environment(tmp_path, monkeypatch):
    from specdec.entrypoints.replicas import pool as pool_mod

    started = []

    class FakePopen:
        def __init__(self, cmd, env, **kw):
            started.append((cmd, env))
            self.pid = 1

        def poll(self):
            return 0  # exited: nothing to stop

    monkeypatch.setattr(pool_mod.subprocess, "Popen", FakePopen)
    monkeypatch.setenv(FORWARDED_CLIENT_SECRET_ENV, "inherited")
    pool = pool_mod.ReplicaPool(["--model", "m"], [[0], [1]])
    other = pool_mod.ReplicaPool(["--model", "m"], [[0]])
    try:
        assert len(pool.client_secret) == 64 and pool.client_secret != other.client_secret
        assert pool.client_secret not in repr(pool)
        for r in pool.replicas:
            pool.spawn(r)
        for cmd, env in started:
            assert env[FORWARDED_CLIENT_SECRET_ENV] == pool.client_secret
            assert pool.client_secret not in " ".join(cmd)
    finally:
        asyncio.run(pool.stop(0.1))
        asyncio.run(other.stop(0.1))


def test_a_tenants_responses_go_to_one_replica_among_those_up():
    from specdec.entrypoints.openai.server_common import ServerState
    from specdec.entrypoints.replicas.front import _Relay
    from specdec.entrypoints.replicas.pool import Replica, ReplicaPool
    from specdec.entrypoints.replicas.router import Router

    replicas = [Replica(index=i, cores=[], socket_path="", up=True) for i in range(3)]
    pool = ReplicaPool(argv=[], core_groups=[], replicas=replicas)
    relay = _Relay(pool, Router(), ServerState(allowed_hosts=None), 1 << 20, SECRET)
    tenants = [f"host:10.0.0.{i}" for i in range(12)]
    home = {t: relay.pick_tenant(t).index for t in tenants}
    assert home == {t: rendezvous(t, [0, 1, 2]) for t in tenants}
    assert len(set(home.values())) > 1  # tenants spread over the replicas
    replicas[0].ongoing = 50  # load does not move a tenant
    assert {t: relay.pick_tenant(t).index for t in tenants} == home
    replicas[1].up = False  # its tenants move; the others stay
    for t in tenants:
        moved = relay.pick_tenant(t).index
        assert moved == home[t] if home[t] != 1 else moved in (0, 2)
    assert relay.decisions[(2, "tenant")] > 0
    # a replica whose process died since the monitor's last look takes no new request
    import subprocess
    import sys

    replicas[1].up = True
    replicas[1].proc = subprocess.Popen([sys.executable, "-c", "pass"])
    replicas[1].proc.wait()
    assert all(relay.pick_tenant(t).index != 1 for t in tenants)
    assert relay.pick("text", None, None).index != 1
    assert not replicas[1].up  # marked down, for the monitor to restart
