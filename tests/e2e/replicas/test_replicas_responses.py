"""``/v1/responses`` through the ``--data-parallel-size 2`` front, and tenants kept apart there.

The front names each request's caller to the replica (a signed header), so a replica keeps
tenants apart as a single server does; ``/v1/responses`` goes to the caller's replica
(rendezvous hashing), so follow-ups, GET and DELETE find what it stored. Clients that differ
only by their source address (127.0.0.1 vs another loopback address) on a front without an API
key are two tenants. A plain ``specdec serve`` ignores the header: a client cannot name itself
another tenant.
"""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest

from specdec.entrypoints.openai.server_common import (
    CLIENT_HEADER,
    CLIENT_SIGNATURE_HEADER,
    client_signature,
)
from specdec.entrypoints.replicas.router import rendezvous
from tests.fixtures.replicas import MODEL
from tests.fixtures.server import serve

GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def open_front():
    """A -dp 2 front without an API key (tenants are told apart by address there)."""
    with serve(
        MODEL, "-dp", "2", "--max-model-len", "1024", "--shutdown-timeout", "2",
        "--uvicorn-log-level", "warning", timeout=180, grace=0,
    ) as srv:  # fmt: skip
        yield srv


def _key_lane(key: str) -> str:
    """``client_lane`` of a client sending ``Authorization: Bearer <key>``."""
    auth = f"Bearer {key}".encode()
    return "key:" + hashlib.blake2b(auth, digest_size=8).hexdigest()


def _from(address: str) -> httpx.Client:
    """A client whose connections leave from ``address`` (a loopback address)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=120)


def _count(url: str, messages: list[dict]) -> int:
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.json()["count"]


def test_a_conversation_continues_through_the_front(open_front) -> None:
    url, auth = open_front.url, {"Authorization": "Bearer key-a"}
    home = str(rendezvous(_key_lane("key-a"), [0, 1]))  # the tenant's replica
    first = httpx.post(
        f"{url}/v1/responses", headers=auth, timeout=120,
        json={"input": "My name is Ada. Say hello.", "max_output_tokens": 12, **GREEDY},
    )  # fmt: skip
    assert first.status_code == 200, first.text[:300]
    assert first.headers["x-specdec-replica"] == home
    first = first.json()
    second = httpx.post(
        f"{url}/v1/responses", headers=auth, timeout=120,
        json={"input": "What is my name?", "previous_response_id": first["id"],
              "max_output_tokens": 12, **GREEDY},
    )  # fmt: skip
    assert second.status_code == 200, second.text[:300]
    assert second.headers["x-specdec-replica"] == home
    second = second.json()
    assert second["previous_response_id"] == first["id"]
    chat = [
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first["output"][0]["content"][0]["text"]},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second["usage"]["input_tokens"] == _count(url, chat)  # the earlier turn is there
    got = httpx.get(f"{url}/v1/responses/{first['id']}", headers=auth, timeout=60)
    assert got.status_code == 200 and got.json() == first
    assert got.headers["x-specdec-replica"] == home
    gone = httpx.delete(f"{url}/v1/responses/{second['id']}", headers=auth, timeout=60)
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    again = httpx.get(f"{url}/v1/responses/{second['id']}", headers=auth, timeout=60)
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"
    bad = httpx.post(f"{url}/v1/responses", json={"input": 3}, headers=auth, timeout=60)
    assert bad.status_code == 400 and "x-specdec-replica" not in bad.headers  # before routing


def test_a_streamed_response_is_relayed_and_stored(open_front) -> None:
    url, auth = open_front.url, {"Authorization": "Bearer key-s"}
    body = {"input": "Tell me about cats.", "max_output_tokens": 10, "stream": True, **GREEDY}
    kinds, final = [], None
    with httpx.stream(
        "POST", f"{url}/v1/responses", json=body, headers=auth, timeout=120
    ) as r:  # fmt: skip
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-specdec-replica"] == str(rendezvous(_key_lane("key-s"), [0, 1]))
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                kinds.append(data["type"])
                final = data.get("response", final)
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    later = httpx.post(
        f"{url}/v1/responses", headers=auth, timeout=120,
        json={"input": "More.", "previous_response_id": final["id"], "max_output_tokens": 2,
              **GREEDY},
    )  # fmt: skip
    assert later.status_code == 200, later.text[:300]
    used = final["usage"]
    assert later.json()["usage"]["input_tokens"] > used["input_tokens"] + used["output_tokens"]


def test_tenants_told_apart_by_address_behind_the_front(open_front) -> None:
    """Two clients differing only by source address, on the same replica (so the replica, not
    the routing, keeps them apart): the other's id is a 404, the owner's a 200."""
    url = open_front.url
    home = rendezvous("host:127.0.0.1", [0, 1])
    other = next(
        f"127.0.0.{i}" for i in range(2, 60) if rendezvous(f"host:127.0.0.{i}", [0, 1]) == home
    )
    with _from("127.0.0.1") as a, _from(other) as b:
        made = a.post(
            f"{url}/v1/responses", json={"input": "A secret: 42.", "max_output_tokens": 4, **GREEDY}
        )
        assert made.status_code == 200 and made.headers["x-specdec-replica"] == str(home)
        rid = made.json()["id"]
        theirs = b.get(f"{url}/v1/responses/{rid}")
        assert theirs.status_code == 404 and theirs.headers["x-specdec-replica"] == str(home)
        assert b.delete(f"{url}/v1/responses/{rid}").status_code == 404
        follow = b.post(
            f"{url}/v1/responses", json={"input": "Go on.", "previous_response_id": rid, **GREEDY}
        )
        assert follow.status_code == 404
        assert follow.json()["error"]["param"] == "previous_response_id"
        # a client naming itself the owner in the front's header is still itself
        spoof = {CLIENT_HEADER: "host:127.0.0.1", CLIENT_SIGNATURE_HEADER: "0" * 64}
        assert b.get(f"{url}/v1/responses/{rid}", headers=spoof).status_code == 404
        mine = a.get(f"{url}/v1/responses/{rid}")
        assert mine.status_code == 200 and mine.json()["id"] == rid


def test_a_plain_server_ignores_the_forwarded_client(single) -> None:
    """Without a front's secret, a server takes no caller from the header, signed or not."""
    url = single.url
    with _from("127.0.0.1") as a, _from("127.0.0.3") as b:
        made = a.post(
            f"{url}/v1/responses", json={"input": "Mine.", "max_output_tokens": 2, **GREEDY}
        )
        assert made.status_code == 200, made.text[:300]
        rid = made.json()["id"]
        for signature in (None, "0" * 64, client_signature("host:127.0.0.1", "")):
            spoof = {CLIENT_HEADER: "host:127.0.0.1"}
            if signature is not None:
                spoof[CLIENT_SIGNATURE_HEADER] = signature
            assert b.get(f"{url}/v1/responses/{rid}", headers=spoof).status_code == 404
            assert b.delete(f"{url}/v1/responses/{rid}", headers=spoof).status_code == 404
        assert a.get(f"{url}/v1/responses/{rid}").status_code == 200
