"""How many KV slots the pool reserves.

A slot holds one sequence of up to ``max_model_len`` positions. Pages are committed only as
sequences write them and a freed slot gives back all but its cached prefix
(``specdec.kv_cache.memory``), so a slot costs address space until it is used. The plan still
counts every slot at its full size, the most it can commit: a pool whose every slot filled to
``max_model_len`` must fit in the RAM it was sized against.
"""

from __future__ import annotations

import logging

from specdec.errors import ConfigError
from specdec.kv_cache.pool import KVCache

logger = logging.getLogger("specdec.kv_cache")

# Without kv_cache_memory: the whole pool (running slots first, then prefix-cache slots, each at
# its full size) fits in this fraction of the RAM available at start-up (the weights are loaded
# by then), with at most DEFAULT_PREFIX_CACHE_SLOTS cache slots.
DEFAULT_KV_RAM_FRACTION = 0.5
DEFAULT_PREFIX_CACHE_SLOTS = 32
# With kv_cache_memory: the prefix-cache slots the rest of the budget holds, up to this many.
MAX_PREFIX_CACHE_SLOTS = 256


def available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def plan_kv_slots(
    max_model_len: int,
    bytes_per_token: int,
    max_num_seqs: int,
    enable_prefix_caching: bool,
    kv_cache_memory: float | None = None,
    available_bytes: int | None = None,
) -> tuple[int, int]:
    """Slots of ``max_model_len`` positions: (for running sequences, extra for the prefix cache).

    ``kv_cache_memory`` (bytes, or a fraction <= 1 of the available RAM) is the pool's size:
    running sequences get ``max_num_seqs`` slots, fewer if it holds fewer (none is an error);
    prefix caching adds what the rest holds, up to MAX_PREFIX_CACHE_SLOTS. Without it the pool
    gets DEFAULT_KV_RAM_FRACTION of the available RAM: ``max_num_seqs`` running slots, fewer (at
    least one, with a warning) when they would not fit, then up to DEFAULT_PREFIX_CACHE_SLOTS.
    ``available_bytes`` defaults to what psutil reports now.
    """
    per_slot = max_model_len * bytes_per_token
    if kv_cache_memory is None:
        ram = available_ram() if available_bytes is None else available_bytes
        slots = int(DEFAULT_KV_RAM_FRACTION * ram // per_slot)
        num_running = max(1, min(slots, max_num_seqs))
        if num_running < max_num_seqs:
            logger.warning(
                "KV cache: %d running slots instead of max_num_seqs %d: %d sequences of "
                "max_model_len %d (%.1f MiB each) are all that fit in %.0f%% of the %.1f GiB "
                "RAM available; lower max_model_len, or set kv_cache_memory to choose",
                num_running, max_num_seqs, num_running, max_model_len, per_slot / 2**20,
                100 * DEFAULT_KV_RAM_FRACTION, ram / 2**30,
            )  # fmt: skip
        num_cache = min(DEFAULT_PREFIX_CACHE_SLOTS, max(0, slots - num_running))
        return num_running, num_cache if enable_prefix_caching else 0
    budget = kv_cache_memory
    if budget <= 1:
        budget *= available_ram() if available_bytes is None else available_bytes
    slots = int(budget // per_slot)
    if slots < 1:
        raise ConfigError(
            f"kv_cache_memory {int(budget)} bytes holds no sequence of max_model_len "
            f"{max_model_len} ({per_slot} bytes); raise it or lower max_model_len"
        )
    num_running = min(slots, max_num_seqs)
    num_cache = min(slots - num_running, MAX_PREFIX_CACHE_SLOTS)
    return num_running, num_cache if enable_prefix_caching else 0


def describe_pool(kv: KVCache, num_running_slots: int) -> str:
    """One line on what the pool reserved: slots, positions, element type, bytes."""
    num_cache = kv.num_slots - num_running_slots
    dtype = str(kv.k.dtype).removeprefix("torch.")
    return (
        f"{kv.num_slots} slots ({num_running_slots} running, {num_cache} prefix cache) x "
        f"{kv.max_len} positions, {dtype}, {kv.reserved_bytes / 2**30:.2f} GiB reserved "
        f"({kv.reserved_bytes // max(1, kv.num_slots * kv.max_len)} bytes per token); pages "
        "are committed as sequences write them and given back when their slot is freed"
    )
