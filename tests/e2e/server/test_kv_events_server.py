"""``specdec serve smollm2-135m --kv-events-config ...``: a router subscribed to the KV events
rebuilds the replica's block index from the events alone and predicts which new requests hit
the prefix cache, and for how many tokens, as the server then reports them (usage
``cached_tokens`` and the ``vllm:prefix_cache_hits`` counter); eviction sends BlockRemoved, a replay returns what a late
subscriber missed; with ``--data-parallel-size 2`` each replica publishes on its own port with
its rank. (AllBlocksCleared, sent by ``reset_prefix_cache``, is tested on the engine:
tests/unit/engine/test_kv_events.py.)"""

from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.fixtures.kv_events_client import BlockIndex, decode, receive, replay
from tests.fixtures.server import free_port, serve

zmq = pytest.importorskip("zmq")
MODEL = "smollm2-135m"
REPO = Path(__file__).resolve().parents[3]
BLOCK = 16


@contextmanager
def _serve(*flags: str, timeout: float = 240.0):
    """``specdec serve`` in a subprocess; killed (it and its replicas, by PID) on exit."""
    with serve(
        MODEL, "--max-model-len", "512", "--uvicorn-log-level", "warning",
        "--shutdown-timeout", "2", *flags, timeout=timeout, grace=0,
    ) as srv:  # fmt: skip
        yield srv.url


def _complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _cached(url: str, prompt: list[int]) -> int:
    return _complete(url, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _hits(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:prefix_cache_hits_total")


def _tokens(start: int, n: int) -> list[int]:
    return [1000 + (start + i) % 20_000 for i in range(n)]


@pytest.fixture
def sub():
    ctx = zmq.Context()
    socks = []

    def connect(port: int):
        s = ctx.socket(zmq.SUB)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.setsockopt(zmq.SUBSCRIBE, b"")
        socks.append(s)
        return s

    yield ctx, connect
    for s in socks:
        s.close(linger=0)
    ctx.term()


def test_router_predicts_hits_from_events(sub) -> None:
    ctx, connect = sub
    port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "block_size": BLOCK}  # fmt: skip
    with _serve("--kv-events-config", json.dumps(config), "--max-num-seqs", "2") as url:
        events = connect(port)
        index = BlockIndex()
        time.sleep(0.5)
        system = _tokens(0, 3 * BLOCK)  # a shared "system prompt" of 3 blocks
        first = system + _tokens(500, 20)
        _complete(url, first)
        _complete(url, _tokens(900, 2 * BLOCK + 5))
        receive(events, index)
        assert index.block_size == BLOCK
        new = [
            system + _tokens(700, 10),  # 3 blocks
            system[: 2 * BLOCK] + _tokens(800, 9),  # 2 blocks
            _tokens(900, 2 * BLOCK) + _tokens(100, 4),  # the other prompt's 2 blocks
            _tokens(5000, 40),  # nothing
            first[: 4 * BLOCK],  # all 64 cached: 63 reused (the last token is computed)
        ]
        hits_before = _hits(url)
        predicted, reported = [], []
        for prompt in new:
            predicted.append(index.predict_hit(prompt))
            reported.append(_cached(url, prompt))
            receive(events, index, quiet_s=0.3)
        assert reported == predicted == [48, 32, 32, 0, 63]
        assert _hits(url) == hits_before + sum(predicted)

        # a late subscriber replays what it missed and holds the same index
        late = BlockIndex()
        for seq, payload in replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0):
            late.apply(seq, payload)
        assert late.blocks == index.blocks and late.seqs == index.seqs == list(
            range(len(late.seqs))
        )

        # distinct prompts until the first prompt's blocks are evicted: BlockRemoved, no hit
        assert index.predict_hit(first) == 4 * BLOCK and not index.removed
        for i in range(80):
            _complete(url, _tokens(30_000 + 100 * i, BLOCK + 1))
            receive(events, index, quiet_s=0.2)
            if index.predict_hit(first) == 0:
                break
        else:
            raise AssertionError("the first prompt was never evicted")
        assert index.removed
        assert _cached(url, first) == 0


def test_replicas_publish_with_their_rank(sub) -> None:
    _, connect = sub
    port = free_port()
    while True:  # the two replicas publish on port and port + 1
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    with _serve("--kv-events-config", json.dumps(config), "-dp", "2", "--max-num-seqs", "1") as url:
        socks = [connect(port), connect(port + 1)]
        time.sleep(0.5)
        prompt = _tokens(0, 2 * BLOCK + 3)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        replica = int(r.headers["x-specdec-replica"])
        assert socks[replica].poll(10_000), "no events from the replica that served"
        _, seq, payload = socks[replica].recv_multipart()
        _, batch, rank = decode(payload)
        assert rank == replica and int.from_bytes(seq, "big") == 0
        assert batch[0][0] == "BlockStored" and batch[0][3] == prompt[: 2 * BLOCK]
        assert not socks[1 - replica].poll(500)
