"""The KV pool: one fixed slot of ``max_len`` positions per running sequence.

A sequence's cache length lives with its request (``num_computed_tokens``); rolling back
rejected drafts is moving that length back, with no copy: the stale entries are simply
overwritten by the next forward.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        # NOTE: torch.empty does not touch the pages: memory is committed as slots fill.
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, S, Hkv, max_len, D]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, S, Hkv, max_len, D]
        self.num_slots = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV pool exhausted")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"double free or bad KV slot {slot}")
        self._free.append(slot)
