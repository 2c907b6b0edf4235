"""The communicator a tensor-parallel model sees: its rank, the group's size, an all-reduce in
rank order and the gather of each rank's vocabulary slice of the logits.

The model calls two more methods, ``send_forward`` and ``send_logits``, before each forward and
each logits computation; here they do nothing. Rank 0's driver (``specdec.worker.tp``) overrides
them to hand the same inputs to the other ranks, which then run the same forward on their shards
(the lockstep is at the model forward, so drafters that call the target work at any TP).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from specdec.distributed.faults import TIMEOUT_S, TPError, first_line
from specdec.distributed.shm import ShmAllReduce

if TYPE_CHECKING:
    from specdec.kv_cache.pool import KVCache


class TPGroup:
    """One rank's view of the group: ``all_reduce`` in a fixed order over the shared-memory
    reducer (``shm_path``) or the gloo process group ``pg``. ``watch`` raises ``TPError`` when
    a peer is known to be gone (rank 0 watches its workers)."""

    def __init__(
        self,
        rank: int,
        size: int,
        pg: Any,
        shm_path: str | None = None,
        watch: Callable[[], None] | None = None,
    ) -> None:
        self.rank, self.size, self._pg = rank, size, pg
        self._shm = (
            ShmAllReduce(shm_path, rank, size, watch or (lambda: None)) if shm_path else None
        )

    def join(self, pg: Any) -> None:
        """The gloo process group, once formed (a rank maps the shared-memory file first)."""
        self._pg = pg

    @property
    def native_reducer(self) -> Any:
        """The native shared-memory all-reduce the fused layer stack calls (None: gloo only)."""
        return self._shm.native if self._shm is not None else None

    def error(self, e: BaseException) -> TPError:
        """``e`` (a failed collective) as the one-line executor fault."""
        return e if isinstance(e, TPError) else TPError(first_line(e))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:  # [T, H] summed over ranks
        """Sum in rank order (rank 0 + rank 1 + ...), whatever the batch: rows stay
        batch-invariant at a given TP size. NOTE: gloo's ring all-reduce adds in an order that
        depends on an element's chunk (so on the batch size) above 2 ranks; at 2 ranks a + b
        is commutative, so its all-reduce is already exact."""
        t = t.contiguous()
        if self._shm is not None and t.dtype == torch.float32:
            return self._shm(t)
        try:
            if self.size == 2:
                self._pg.allreduce([t]).wait(timedelta(seconds=TIMEOUT_S))
                return t
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self._pg.allgather([parts], [t]).wait(timedelta(seconds=TIMEOUT_S))
        except RuntimeError as e:
            raise TPError(
                f"tensor-parallel all-reduce failed (a rank died or stopped answering): "
                f"{first_line(e)}"
            ) from None
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def gather_logits(
        self,
        part: torch.Tensor,  # [R, hi - lo] float32: this rank's vocabulary rows' logits
        vocab_range: tuple[int, int],
        vocab_rows: int,
    ) -> torch.Tensor:  # [R, vocab_rows] float32 on every rank
        """Every rank's slice side by side: an all-reduce of the slices placed among zeros
        (adding zeros changes no bit)."""
        lo, hi = vocab_range
        full = torch.zeros(part.shape[0], vocab_rows, device=part.device)
        full[:, lo:hi] = part
        return self.all_reduce(full)

    def send_forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: Any,  # specdec.model.llama.SeqBatch
        kv: KVCache,
        capture: tuple[int, ...],
        num_layers: int | None,
    ) -> None:
        """Called by the model before each forward: rank 0's driver hands the inputs to the
        other ranks; any other rank has nothing to send."""

    def send_logits(self, hidden: torch.Tensor) -> None:  # [R, H]
        """Called by the model before each logits computation (see ``send_forward``)."""

    def send_key_transform(self) -> None:
        """Called by the model before it measures its 8-bit cache's key transform: rank 0's
        driver has every rank measure its own heads' (the same forward, in lockstep)."""
