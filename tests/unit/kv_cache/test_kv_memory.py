"""KV memory follows use: freed slots give their pages back (checked with mincore, not timing),
cached prefixes survive other slots' release, and the pool's size follows the machine."""

import os
import platform
import re
import threading
import time

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import ConfigError
from specdec.kv_cache import memory
from specdec.kv_cache.memory import (
    HUGE_PAGE_SIZE,
    PAGE_SIZE,
    PagedBuffer,
    resident_bytes,
    settle_huge_pages,
)
from specdec.kv_cache.pool import HUGE_PAGES_AFTER, KVCache, standard_keys
from specdec.kv_cache.sizing import (
    DEFAULT_PREFIX_CACHE_SLOTS,
    MAX_PREFIX_CACHE_SLOTS,
    describe_pool,
    plan_kv_slots,
)

pytestmark = pytest.mark.skipif(
    not PagedBuffer(PAGE_SIZE, torch.device("cpu")).can_release
    or resident_bytes(torch.ones(PAGE_SIZE)) == 0,
    reason="needs mmap.madvise and mincore (Linux)",
)

L, S, H, N, D = 2, 4, 2, 1024, 64  # layers, slots, KV heads, positions, head size
PER_TOKEN = KVCache.bytes_per_token(L, H, D, torch.float16)  # 1 KiB: a page holds 32 rows


def _pool(key_block: int, caching: bool = True, num_slots: int = S) -> KVCache:
    return KVCache(L, num_slots, H, N, D, torch.float16, torch.device("cpu"), caching, key_block)


def _fill(kv: KVCache, slot: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write random KV at positions 0..n-1 of ``slot``; returns what was written
    ``[L, H, n, D]`` twice (keys, values)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, n, H, D, generator=g).half()
    v = torch.randn(L, n, H, D, generator=g).half()
    for layer in range(L):
        kv.store(layer, slot, 0, k[layer], v[layer])
    return k.transpose(1, 2), v.transpose(1, 2)


def _read(kv: KVCache, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = range(kv.k.shape[0])
    keys = torch.stack([standard_keys(kv.k[i, slot], n, kv.key_block) for i in layers])
    return keys, kv.v[:, slot, :, :n]


def held_bytes(kv: KVCache, n: int) -> int:
    """What a slot holding ``n`` positions keeps resident: whole pages per (layer, head), keys and
    values (each (layer, head) range starts on a page here)."""
    num_layers, _, num_heads, max_len, head_size = kv.v.shape
    row = head_size * kv.v.element_size()
    assert max_len * row % PAGE_SIZE == 0
    rows_k = -(-n // kv.key_block) * kv.key_block if kv.key_block else n
    pages = -(-rows_k * row // PAGE_SIZE) + -(-n * row // PAGE_SIZE)
    return num_layers * num_heads * pages * PAGE_SIZE


def cached_bytes(kv: KVCache) -> int:
    """What the cached prefixes of the free slots hold (a shared prefix where it is, once)."""
    return sum(
        held_bytes(kv, int(kv._num_cached[s])) - held_bytes(kv, kv.prefix_of(s)[1])
        for s in kv._free
    )


@pytest.mark.parametrize("key_block", [0, 16])
def test_free_returns_pages(key_block) -> None:
    kv = _pool(key_block, caching=False)
    assert kv.resident_bytes() == 0 and kv.reserved_bytes == S * N * PER_TOKEN
    slot = kv.allocate()
    _fill(kv, slot, N, seed=0)
    assert kv.resident_bytes() == N * PER_TOKEN  # the whole slot, nothing else
    kv.free(slot)
    assert kv.resident_bytes() == 0
    assert not kv.v[:, slot].any() and not kv.k[:, slot].any()  # given back: reads as zeros


@pytest.mark.parametrize("key_block", [0, 16])
def test_cached_prefix_keeps_its_pages_and_values(key_block) -> None:
    kv = _pool(key_block)
    a, _ = kv.allocate_for_prompt([1, 2, 3])
    b, _ = kv.allocate_for_prompt([4, 5, 6])
    ka, va = _fill(kv, a, 700, seed=1)
    _fill(kv, b, 900, seed=2)
    kv.free(a, list(range(100, 400)))
    assert kv.resident_bytes() == held_bytes(kv, 300) + held_bytes(kv, 900)
    kv.free(b)  # given back whole: a's prefix must not move
    assert kv.resident_bytes() == held_bytes(kv, 300) == cached_bytes(kv)
    assert 300 * PER_TOKEN <= held_bytes(kv, 300) <= 320 * PER_TOKEN  # 32 rows a page
    keys, values = _read(kv, a, 300)
    assert torch.equal(keys, ka[:, :, :300]) and torch.equal(values, va[:, :, :300])


@pytest.mark.parametrize("key_block", [0, 16])
def test_reused_prefix_gives_back_the_tail(key_block) -> None:
    kv = _pool(key_block, num_slots=1)
    a, _ = kv.allocate_for_prompt([1])
    ka, va = _fill(kv, a, 700, seed=1)
    kv.free(a, list(range(100, 400)))
    # A new request reuses 200 of the 300 cached tokens in place: the tail goes, the head stays.
    assert kv.allocate_for_prompt([*range(100, 300), 7, 8]) == (a, 200)
    assert kv.resident_bytes() == held_bytes(kv, 200)
    keys, values = _read(kv, a, 200)
    assert torch.equal(keys, ka[:, :, :200]) and torch.equal(values, va[:, :, :200])
    kv.free(a)
    assert kv.resident_bytes() == 0


def test_copied_prefix_and_reset() -> None:
    """The copy path (a shared prefix moved into an evicted slot) and reset_prefix_cache."""
    kv = _pool(16, num_slots=2)
    a, _ = kv.allocate_for_prompt([1])
    b, _ = kv.allocate_for_prompt([2])
    ka, va = _fill(kv, a, 640, seed=3)
    _fill(kv, b, 256, seed=4)
    kv.free(a, list(range(640)))
    kv.free(b, [9] * 256)
    # Reusing 64 of a's 640 tokens in place would lose 576: they go into b (256 lost) instead.
    assert kv.allocate_for_prompt([*range(64), 5]) == (b, 64)
    assert kv.resident_bytes() == held_bytes(kv, 640) + held_bytes(kv, 64)
    keys, values = _read(kv, b, 64)
    assert torch.equal(keys, ka[:, :, :64]) and torch.equal(values, va[:, :, :64])
    kv.free(b)
    assert kv.resident_bytes() == held_bytes(kv, 640)
    kv.reset_prefix_cache()
    assert kv.resident_bytes() == 0


def test_resident_kv_follows_use_over_many_requests() -> None:
    """Three times as many requests as slots, each caching half of what it wrote: resident KV is
    exactly what the cached prefixes hold, whatever was written before."""
    kv = _pool(16)
    lengths = [1000, 37, 512, 900, 1, 333, 1024, 64, 700, 5, 999, 256]
    num_cached = {}  # slot -> positions its last request left cached
    for i, n in enumerate(lengths):
        slot, _ = kv.allocate_for_prompt([1000 + i])
        _fill(kv, slot, n, seed=i)
        kv.free(slot, [2000 + i] * (n // 2))
        num_cached[slot] = n // 2
        assert kv.resident_bytes() == sum(held_bytes(kv, c) for c in num_cached.values())
    kv.reset_prefix_cache()
    assert kv.resident_bytes() == 0


def test_paged_buffer_fallback() -> None:
    buf = PagedBuffer(3 * PAGE_SIZE, torch.device("meta"))
    assert not buf.can_release and buf.release([(0, 3 * PAGE_SIZE)]) == 0
    cpu = PagedBuffer(4 * PAGE_SIZE, torch.device("cpu"))
    cpu.tensor.fill_(1)
    # Partial pages at the ends are kept; adjacent ranges merge into one.
    assert cpu.release([(100, 2 * PAGE_SIZE), (2 * PAGE_SIZE, 3 * PAGE_SIZE + 5)]) == 2 * PAGE_SIZE
    assert cpu.resident_bytes() == 2 * PAGE_SIZE
    assert cpu.tensor[:PAGE_SIZE].eq(1).all() and not cpu.tensor[PAGE_SIZE : 3 * PAGE_SIZE].any()


def _huge_bytes(t: torch.Tensor) -> int:
    """Bytes of transparent huge pages in the mappings over ``t`` (/proc/self/smaps; advice
    splits one mapping into several)."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "lo-hi perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _thp_enabled() -> bool:
    """Transparent huge pages on for advised ranges, and MADV_COLLAPSE known (Linux 6.1)."""
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read() and release >= (6, 1)
    except OSError:
        return False


def test_huge_pages_keep_contents_and_stay_inside_their_ranges() -> None:
    buf = PagedBuffer(5 * HUGE_PAGE_SIZE, torch.device("cpu"))
    assert buf.tensor.data_ptr() % HUGE_PAGE_SIZE == 0
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 * HUGE_PAGE_SIZE,), dtype=torch.uint8, generator=g)
    buf.tensor[: data.numel()] = data
    # Only whole chunks inside the ranges, filled at least half: [100, 2.5 chunks) holds chunk 1
    # alone; written up to 1.4 chunks it is not backed, up to 1.5 it is (once).
    ranges = [(100, 5 * HUGE_PAGE_SIZE // 2)]
    assert buf.use_huge_pages(ranges, [(0, 7 * HUGE_PAGE_SIZE // 5)]) == 0
    assert _huge_bytes(buf.tensor) == 0
    assert buf.use_huge_pages(ranges, [(0, 3 * HUGE_PAGE_SIZE // 2)]) == HUGE_PAGE_SIZE
    assert buf.use_huge_pages(ranges, [(0, 3 * HUGE_PAGE_SIZE // 2)]) == 0  # advised already
    assert settle_huge_pages(30)  # collapsed off this thread
    assert torch.equal(buf.tensor[: data.numel()], data)
    if _thp_enabled():
        assert _huge_bytes(buf.tensor) == HUGE_PAGE_SIZE
    # Giving the pages back splits the huge page; nothing outside the released range goes.
    assert buf.release([(0, 2 * HUGE_PAGE_SIZE)]) == 2 * HUGE_PAGE_SIZE
    buf.use_base_pages(ranges)
    assert torch.equal(buf.tensor[2 * HUGE_PAGE_SIZE : data.numel()], data[2 * HUGE_PAGE_SIZE :])
    assert _huge_bytes(buf.tensor) == 0
    assert buf.resident_bytes() == HUGE_PAGE_SIZE


def test_collapsing_waits_for_an_idle_model_on_its_own_thread_and_skips_released_chunks(
    monkeypatch,
) -> None:
    """use_huge_pages only advises and queues: the collapse runs on the background thread once
    no forward has run for QUIET_S, and a chunk released before its turn is taken out of the
    queue (not collapsed, so not committed again as a whole huge page)."""
    buf = PagedBuffer(4 * HUGE_PAGE_SIZE, torch.device("cpu"))
    buf.tensor[: 4 * HUGE_PAGE_SIZE] = 7
    gate, seen, done = threading.Event(), [], []
    real = PagedBuffer._collapse

    def slow(self: PagedBuffer, chunk: int) -> bool:
        seen.append((threading.current_thread().name, chunk))
        gate.wait(10)  # holds the thread on the first chunk until released below
        done.append(chunk)
        return real(self, chunk)

    monkeypatch.setattr(PagedBuffer, "_collapse", slow)
    # a forward ran just now: nothing is collapsed until the model has been idle for QUIET_S
    memory.note_forward()
    start = time.perf_counter()
    queued = buf.use_huge_pages([(0, 4 * HUGE_PAGE_SIZE)], [(0, 4 * HUGE_PAGE_SIZE)])
    assert queued == 4 * HUGE_PAGE_SIZE and time.perf_counter() - start < 1.0
    for _ in range(10):  # forwards every 10 ms keep it waiting
        time.sleep(0.01)
        memory.note_forward()
    assert not seen
    deadline = time.time() + 10
    while not seen and time.time() < deadline:
        time.sleep(0.01)
    assert seen == [("specdec-huge-pages", 0)]
    buf.release([(2 * HUGE_PAGE_SIZE, 4 * HUGE_PAGE_SIZE)])  # chunks 2 and 3 leave the queue
    gate.set()
    assert settle_huge_pages(30)
    assert done == [0, HUGE_PAGE_SIZE]
    assert buf.resident_bytes() == 2 * HUGE_PAGE_SIZE
    assert bool((buf.tensor[: 2 * HUGE_PAGE_SIZE] == 7).all())
    assert memory._COLLAPSER._busy is None


@pytest.mark.parametrize("key_block", [0, 16])
def test_long_sequence_slot_takes_huge_pages_until_freed(key_block) -> None:
    """A slot reaching HUGE_PAGES_AFTER positions is collapsed into huge pages with its contents
    unchanged; a short one is not; freeing it gives every page back."""
    n = 2 * HUGE_PAGES_AFTER
    kv = KVCache(2, 1, 2, n, 128, torch.float16, torch.device("cpu"), False, key_block)
    slot = kv.allocate()
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, n - 100, 2, 128, generator=g).half()
    for layer in range(2):
        kv.store(layer, slot, 0, k[layer], k[layer])
    before = _read(kv, slot, n - 100)
    kv.grow(slot, HUGE_PAGES_AFTER - 1)  # not long enough yet
    assert _huge_bytes(kv.k) == 0 and _huge_bytes(kv.v) == 0
    kv.grow(slot, n - 99)
    assert settle_huge_pages(30)
    after = _read(kv, slot, n - 100)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    if _thp_enabled():
        # 2 layers x 2 heads x 2,048 positions x 256 bytes: one huge page, keys and values each
        assert _huge_bytes(kv.k) == HUGE_PAGE_SIZE == _huge_bytes(kv.v)
    kv.free(slot)
    assert kv.resident_bytes() == 0 and _huge_bytes(kv.k) == 0


# ---- sizing -----------------------------------------------------------------------------------
GiB = 2**30


def test_plan_default_matches_the_old_pool_when_ram_allows() -> None:
    per_token = 23040  # SmolLM2-135M, float16 KV: 90 MiB per 4096-position slot
    assert plan_kv_slots(4096, per_token, 8, True, available_bytes=20 * GiB) == (8, 32)
    assert plan_kv_slots(4096, per_token, 8, False, available_bytes=20 * GiB) == (8, 0)


def test_plan_default_fits_the_machine() -> None:
    per_slot = 4096 * 196608  # SmolLM2-1.7B, float16 KV: 768 MiB per slot
    # Half of 20 GiB holds 13 full slots: 8 running, 5 for the cache (was 8 + 6 past the half).
    assert plan_kv_slots(4096, 196608, 8, True, available_bytes=20 * GiB) == (8, 5)
    # 4 GiB: two running slots, not 8 (every one of them may reach max_model_len).
    assert plan_kv_slots(4096, 196608, 8, True, available_bytes=4 * GiB) == (2, 0)
    # A shorter max_model_len fits more.
    assert plan_kv_slots(1024, 196608, 8, True, available_bytes=4 * GiB) == (8, 2)
    # Never fewer than one running slot.
    assert plan_kv_slots(4096, 196608, 8, True, available_bytes=per_slot) == (1, 0)


def test_plan_with_a_budget() -> None:
    per_slot = 128 * 1024
    assert plan_kv_slots(128, 1024, 8, True, kv_cache_memory=3 * per_slot) == (3, 0)
    assert plan_kv_slots(128, 1024, 2, True, kv_cache_memory=5 * per_slot) == (2, 3)
    assert plan_kv_slots(128, 1024, 2, False, kv_cache_memory=5 * per_slot) == (2, 0)
    big = plan_kv_slots(128, 1024, 2, True, kv_cache_memory=1000 * per_slot)
    assert big == (2, MAX_PREFIX_CACHE_SLOTS)
    half = plan_kv_slots(128, 1024, 2, True, kv_cache_memory=0.5, available_bytes=10 * per_slot)
    assert half == (2, 3)
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        plan_kv_slots(128, 1024, 2, True, kv_cache_memory=1000)
    assert DEFAULT_PREFIX_CACHE_SLOTS == 32


def test_describe_pool() -> None:
    kv = _pool(16)
    line = describe_pool(kv, 1)
    assert line.startswith("4 slots (1 running, 3 prefix cache) x 1024 positions, float16, ")
    assert f"{kv.reserved_bytes / GiB:.2f} GiB reserved" in line


# ---- the engine -------------------------------------------------------------------------------
def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 200, (length,), generator=g).tolist() for _ in range(n)]


def test_engine_gives_pages_back_and_output_is_unchanged(tiny_llama) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(6, 300)
    off = LLM(str(tiny_llama), max_model_len=512, max_num_seqs=2, enable_prefix_caching=False)
    on = LLM(str(tiny_llama), max_model_len=512, max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    assert off.engine.kv.resident_bytes() == 0  # nothing running, nothing cached
    kv = on.engine.kv
    for _ in range(2):  # the second round hits the cache
        got = [o.outputs[0].token_ids for o in on.generate(prompts, sp, use_tqdm=False)]
        assert got == want
        assert kv.resident_bytes() == cached_bytes(kv) > 0
    assert on.engine.num_prefix_cache_hits >= len(prompts) * 299
    on.engine.reset_prefix_cache()
    assert kv.resident_bytes() == 0
    again = [o.outputs[0].token_ids for o in on.generate(prompts[:2], sp, use_tqdm=False)]
    assert again == want[:2]


@pytest.mark.slow
def test_real_model_kv_follows_use() -> None:
    """SmolLM2-135M, four 512-token prompts twice: resident KV is what the cached sequences hold,
    a reset gives it all back, and greedy output is the same each time."""
    llm = LLM("smollm2-135m", max_num_seqs=2)
    kv = llm.engine.kv
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = " ".join(f"line {i}: value = {i * i % 97}" for i in range(500))
    ids = llm.get_tokenizer().encode(text)
    prompts = [ids[i * 520 : i * 520 + 512] for i in range(4)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    per_token = kv.reserved_bytes // (kv.num_slots * kv.max_len)
    assert kv.resident_bytes() == cached_bytes(kv)
    assert 4 * 520 * per_token <= kv.resident_bytes() <= 4 * 560 * per_token
    llm.engine.reset_prefix_cache()
    assert kv.resident_bytes() == 0
    second = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], sp, use_tqdm=False)]
    assert second == first[::-1]
    assert kv.resident_bytes() == cached_bytes(kv)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_the_collapser_holds_its_lock_collapses_on_its_own() -> None:
    """A process forked while the collapsing thread held its lock: the child's first chunk
    neither waits on that lock forever nor on a thread it does not have."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:  # another thread holds the lock, as the collapsing thread would
        with memory._COLLAPSER._cv:
            taken.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: exits 0 only if its own collapser took the chunk and finished
            code = 1
            try:  # NOTE: numpy, not torch ops: torch's thread pool is not to be used after a fork
                buf = PagedBuffer(2 * HUGE_PAGE_SIZE, torch.device("cpu"))
                data = buf.tensor.numpy()
                data[:] = 1
                buf.use_huge_pages([(0, 2 * HUGE_PAGE_SIZE)], [(0, 2 * HUGE_PAGE_SIZE)])
                code = 0 if settle_huge_pages(20) and bool((data == 1).all()) else 1
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    deadline = time.time() + 40
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the collapser")
