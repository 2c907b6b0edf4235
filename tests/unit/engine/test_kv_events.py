"""KV-cache events (vLLM's format over ZMQ): the block hash recipe, the pool's records, the
publisher's wire layout, replay and queue, the config, and an engine whose events let a router
predict its prefix-cache hits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import ConfigError, EngineArgs, KVEventsConfig
from specdec.kv_cache.block_events import (
    AllBlocksCleared,
    BlockLog,
    BlockRemoved,
    BlockStored,
    block_hashes,
)
from specdec.kv_cache.pool import KVCache
from tests.fixtures.kv_events_client import BlockIndex, decode, receive, replay, router_hashes

zmq = pytest.importorskip("zmq")
REPO = Path(__file__).resolve().parents[3]
B = 4  # block size in the pool tests


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the hash recipe and the block log ------------------------------------------------------------
def test_hash_recipe_matches_an_independent_implementation() -> None:
    tokens = [
        int(t) for t in torch.randint(0, 150_000, (70,), generator=torch.Generator().manual_seed(0))
    ]
    for size in (1, 4, 16, 64):
        assert block_hashes(tokens, size) == router_hashes(tokens, size)
    assert len(block_hashes(tokens, 16)) == 4  # whole blocks only
    # chained: a block's hash depends on everything before it
    assert (
        block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)[1]
    )
    assert all(0 <= h < 2**64 for h in block_hashes(tokens, 1))


def test_block_log_counts_holders_and_keeps_chains() -> None:
    log = BlockLog(B)
    a = list(range(10))  # 2 whole blocks
    log.update(0, a, salted=False)
    (stored,) = log.drain()
    assert stored == BlockStored(block_hashes(a, B), None, a[:8])
    log.update(1, a[:4] + [99] * 8, salted=False)  # shares the first block: 2 new ones
    (stored,) = log.drain()
    h = block_hashes(a[:4] + [99] * 8, B)
    assert stored == BlockStored(h[1:], h[0], [99] * 8)
    log.update(0, [], salted=False)  # slot 0 goes: its second block only (slot 1 holds the first)
    assert log.drain() == [BlockRemoved(block_hashes(a, B)[1:])]
    log.update(2, a, salted=True)  # salted: nothing leaves the engine
    assert log.drain() == [] and log.num_blocks == 3
    log.clear({1: (a[:4] + [99] * 8, False)})
    assert log.drain() == [AllBlocksCleared(), BlockStored(h, None, a[:4] + [99] * 8)]


def _pool(num_slots: int = 3) -> KVCache:
    kv = KVCache(1, num_slots, 1, 32, 4, torch.float32, torch.device("cpu"), True)
    kv.block_log = BlockLog(B)
    return kv


def test_pool_records_store_evict_reset() -> None:
    kv = _pool(num_slots=2)
    a, b, c = list(range(1, 13)), list(range(20, 30)), list(range(40, 50))
    slot, _ = kv.allocate_for_prompt(a)
    kv.free(slot, a)
    assert kv.block_log.drain() == [BlockStored(block_hashes(a, B), None, a)]
    slot_b, _ = kv.allocate_for_prompt(b)  # the empty slot: nothing evicted
    kv.free(slot_b, b)
    assert kv.block_log.drain() == [BlockStored(block_hashes(b, B), None, b[:8])]
    slot_c, reused = kv.allocate_for_prompt(c)  # evicts the least recently used: a
    assert reused == 0 and slot_c == slot
    assert kv.block_log.drain() == [BlockRemoved(block_hashes(a, B))]
    slot_a, reused = kv.allocate_for_prompt(b[:8] + [7] * 5)  # reuses b's 8 tokens in place
    assert reused == 8
    # while it runs, b's blocks serve no one else; its own end offers them again
    assert kv.block_log.drain() == [BlockRemoved(block_hashes(b, B))]
    kv.free(slot_a, b[:8] + [7] * 5)
    kv.free(slot_c, c[:4], cache_salt=5)  # salted: never recorded
    hb = block_hashes(b[:8] + [7] * 5, B)
    assert kv.block_log.drain() == [BlockStored(hb, None, b[:8] + [7] * 4)]
    kv.reset_prefix_cache()
    assert kv.block_log.drain() == [AllBlocksCleared()]


# ---- the wire ---------------------------------------------------------------------------------------
def test_offset_endpoint_as_vllm() -> None:
    from specdec.engine.kv_events import offset_endpoint

    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://10.0.0.1:6000", 1) == "tcp://10.0.0.1:6001"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint(None, 3) is None


def test_batch_layout_is_vllms() -> None:
    from specdec.engine.kv_events import encode_batch

    events = [BlockStored([11, 12], 10, list(range(8))), BlockRemoved([9]), AllBlocksCleared()]
    ts, decoded, rank = decode(encode_batch(1.5, events, 4, 3))
    assert (ts, rank) == (1.5, 3)
    assert decoded == [
        ["BlockStored", [11, 12], 10, list(range(8)), 4, None, "GPU"],
        ["BlockRemoved", [9], "GPU"],
        ["AllBlocksCleared"],
    ]
    big = msgpack.unpackb(encode_batch(0.0, [BlockRemoved([2**64 - 1])], 4, 0))
    assert big[1][0][1] == [2**64 - 1]  # unsigned 64-bit, as vLLM's int block hashes


def _publisher(**kw):
    from specdec.engine.kv_events import KVEventPublisher

    port, replay_port = _port(), _port()
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}", topic="kv", **kw,
    )  # fmt: skip
    return KVEventPublisher(config, block_size=4, data_parallel_rank=0), port, replay_port


def test_publisher_sends_in_order_and_replays() -> None:
    pub, port, replay_port = _publisher(buffer_steps=3)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)  # NOTE: a PUB socket drops what it sends before the SUB joined
        for i in range(5):
            pub.publish([BlockRemoved([i])])
        pub.publish([])  # an empty step sends nothing
        got = []
        for _ in range(5):
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), decode(payload)[1]))
        assert got == [(i, [["BlockRemoved", [i], "GPU"]]) for i in range(5)]
        assert not sub.poll(300)
        # the replay buffer holds the last 3 batches: asked from 1, it answers 2, 3, 4
        missed = replay(ctx, f"tcp://127.0.0.1:{replay_port}", 1)
        assert [(s, decode(p)[1]) for s, p in missed] == got[2:]
        assert replay(ctx, f"tcp://127.0.0.1:{replay_port}", 9) == []
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.shutdown()


def test_full_queue_drops_the_oldest_and_counts() -> None:
    pub, port, _ = _publisher(max_queue_size=2)
    try:
        with pub._cond:  # NOTE: the publisher thread waits for this lock: the queue only grows
            for i in range(5):
                pub.publish([BlockRemoved([i])])
            assert [e[0].block_hashes for _, e in pub._queue] == [[3], [4]]
        assert pub.num_dropped == 3
        deadline = time.monotonic() + 5
        while pub.num_published < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.num_published == 2
    finally:
        pub.shutdown()


def test_busy_endpoint_fails_at_start() -> None:
    from specdec.engine.kv_events import KVEventPublisher

    pub, port, _ = _publisher()
    try:
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
        with pytest.raises(RuntimeError, match="kv_events_config: cannot open"):
            KVEventPublisher(config, block_size=4)
    finally:
        pub.shutdown()


# ---- the config -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, field",
    [
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
        ({"endpoint": "http://x:1"}, "endpoint"),
        ({"replay_endpoint": 5}, "replay_endpoint"),
        ({"buffer_steps": -1}, "buffer_steps"),
        ({"max_queue_size": 0}, "max_queue_size"),
        ({"block_size": 0}, "block_size"),
        ({"topic": 3}, "topic"),
        ({"enable_kv_cache_event": True}, "enable_kv_cache_event"),
        ('{"enable_kv_cache_events": tru', "not valid JSON"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_bad_config_names_the_field(value, field: str) -> None:
    with pytest.raises(ConfigError, match=field) as e:
        EngineArgs(kv_events_config=value).create_engine_config()
    assert "\n" not in str(e.value) and "kv_events_config" in str(e.value)


def test_config_spellings() -> None:
    on = EngineArgs(kv_events_config='{"enable_kv_cache_events": true}').create_engine_config()
    assert on.kv_events_config.active and on.kv_events_config.publisher == "zmq"
    assert on.kv_events_config.endpoint == "tcp://*:5557" and on.kv_events_config.block_size == 16
    off = EngineArgs(kv_events_config={}).create_engine_config()
    assert off.kv_events_config.publisher == "null" and not off.kv_events_config.active
    null = KVEventsConfig.from_any({"enable_kv_cache_events": True, "publisher": "null"})
    assert not null.active
    assert EngineArgs().create_engine_config().kv_events_config is None


def test_nothing_imported_without_the_flag(tiny_llama) -> None:
    code = (
        "import sys\n"
        "from specdec import LLM\n"
        f"llm = LLM({str(tiny_llama)!r}, max_model_len=64)\n"
        "llm.generate(['hello'])\n"
        "assert llm.engine.kv_events is None and llm.engine.kv.block_log is None\n"
        "bad = [m for m in ('zmq', 'msgpack', 'specdec.engine.kv_events') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=180)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]


def test_vllm_gauge_names_on_metrics() -> None:
    from specdec.metrics import EngineMetrics

    text = EngineMetrics("m").render().decode()
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert f"# TYPE vllm:{name} gauge" in text and f"# TYPE specdec:{name} gauge" in text


# ---- an engine's events predict its prefix-cache hits -------------------------------------------
def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=1)


def test_engine_events_predict_prefix_hits(tiny_llama) -> None:
    port, replay_port = _port(), _port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "block_size": 8}  # fmt: skip
    llm = LLM(str(tiny_llama), max_model_len=128, max_num_seqs=2, kv_events_config=events)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    index = BlockIndex()
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)
        shared = [5 + i % 40 for i in range(24)]  # 3 blocks of 8
        seen = [shared + [60 + i for i in range(11)], [70 + i for i in range(20)]]
        for prompt in seen:  # one at a time: each leaves its prompt cached
            llm.generate([{"prompt_token_ids": prompt}], _greedy())
        receive(sub, index)
        assert index.block_size == 8 and index.blocks
        new = [
            shared + [90] * 9,  # the 3 shared blocks
            shared[:16] + [91] * 9,  # 2 of them
            seen[1][:16] + [92] * 3,  # the other prompt's first 2 blocks
            [93] * 20,  # nothing
            seen[0][:16],  # all 16 tokens cached: the last one is computed all the same
        ]
        predicted = []
        for prompt in new:  # the router's index follows every request, as it would in service
            predicted.append(index.predict_hit(prompt))
            out = llm.generate([{"prompt_token_ids": prompt}], _greedy())[0]
            assert out.num_cached_tokens == predicted[-1], (prompt, predicted)
            receive(sub, index, quiet_s=0.3)
        assert predicted == [24, 16, 16, 0, 15]
        # a salted request's tokens never leave the engine, and nothing it caches is offered
        salted = [140 + i % 7 for i in range(30)]
        llm.generate([{"prompt_token_ids": salted, "cache_salt": "tenant-a"}], _greedy())
        again = {"prompt_token_ids": salted, "cache_salt": "tenant-a"}
        assert llm.generate([again], _greedy())[0].num_cached_tokens == 29  # cached all the same
        receive(sub, index, quiet_s=0.3)
        assert not set(salted) & set(index.stored_token_ids)
        assert index.predict_hit(salted) == 0
        # a replay from 0 rebuilds the same index
        rebuilt = BlockIndex()
        for seq, payload in replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0):
            rebuilt.apply(seq, payload)
        assert rebuilt.blocks == index.blocks and rebuilt.seqs == index.seqs
        assert index.seqs == list(range(len(index.seqs)))
        llm.engine.reset_prefix_cache()
        receive(sub, index, quiet_s=0.3)
        assert index.num_cleared == 1 and not index.blocks
    finally:
        sub.close(linger=0)
        ctx.term()
        llm.engine.shutdown()
