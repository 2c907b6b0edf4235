"""The all-reduce of one host through a shared /dev/shm file (the DeepSpeed / vLLM-CPU
pattern), run by the native ``_C.ShmReducer`` (kernels/csrc/allreduce.cpp)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from specdec.distributed.faults import TIMEOUT_S, TPError, first_line

SHM_CAP = 1 << 20  # float32 elements per rank and buffer (4 MiB); larger tensors go in rounds
_SHM_HEADER = 4096  # one 64-byte line of flags per rank


class ShmAllReduce:
    """Each rank writes its tensor into its slot and bumps its sequence flag, waits for every
    flag, then sums the slots in rank order, so every rank gets the same bits, batch after
    batch. The same native object serves the fused layer stack (``native``) and the Python
    layers, so they share one round counter. ``watch`` raises ``TPError`` when a peer is known
    to be gone (the wait then ends early with its message)."""

    def __init__(self, path: str, rank: int, size: int, watch: Callable[[], None]) -> None:
        from specdec.kernels import native_module

        nbytes = _SHM_HEADER + 2 * size * SHM_CAP * 4
        self._mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
        flags = torch.from_numpy(np.frombuffer(self._mm, np.int64, size * 8).reshape(size, 8))
        data = np.frombuffer(self._mm, np.float32, 2 * size * SHM_CAP, _SHM_HEADER)
        data = torch.from_numpy(data.reshape(2, size, SHM_CAP))

        def reason() -> str | None:  # NOTE: the native wait calls it; it must not raise
            try:
                watch()
            except TPError as e:
                return str(e)
            return None

        self.native = native_module().ShmReducer(flags, data, rank, size, reason, TIMEOUT_S)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H] summed
        try:
            return self.native.reduce(t)
        except RuntimeError as e:
            raise TPError(first_line(e)) from None


def make_shm_file(size: int) -> str | None:
    """A zeroed /dev/shm file for ``ShmAllReduce`` (None where there is none, where the native
    kernels are not built, or SPECDEC_TP_SHM=0: gloo alone)."""
    from specdec.kernels import native_available

    if os.environ.get("SPECDEC_TP_SHM", "1") == "0" or not os.path.isdir("/dev/shm"):
        return None
    if not native_available():
        return None
    path = f"/dev/shm/specdec-tp-{os.getpid()}-{os.urandom(4).hex()}"
    with open(path, "wb") as f:
        f.truncate(_SHM_HEADER + 2 * size * SHM_CAP * 4)
    return path
