"""KV-cache events in vLLM's wire format, published over ZMQ for prefix-aware routers.

The pool records which logical blocks it offers (``specdec.kv_cache.block_events``); once per
engine step the engine hands those records to ``KVEventPublisher.publish``, which only appends
them to a bounded queue (the oldest batch is dropped, and counted, when it is full): the step
never waits on a socket. A thread encodes each batch and sends it as vLLM's ``ZmqEventPublisher``
does:

- PUB socket, multipart ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0,
  ``payload`` msgpack of ``[ts, events, data_parallel_rank]`` (vLLM's ``KVEventBatch``,
  msgspec ``array_like``), each event a tagged array:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.
- ROUTER socket (``replay_endpoint``): a request whose last frame is an 8-byte big-endian start
  sequence number is answered with ``[b"", seq, payload]`` for each batch still buffered from it
  on, then ``[b"", -1 (8 bytes, signed), b""]``.

``medium`` is ``"GPU"``: in vLLM's vocabulary the tier attention reads from (routers such as
Dynamo's rank other tiers as offloaded copies), whatever the device. The endpoints' ports are
offset by the data-parallel rank, as vLLM does, so replicas on one host do not collide.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from specdec.config import KVEventsConfig
from specdec.kv_cache.block_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored

logger = logging.getLogger("specdec.engine.kv_events")

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # the publisher thread's wait for a batch (and between replay polls)


def encode_event(event: BlockEvent, block_size: int) -> list[Any]:
    """One record as vLLM's tagged array."""
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                block_size, None, MEDIUM]  # fmt: skip
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, MEDIUM]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(
    ts: float, events: list[BlockEvent], block_size: int, data_parallel_rank: int
) -> bytes:
    """vLLM's ``KVEventBatch`` as msgpack: ``[ts, [event, ...], data_parallel_rank]``."""
    import msgpack

    body = [ts, [encode_event(e, block_size) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's port offset: ``tcp://*:5557`` is ``tcp://*:5558`` for rank 1; an ``inproc://``
    or ``ipc://`` address gets a ``_dp1`` suffix."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"KV events endpoint {endpoint!r} has no port to offset")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard / IPv6-any / ipc / inproc address, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The PUB (and replay ROUTER) sockets and the thread that feeds them; ``publish`` never
    blocks. The sockets are made here, so a bad or busy address fails at engine start."""

    def __init__(
        self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0
    ) -> None:
        import zmq

        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode("utf-8")
        self._queue: deque[tuple[float, list[BlockEvent]]] = deque()
        self._max_queue = config.max_queue_size
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._cond = threading.Condition()
        self._running = True
        self.num_published = 0
        self.num_dropped = 0  # batches dropped from a full queue
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            assert self.endpoint is not None
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            raise RuntimeError(f"kv_events_config: cannot open {self.endpoint}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV events: publishing on %s%s (data-parallel rank %d, %d-token blocks)",
            self.endpoint,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
            data_parallel_rank, block_size,
        )  # fmt: skip

    def publish(self, events: list[BlockEvent]) -> None:
        """Queue one batch (nothing when empty); drop the oldest when the queue is full."""
        if not events or not self._running:
            return
        with self._cond:
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.num_dropped += 1
                if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                    logger.warning(
                        "KV events: queue full, %d batches dropped so far", self.num_dropped
                    )
            self._queue.append((time.time(), events))
            self._cond.notify()

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        if not self._running:
            return
        with self._cond:
            self._running = False
            self._cond.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # ---- the publisher thread ---------------------------------------------------------------
    def _run(self) -> None:
        seq = 0
        while True:
            with self._cond:
                if not self._queue and self._running:
                    self._cond.wait(_POLL_S)
                item = self._queue.popleft() if self._queue else None
                stop = not self._running and not self._queue
            if item is not None:
                ts, events = item
                try:
                    payload = encode_batch(ts, events, self.block_size, self.data_parallel_rank)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    self.num_published += 1
                    seq += 1
                except Exception:
                    logger.exception("KV events: a batch could not be sent")
            if self._replay is not None:
                self._serve_replays()
            if stop and item is None:
                return

    def _serve_replays(self) -> None:
        """Answer every replay request waiting (vLLM's: identity, empty frame, start seq)."""
        import zmq

        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                logger.warning("KV events: malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        self._replay.send_multipart(
                            (identity, b"", seq.to_bytes(8, "big"), payload)
                        )
                self._replay.send_multipart((identity, b"", END_SEQ, b""))
            except zmq.ZMQError as e:
                logger.warning("KV events: replay to a client failed: %s", e)
