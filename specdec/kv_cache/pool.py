"""The KV pool: one fixed slot of ``max_len`` positions per running sequence.

A sequence's cache length lives with its request (``num_computed_tokens``); rolling back
rejected drafts is moving that length back, with no copy: the stale entries are simply
overwritten by the next forward.

Automatic prefix caching (vLLM's ``enable_prefix_caching``): a freed slot remembers the tokens
whose KV it still holds (the first ``num_computed_tokens`` of its last request, never stale
entries past them). A new request takes the free slot that shares the longest prefix with its
prompt and starts computing after that prefix. When that would overwrite more of the slot's cached
tokens than evicting another free slot loses, the prefix is copied into that slot instead. Slots
are evicted empty first, then least recently used.

Shared prefixes (``share_block`` > 0: the native fused layers): a new request whose prompt
begins with another slot's tokens (a free slot's cached prefix, or a running request's computed
prompt) takes a slot of its own but reads the whole ``share_block``-position blocks of that
prefix where they are (``prefix_of``), and only the rest is copied. Requests on one system prompt
or one document then hold it once, and the native attention reads each of its blocks once a step
for all of them (ops.cpp ``attention_seqs``). A slot others read is kept (evicted last); when it
must go, or be overwritten below what they read, each reader first gets its own copy. The bytes
read are the same either way, so sharing changes no output.

KV events (``block_log``, set when ``kv_events_config`` enables them): every change to what a
slot offers later prompts (its cached or published tokens and their salt) is recorded as logical
blocks stored and removed (``specdec.kv_cache.block_events``); the engine publishes them.

Key layout: native CPU kernels read keys blocked and transposed (``key_block`` keys per block,
``k [layers, slots, Hkv, ceil(max_len / key_block), D, key_block]``: a vector load then holds one
element of 16 consecutive keys, so a score needs no horizontal sum); the torch path keeps the
usual ``[layers, slots, Hkv, max_len, D]`` (``key_block = 0``). Values are always row-major.

Memory follows use: the pool reserves address space (see ``specdec.kv_cache.memory``), a page
is committed when a sequence first writes it, and a freed slot gives back every page past the
prefix it keeps cached (all of them without prefix caching); evicting or forgetting a cached
prefix gives back its pages too. Resident KV is then what running sequences wrote plus the cached
prefixes, whatever the pool's size.

Huge pages: each slot's layers lie together in memory (``k`` and ``v`` are views of ``[S, L, ...]``
storage). Once a sequence reaches ``HUGE_PAGES_AFTER`` positions, and again every
``HUGE_PAGES_AFTER`` positions after (``grow``, called before each forward), each whole 2 MiB
chunk of its slot that it fills at least half of is advised to transparent huge pages, and
collapsed into one while the model is idle (memory.py: collapsing costs ~5 ms a chunk, so never
in a step); its attention then reads keys and values without a page walk every 4 KiB (a step at
2,000-3,800 cached: up to ~1.06x, BENCHMARKS.md). A chunk so backed commits at most twice what
the sequence wrote in it, and only written bytes are copied; shorter sequences keep base pages,
and a freed slot goes back to them. ``huge_pages = False`` turns it off for a pool.

Element type: ``kv_cache_dtype`` (float16 by default on the native kernels: it halves the memory
and what attention reads; entries are rounded once, when written), else the model's dtype.

``int8`` (native kernels; llama.cpp's ``-ctk q8_0 -ctv q8_0``): 8-bit entries with one float32
scale per position and head (its largest magnitude / 127, entries rounded half to even), about
half a float16 cache's bytes. Keys and values alike are stored in blocks of ``key_block``
positions, each ``[key_block]`` float32 scales then the int8 entries (keys transposed as above,
values row-major): ``k`` and ``v`` are ``int8 [layers, slots, Hkv, ceil(max_len / key_block),
4 * key_block + key_block * D]`` (kernels.h ``kQ8Header``). Attention reads the int8 entries
as they are and applies the scales once: to each score (the key's) and to each softmax weight
(the value's). ``keys`` / ``values`` give the products, float(int8) * scale.

``key_shift`` and ``key_scale`` (``[layers, Hkv, D]`` float32, int8 only; the model measures
them, llama.py ``LlamaModel.measure_key_transform``): each key is stored as (key - shift) * scale,
and attention multiplies each query by ``query_scale`` = 1 / scale first. Each query's scores all
move by one constant, which the softmax cancels, and q . k is the same product channel by
channel; what changes is the rounding. The keys' common offset (a few channels far from zero at
every position) no longer sets each position's scale, and channels where queries are large and
keys small (or the reverse) are evened out between the two 8-bit operands. ``keys`` gives the
keys as stored, as attention reads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.kv_cache.block_events import BlockLog
from specdec.kv_cache.memory import PagedBuffer, note_forward

# Positions after which, and between passes, a sequence's slot is backed by huge pages (module
# docstring).
HUGE_PAGES_AFTER = 1024


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
        enable_prefix_caching: bool = False,
        key_block: int = 0,
        share_block: int = 0,
        key_shift: torch.Tensor | None = None,  # [layers, Hkv, D] float32 (module docstring)
        key_scale: torch.Tensor | None = None,  # [layers, Hkv, D] float32 (module docstring)
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.key_block = key_block
        self.head_dim = head_dim
        # int8: both caches in blocks of key_block positions (see the module docstring)
        self.quantized = dtype == torch.int8
        if self.quantized and not key_block:
            raise ValueError("an int8 KV cache needs the native kernels' blocked layout")
        for name, t in (("key_shift", key_shift), ("key_scale", key_scale)):
            if t is not None and (
                not self.quantized or tuple(t.shape) != (num_layers, num_kv_heads, head_dim)
            ):
                raise ValueError(f"{name}: only an int8 cache takes one, [layers, Hkv, head_dim]")
        self.key_shift = None if key_shift is None else key_shift.to(torch.float32)
        self.key_scale = None if key_scale is None else key_scale.to(torch.float32)
        self.query_scale = None if key_scale is None else 1.0 / self.key_scale
        k_shape = v_shape = shape
        if key_block:
            num_blocks = -(-max_len // key_block)
            k_shape = (num_layers, num_slots, num_kv_heads, num_blocks, head_dim, key_block)
            if self.quantized:
                k_shape = v_shape = (*shape[:3], num_blocks, key_block * (4 + head_dim))
        self._k_buf = _paged(k_shape, dtype, device)
        self._v_buf = _paged(v_shape, dtype, device)
        self.k = _slots_together(self._k_buf, dtype, k_shape)  # see the module docstring
        self.v = _slots_together(self._v_buf, dtype, v_shape)  # [L, S, Hkv, max_len, D]
        self.num_slots = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))
        self.enable_prefix_caching = enable_prefix_caching
        # Per slot, the token ids whose KV it holds: a free slot's cached prefix, a running one's
        # published prompt (``publish``; 0 until then).
        self._cached_token_ids = np.zeros((num_slots, max_len), dtype=np.int64)  # [S, max_len]
        self._num_cached = np.zeros(num_slots, dtype=np.int64)  # [S]
        self._last_used = np.zeros(num_slots, dtype=np.int64)  # [S] LRU clock at the last free
        self._salt = np.zeros(num_slots, dtype=np.int64)  # [S] cache salt of the cached tokens
        # Shared prefixes (module docstring): per slot, the slot holding its first _base_len
        # positions (-1: none; never a slot with a base of its own). Positions per block: 0, off.
        self.share_block = share_block
        self._base = np.full(num_slots, -1, dtype=np.int64)  # [S]
        self._base_len = np.zeros(num_slots, dtype=np.int64)  # [S]
        self._clock = 0
        self.huge_pages = True  # long sequences' slots backed by huge pages (module docstring)
        self._huge_at = np.zeros(num_slots, dtype=np.int64)  # [S] positions at grow's last pass
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0
        # tensor parallelism: called as mirror(method, args) for every change to the cache's
        # contents not made by a forward, so other ranks' caches of their heads follow
        self.mirror: Callable[[str, tuple], None] | None = None
        # KV events (block_events.py): the logical blocks slots offer, recorded as they change
        self.block_log: BlockLog | None = None

    def store(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` / ``v`` ``[n, Hkv, D]`` at positions ``start .. start + n - 1`` (converted to
        the cache's dtype, rounding to nearest even as the native kernels do)."""
        n = k.shape[0]
        if self.quantized:
            self._store_q8(layer, slot, start, k, v)
            return
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        self.v[layer, slot, :, start : start + n] = v.transpose(0, 1)
        if not self.key_block:
            self.k[layer, slot, :, start : start + n] = k.transpose(0, 1)
            return
        pos = torch.arange(start, start + n, device=k.device)
        # advanced indices on dims 1 and 3 of [Hkv, blocks, D, block] put n first: [n, Hkv, D]
        self.k[layer, slot][:, pos // self.key_block, :, pos % self.key_block] = k

    def _q8_parts(self, t: torch.Tensor, keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 cache's ``[Hkv, blocks, bytes]`` as views: the scales ``[Hkv, blocks,
        key_block]`` float32 and the entries, ``[Hkv, blocks, D, key_block]`` for keys,
        ``[Hkv, blocks, key_block, D]`` for values."""
        hkv, blocks, _ = t.shape
        b, d = self.key_block, self.head_dim
        scales = t[..., : 4 * b].view(torch.float32)
        entries = t[..., 4 * b :].view(hkv, blocks, *((d, b) if keys else (b, d)))
        return scales, entries

    def _store_q8(
        self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        pos = torch.arange(start, start + k.shape[0], device=k.device)
        blk, lane = pos // self.key_block, pos % self.key_block
        k = k.to(torch.float32)
        if self.key_shift is not None:  # the same float operations as layer.cpp's
            k = k - self.key_shift[layer]
        if self.key_scale is not None:
            k = k * self.key_scale[layer]
        k_scale, k_q = quantize_q8(k)  # [n, Hkv], [n, Hkv, D]
        v_scale, v_q = quantize_q8(v)
        scales, entries = self._q8_parts(self.k[layer, slot], keys=True)
        scales[:, blk, lane] = k_scale.transpose(0, 1)
        entries[:, blk, :, lane] = k_q  # dims 1 and 3 indexed: n first, [n, Hkv, D]
        scales, entries = self._q8_parts(self.v[layer, slot], keys=False)
        scales[:, blk, lane] = v_scale.transpose(0, 1)
        entries[:, blk, lane] = v_q.transpose(0, 1)

    def _q8_values(self, t: torch.Tensor, keys: bool) -> torch.Tensor:
        scales, entries = self._q8_parts(t, keys)
        if keys:
            x = entries.float() * scales.unsqueeze(2)  # [Hkv, blocks, D, b]
            x = x.transpose(-1, -2)
        else:
            x = entries.float() * scales.unsqueeze(3)  # [Hkv, blocks, b, D]
        return x.reshape(x.shape[0], -1, self.head_dim)[:, : self.max_len]

    def keys(self, layer: int, slot: int) -> torch.Tensor:
        """One slot's keys in the usual layout, ``[Hkv, max_len, D]`` (a copy when blocked; an
        int8 cache's as the floats attention reads, shifted and scaled as stored)."""
        if self.quantized:
            return self._q8_values(self.k[layer, slot], keys=True)
        return standard_keys(self.k[layer, slot], self.max_len, self.key_block)

    def values(self, layer: int, slot: int) -> torch.Tensor:
        """One slot's values, ``[Hkv, max_len, D]`` (an int8 cache's as the floats attention
        reads)."""
        if self.quantized:
            return self._q8_values(self.v[layer, slot], keys=False)
        return self.v[layer, slot]

    def grow(self, slot: int, num_tokens: int) -> None:
        """Before a forward takes ``slot`` to ``num_tokens`` positions: from ``HUGE_PAGES_AFTER``
        on, and every ``HUGE_PAGES_AFTER`` more, the chunks it fills at least half of are backed by
        huge pages (module docstring). Each rank of a tensor-parallel model calls it for its own
        cache in its own forward."""
        note_forward()  # chunks are collapsed while no forward runs (memory.py)
        if num_tokens < self._huge_at[slot] + HUGE_PAGES_AFTER or not self.huge_pages:
            return
        self._huge_at[slot] = num_tokens
        nk, nv = self._entries(num_tokens)
        for buf, t, n in ((self._k_buf, self.k, nk), (self._v_buf, self.v, nv)):
            whole = _slot_ranges(t, slot, 0)
            buf.use_huge_pages(
                whole, [(lo, lo + (n * (hi - lo)) // t.shape[3]) for lo, hi in whole]
            )

    def _entries(self, num_tokens: int) -> tuple[int, int]:
        """How many entries along ``k``'s and ``v``'s position dimension hold the first
        ``num_tokens`` positions (key blocks where blocked; an int8 cache's values too)."""
        nk = -(-num_tokens // self.key_block) if self.key_block else num_tokens
        return nk, nk if self.quantized else num_tokens

    def clear(self, slot: int, num_tokens: int) -> None:
        """Zero the first ``num_tokens`` positions of ``slot`` (every layer and head)."""
        nk, nv = self._entries(num_tokens)
        self.k[:, slot, :, :nk].zero_()
        self.v[:, slot, :, :nv].zero_()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        if dtype == torch.int8:  # an int8 entry each and a float32 scale per position and head
            return 2 * num_layers * num_kv_heads * (head_dim + 4)
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def reserved_bytes(self) -> int:
        """Address space the pool reserves (what every slot holds at ``max_len``)."""
        return self._k_buf.nbytes + self._v_buf.nbytes

    def resident_bytes(self) -> int:
        """Bytes of the pool committed in RAM now (0 where the platform cannot tell)."""
        return self._k_buf.resident_bytes() + self._v_buf.resident_bytes()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        """Slots held by running sequences (a free slot that still caches a prefix is free)."""
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        """A free slot with nothing reused (least recently used first under prefix caching)."""
        if not self._free:
            raise RuntimeError("KV pool exhausted")
        if not self.enable_prefix_caching:
            return self._free.pop()
        return self._take(self._lru(exclude=None), 0)

    def allocate_for_prompt(
        self, prompt_token_ids: Sequence[int], cache_salt: int = 0
    ) -> tuple[int, int]:
        """A free slot for a new request and how many leading prompt tokens' KV it holds.

        The reused count is at most ``len(prompt) - 1``: the last prompt token is always
        computed, so there are logits to sample from. Only slots freed with the same
        ``cache_salt`` are reused (vLLM's per-request ``cache_salt``: one tenant's prefixes
        never serve, or reveal themselves to, another's).
        """
        if not self.enable_prefix_caching:
            return self.allocate(), 0
        if not self._free:
            raise RuntimeError("KV pool exhausted")
        prompt = np.asarray(prompt_token_ids, dtype=np.int64)  # [P]
        best, lcp = self._longest_prefix(prompt, cache_salt, np.asarray(self._free))
        num_reused = max(0, min(lcp, len(prompt) - 1))
        self.num_prefix_cache_queries += len(prompt)
        if self.share_block:  # a running request's computed prompt, shared whole blocks and all
            running = np.flatnonzero(self._num_cached > 0)
            running = running[~np.isin(running, self._free)]
            if running.size:
                src, rlcp = self._longest_prefix(prompt, cache_salt, running)
                r_reused = min(rlcp, len(prompt) - 1)
                if r_reused >= self.share_block and r_reused > num_reused:
                    slot = self._take(self._lru(exclude=None), 0)
                    self._share(src, slot, r_reused)
                    self.num_prefix_cache_hits += r_reused
                    return slot, r_reused
        self.num_prefix_cache_hits += num_reused
        if num_reused == 0:
            return self._take(self._lru(exclude=None), 0), 0
        victim = self._lru(exclude=best)
        lost_in_place = int(self._num_cached[best]) - num_reused  # best's tail, overwritten
        if victim is None or lost_in_place <= 0 or lost_in_place < self._num_cached[victim]:
            return self._take(best, num_reused), num_reused
        # NOTE: taking `best` would overwrite more cached tokens than evicting `victim` (a shared
        # system prompt would otherwise make each new request evict the previous one). Share or
        # copy the prefix into the victim instead: far cheaper than a forward.
        self._take(victim, 0)
        self._share(best, victim, num_reused)
        return victim, num_reused

    def copy_prefix(self, src: int, dst: int, num_tokens: int, start: int = 0) -> None:
        """Copy the KV of positions start..num_tokens-1 from slot ``src`` to slot ``dst``
        (``start`` a multiple of the key block)."""
        if self.key_block and start % self.key_block:
            raise ValueError(f"copy start {start} is not a multiple of {self.key_block}")
        nk, nv = self._entries(num_tokens)
        k0, v0 = self._entries(start)  # (exact: start is a whole number of key blocks)
        self.k[:, dst, :, k0:nk] = self.k[:, src, :, k0:nk]  # a partial last block: stale tail
        self.v[:, dst, :, v0:nv] = self.v[:, src, :, v0:nv]
        if self.mirror is not None:
            self.mirror("copy_prefix", (src, dst, num_tokens, start))

    def layer_slot(
        self, layer: int, slot: int, prefix_slot: int = -1, prefix_len: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of ``slot`` in the stored layout, with its first
        ``prefix_len`` positions read from ``prefix_slot`` (a copy then; for the op-by-op path)."""
        k, v = self.k[layer, slot], self.v[layer, slot]
        if prefix_len <= 0:
            return k, v
        nk, nv = self._entries(prefix_len)  # (a whole number of key blocks)
        k = torch.cat([self.k[layer, prefix_slot, :, :nk], k[:, nk:]], dim=1)
        v = torch.cat([self.v[layer, prefix_slot, :, :nv], v[:, nv:]], dim=1)
        return k, v

    def prefix_of(self, slot: int) -> tuple[int, int]:
        """The slot holding ``slot``'s shared prefix and its length ((-1, 0): none)."""
        return int(self._base[slot]), int(self._base_len[slot])

    def publish(self, slot: int, token_ids: Sequence[int], cache_salt: int = 0) -> None:
        """A running sequence's computed tokens (its KV at positions 0..n-1, which it never
        rewrites): later requests may share their whole blocks (``allocate_for_prompt``)."""
        n = len(token_ids)
        if not (self.share_block and self.enable_prefix_caching) or n < self.share_block:
            return
        if slot in self._free:
            raise RuntimeError(f"KV slot {slot} is free: nothing runs there to publish")
        self._cached_token_ids[slot, :n] = token_ids
        self._num_cached[slot] = n
        self._salt[slot] = cache_salt
        self._log(slot)

    def free(self, slot: int, cached_token_ids: Sequence[int] = (), cache_salt: int = 0) -> None:
        """Return a slot; under prefix caching it remembers ``cached_token_ids`` (whose KV it
        holds at positions 0..n-1) for later requests."""
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"double free or bad KV slot {slot}")
        n = 0
        if self.enable_prefix_caching:
            n = len(cached_token_ids)
            self._cached_token_ids[slot, :n] = cached_token_ids
        self._unpin(slot, n)  # (a failed request caches nothing: its readers take copies)
        self._rebase(slot, n)
        self._num_cached[slot] = n
        self._salt[slot] = cache_salt
        self._clock += 1
        self._last_used[slot] = self._clock
        self._free.append(slot)
        self._release(slot, n)
        self._log(slot)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and give back its pages (running sequences keep their KV)."""
        cached = [slot for slot in self._free if self._num_cached[slot]]
        for slot in cached:  # first what free slots read of others (nothing to copy)
            self._rebase(slot, 0)
        for slot in cached:
            self._unpin(slot, 0)  # running sequences reading it get their own copies
            self._num_cached[slot] = 0
            self._release(slot, 0)
        if self.block_log is not None:  # what running sequences published is still offered
            offered = np.flatnonzero(self._num_cached > 0)
            self.block_log.clear({int(s): self._offered(int(s)) for s in offered})

    def _offered(self, slot: int) -> tuple[np.ndarray, bool]:
        """The token ids ``slot`` offers to later prompts and whether they are salted."""
        n = int(self._num_cached[slot])
        return self._cached_token_ids[slot, :n], bool(self._salt[slot])

    def _log(self, slot: int) -> None:
        """Record what ``slot`` offers now (KV events; nothing without a block log)."""
        if self.block_log is not None:
            self.block_log.update(slot, *self._offered(slot))

    # ---- prefix lookup ------------------------------------------------------------------------
    def _longest_prefix(
        self, prompt: np.ndarray, cache_salt: int, free: np.ndarray
    ) -> tuple[int, int]:
        """The slot among ``free`` (free slots, or running ones' published tokens) of the same
        salt sharing the longest prefix with ``prompt`` and that length (vectorised: one
        comparison over [slots, prompt length])."""
        n = min(len(prompt), int(self._num_cached[free].max()))
        if n == 0:
            return int(free[-1]), 0
        same = self._cached_token_ids[free, :n] == prompt[:n]  # [F, n]
        lcp = np.where(same.all(axis=1), n, same.argmin(axis=1))  # [F] first mismatch
        lcp = np.minimum(lcp, self._num_cached[free])
        lcp = np.where(self._salt[free] == cache_salt, lcp, 0)
        # Ties: the slot that loses nothing (fully reused), then the most recently used.
        order = np.lexsort((self._last_used[free], lcp == self._num_cached[free], lcp))
        i = int(order[-1])
        return int(free[i]), int(lcp[i])

    def _lru(self, exclude: int | None) -> int | None:
        """The free slot to evict: empty slots first, then the least recently used, and slots
        other sequences read a prefix of last."""
        free = np.asarray([s for s in self._free if s != exclude], dtype=np.int64)  # [F]
        if free.size == 0:
            return None
        read = np.isin(free, self._base)
        order = np.lexsort((free, self._last_used[free], self._num_cached[free] > 0, read))
        return int(free[order[0]])

    def _take(self, slot: int, num_reused: int) -> int:
        """Take a free slot whose first ``num_reused`` positions a new sequence keeps."""
        self._free.remove(slot)
        self._unpin(slot, num_reused)
        self._rebase(slot, num_reused)
        if self._num_cached[slot] > num_reused:  # an evicted prefix, or a tail not reused
            self._release(slot, num_reused)
        self._num_cached[slot] = 0
        self._log(slot)
        return slot

    # ---- shared prefixes ----------------------------------------------------------------------
    def _share(self, src: int, dst: int, n: int) -> None:
        """Give ``dst`` (just taken, holding nothing) ``src``'s first ``n`` positions: the whole
        blocks by reference to the slot holding them (with sharing on), the rest copied."""
        base, base_len = int(self._base[src]), int(self._base_len[src])
        root, root_len = (src, n) if base < 0 else (base, min(base_len, n))
        shared = root_len // self.share_block * self.share_block if self.share_block else 0
        if shared:
            self._base[dst], self._base_len[dst] = root, shared
        self._copy(src, dst, shared, n)

    def _copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy positions [start, end) of ``src``'s sequence, from wherever they are held."""
        base, base_len = int(self._base[src]), int(self._base_len[src])
        if base >= 0 and start < base_len:
            self.copy_prefix(base, dst, min(end, base_len), start)
            start = min(end, base_len)
        if start < end:
            self.copy_prefix(src, dst, end, start)

    def _unpin(self, slot: int, num_kept: int) -> None:
        """Before ``slot`` keeps only its first ``num_kept`` positions: every sequence reading
        more of it than that gets its own copy of what it reads."""
        for reader in np.flatnonzero((self._base == slot) & (self._base_len > num_kept)):
            self.copy_prefix(slot, int(reader), int(self._base_len[reader]))
            self._base[reader], self._base_len[reader] = -1, 0

    def _rebase(self, slot: int, num_kept: int) -> None:
        """``slot`` keeps only its first ``num_kept`` positions: a shared prefix longer than that
        shrinks to its whole blocks within them, and the rest of them is copied in."""
        base, base_len = int(self._base[slot]), int(self._base_len[slot])
        if base < 0 or base_len <= num_kept:
            return
        block = self.share_block
        keep = num_kept // block * block if block else 0
        self.copy_prefix(base, slot, num_kept, keep)
        self._base[slot], self._base_len[slot] = (base, keep) if keep else (-1, 0)

    # ---- memory -------------------------------------------------------------------------------
    def _release(self, slot: int, num_kept: int) -> None:
        """Give back the pages of ``slot`` past its first ``num_kept`` positions."""
        nk, nv = self._entries(num_kept)
        self._k_buf.release(_slot_ranges(self.k, slot, nk))
        self._v_buf.release(_slot_ranges(self.v, slot, nv))
        if self._huge_at[slot]:
            self._huge_at[slot] = 0
            self._k_buf.use_base_pages(_slot_ranges(self.k, slot, 0))
            self._v_buf.use_base_pages(_slot_ranges(self.v, slot, 0))
        if self.mirror is not None:
            self.mirror("_release", (slot, num_kept))


def _paged(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> PagedBuffer:
    return PagedBuffer(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(), device)


def _slots_together(buf: PagedBuffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf`` as ``shape`` ``[L, S, ...]``; where pages are committed as they are written, each
    slot's layers lie together (``[S, L, ...]`` in memory), so that a long sequence's slot is one
    range that huge pages can cover whole (module docstring)."""
    t = buf.tensor.view(dtype)
    if not buf.can_release:
        return t.view(shape)
    return t.view(shape[1], shape[0], *shape[2:]).transpose(0, 1)


def _slot_ranges(t: torch.Tensor, slot: int, num_kept: int) -> list[tuple[int, int]]:
    """Byte ranges of ``t`` ``[L, S, Hkv, N, ...]`` (contiguous from Hkv on) holding ``slot``'s
    entries past the first ``num_kept`` along N: one per (layer, head)."""
    num_layers, _, num_heads, n = t.shape[:4]
    elt = t.element_size()
    row = math.prod(t.shape[4:]) * elt  # bytes per entry along N
    heads = np.arange(num_layers)[:, None] * t.stride(0) + slot * t.stride(1)
    starts = (heads + np.arange(num_heads) * t.stride(2)).ravel() * elt  # [L * Hkv] head starts
    return [(int(s) + num_kept * row, int(s) + n * row) for s in starts]


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (scales ``[...]`` float32, entries ``[..., D]`` int8): scale = max |x| /
    127 per row, entry = x / scale rounded half to even (0 for an all-zero row). The native
    layers write the same bytes (kernels/csrc/layer.cpp ``put_q8``)."""
    x = x.to(torch.float32)
    scale = x.abs().amax(-1) / 127.0
    div = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.where(scale.unsqueeze(-1) > 0, torch.round(x / div), torch.zeros_like(x))
    return scale, q.clamp(-127, 127).to(torch.int8)


def blocked_keys(k: torch.Tensor, key_block: int) -> torch.Tensor:
    """``[..., L, D]`` keys -> ``[..., ceil(L / key_block), D, key_block]`` (zero-padded)."""
    *lead, length, d = k.shape
    blocks = -(-length // key_block)
    padded = k.new_zeros(*lead, blocks * key_block, d)
    padded[..., :length, :] = k
    return padded.reshape(*lead, blocks, key_block, d).transpose(-1, -2).contiguous()


def standard_keys(k: torch.Tensor, length: int, key_block: int) -> torch.Tensor:
    """Inverse of :func:`blocked_keys` (``key_block = 0``: ``k`` itself): ``[..., length, D]``."""
    if not key_block:
        return k[..., :length, :]
    *lead, blocks, d, block = k.shape
    return k.transpose(-1, -2).reshape(*lead, blocks * block, d)[..., :length, :]
