"""A router's side of KV events, written from the documented format alone (README: KV events
for external routers), independent of specdec's own code: the block hash recipe, the decoding of
vLLM's batches and a block index that predicts prefix-cache hits."""

from __future__ import annotations

import hashlib
import struct
import time

import msgpack


def router_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The README's recipe: h[i] = sha256(h[i-1] as 8 big-endian bytes + the block's tokens as
    uint32 little-endian), first 8 bytes big-endian; h[-1] = 0."""
    out, parent = [], 0
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        data = struct.pack(">Q", parent) + struct.pack(f"<{len(block)}I", *block)
        parent = struct.unpack(">Q", hashlib.sha256(data).digest()[:8])[0]
        out.append(parent)
    return out


def decode(payload: bytes) -> tuple[float, list[list], int | None]:
    """vLLM's KVEventBatch: ``[ts, events, data_parallel_rank]``."""
    ts, events, *rest = msgpack.unpackb(payload, raw=False)
    return ts, events, rest[0] if rest else None


class BlockIndex:
    """What a prefix-aware router keeps per replica: the set of block hashes it holds."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.block_size: int | None = None
        self.seqs: list[int] = []
        self.num_cleared = 0
        self.removed: list[int] = []
        self.stored_token_ids: list[int] = []

    def apply(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        for event in decode(payload)[1]:
            tag = event[0]
            if tag == "BlockStored":
                _, hashes, parent, token_ids, block_size, _lora_id, medium = event
                assert medium == "GPU" and len(token_ids) == len(hashes) * block_size
                assert parent is None or parent in self.blocks, "a stored chain's parent is held"
                self.block_size = block_size
                self.blocks.update(hashes)
                self.stored_token_ids.extend(token_ids)
            elif tag == "BlockRemoved":
                self.removed.extend(event[1])
                self.blocks.difference_update(event[1])
            elif tag == "AllBlocksCleared":
                self.blocks.clear()
                self.num_cleared += 1
            else:
                raise AssertionError(f"unknown event {tag!r}")

    def predict_hit(self, token_ids: list[int]) -> int:
        """Prompt tokens a replica would reuse: its longest chain of held blocks (the last
        prompt token is always computed)."""
        if self.block_size is None:
            return 0
        n = 0
        for h in router_hashes(token_ids, self.block_size):
            if h not in self.blocks:
                break
            n += 1
        return min(n * self.block_size, len(token_ids) - 1)


def receive(sub, index: BlockIndex, quiet_s: float = 0.5, timeout_s: float = 30.0) -> None:
    """Apply batches from a SUB socket until none came for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sub.poll(int(quiet_s * 1000)):
            return
        _topic, seq, payload = sub.recv_multipart()
        index.apply(int.from_bytes(seq, "big"), payload)
    raise AssertionError("KV events never went quiet")


def replay(ctx, endpoint: str, start: int, timeout_s: float = 10.0) -> list[tuple[int, bytes]]:
    """Ask a replay endpoint (vLLM's ROUTER) for the batches from ``start`` on."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert sock.poll(int(timeout_s * 1000)), "no replay answer"
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
