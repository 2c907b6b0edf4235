"""The real scheduler and speculator driven through ``LLMEngine.step`` by a fake runner.

No model: the fake target's token after a sequence is a pure function of that sequence (and of
the seed when sampling), a scripted drafter proposes its continuation with a chosen number of
correct drafts, and the fake runner keeps a KV cache of token ids (the real pool's copies and
releases reach it through ``KVCache.mirror``). Its answers then depend on exactly what sits at
each KV position, so a request's tokens equal a plain run's only if every position, rollback,
prefix and shared block the scheduler hands the runner is right; ``_check_kv`` also compares
that cache with each request's tokens after every step.
"""

from __future__ import annotations

import time
import types
import zlib
from collections.abc import Callable
from unittest import mock

import numpy as np
import pytest
import torch

import specdec.engine.scheduler as scheduler_module
from specdec import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.engine.fair_share import BURST
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.processor import Processor
from specdec.engine.scheduler import Scheduler
from specdec.engine.speculator import Speculator
from specdec.kv_cache.pool import KVCache
from specdec.llm import LLM
from specdec.outputs import RequestOutput
from specdec.sample.rejection_sampler import VerifyResult
from specdec.spec_decode import DraftInput, DraftOutput, Proposer
from specdec.worker.model_runner import ModelRunnerOutput
from specdec.worker.step import ScheduledRequest, SchedulerOutput

V = 64  # vocabulary
EOS = V - 1  # the only end-of-generation token; the fake target emits it only where scripted
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# ---- fakes ---------------------------------------------------------------------------------------
class FakeTokenizer:
    """What the detokenizer and the output processor read: token i is the word ``w{i}``."""

    eog_token_ids = frozenset({EOS})
    special_token_ids = frozenset({EOS})
    byte_fallback_token_ids = frozenset()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            "<eos>" if i == EOS else f" w{i}"
            for i in ids
            if not (skip_special_tokens and i in self.special_token_ids)
        )


class FakeTarget:
    """The target's next token: a hash of the whole sequence (and of the seed when sampling), in
    1..V-2. ``forced``: {a prompt's first token: (a sequence length, the token that follows)}."""

    def __init__(self, forced: dict[int, tuple[int, int]] | None = None) -> None:
        self.forced = dict(forced or {})

    def next_token(self, seq: list[int], sampling: SamplingParams, seed: int) -> int:
        at, token = self.forced.get(seq[0] if seq else -1, (-1, 0))
        if at == len(seq):
            return token
        salt = 0 if sampling.is_greedy else seed & 0xFFFFFFFF
        return 1 + zlib.crc32(np.asarray(seq, dtype=np.int64).tobytes(), salt) % (V - 2)

    def continuation(
        self, seq: list[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[int]:
        seq, out = list(seq), []
        for _ in range(n):
            out.append(self.next_token(seq, sampling, seed))
            seq.append(out[-1])
        return out


class FakeRunner:
    """The executor and runner in one: writes each fed token at its position of a KV cache of
    token ids ``[slots, max_len]`` (-1: nothing there), then verifies the drafts greedily against
    the fake target reading that cache (sample and match, as the real runner's point-mass
    verification). Every step's ``SchedulerOutput`` is kept in ``steps``."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, kv: KVCache, target: FakeTarget) -> None:
        self.kv, self.target = kv, target
        self.tokens = np.full((kv.num_slots, kv.max_len), -1, dtype=np.int64)  # [S, max_len]
        self.steps: list[SchedulerOutput] = []
        self.on_execute: Callable[[SchedulerOutput], None] | None = None
        kv.mirror = self._mirror  # NOTE: the pool's seam for tensor-parallel ranks' caches

    def _mirror(self, method: str, args: tuple) -> None:
        if method == "copy_prefix":
            src, dst, end, start = args
            self.tokens[dst, start:end] = self.tokens[src, start:end]
        elif method == "_release":
            slot, num_kept = args
            self.tokens[slot, num_kept:] = -1

    def context(self, slot: int, prefix_slot: int, prefix_len: int, end: int) -> list[int]:
        """The token ids a sequence's attention reads at positions 0..end-1."""
        n = min(max(prefix_len, 0), end)
        head = self.tokens[prefix_slot, :n] if n else self.tokens[slot, :0]
        return [*head.tolist(), *self.tokens[slot, n:end].tolist()]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        if self.on_execute is not None:
            self.on_execute(sched)
        return ModelRunnerOutput([self._run_one(s) for s in sched.scheduled])

    def _run_one(self, s: ScheduledRequest) -> VerifyResult | None:
        end = s.start_pos + len(s.token_ids)
        assert end <= self.kv.max_len, f"{s.req_id}: positions up to {end} > {self.kv.max_len}"
        assert s.start_pos >= s.prefix_len, f"{s.req_id} writes into a shared prefix"
        self.tokens[s.slot, s.start_pos : end] = s.token_ids
        if not s.needs_logits:
            return None
        ctx = self.context(s.slot, s.prefix_slot, s.prefix_len, end - s.num_drafts)
        assert -1 not in ctx, f"{s.req_id} reads KV nobody wrote"
        out: list[int] = []
        for draft in [*s.draft_token_ids, None]:
            out.append(self.target.next_token(ctx, s.sampling, s.seed))
            if draft != out[-1]:
                break
            ctx.append(draft)
        return VerifyResult(out, len(out) - 1, None)

    def shutdown(self) -> None:
        pass


class ScriptedDrafter(Proposer):
    """Proposes the target's continuation with ``accept[req_id]`` (cycled; default ``[k]``)
    correct drafts, then wrong ones, ``max_num_drafts`` long (``k`` long when ``ignore_cap``:
    the scheduler must clip). ``calls``: (req_id, cap, drafts) per proposal."""

    def __init__(self, target: FakeTarget, k: int, ignore_cap: bool = False) -> None:
        self.target, self.k, self.ignore_cap = target, k, ignore_cap
        self.accept: dict[str, list[int]] = {}
        self.calls: list[tuple[str, int, list[int]]] = []
        self.removed: list[str] = []
        self._num_calls: dict[str, int] = {}

    def propose(self, inp: DraftInput) -> DraftOutput:
        drafts = []
        for d in inp.requests:
            n = self.k if self.ignore_cap else d.max_num_drafts
            truth = self.target.continuation(d.token_ids, n, d.sampling, d.seed)
            script = self.accept.get(d.req_id, [self.k])
            i = self._num_calls.get(d.req_id, 0)
            self._num_calls[d.req_id] = i + 1
            good = script[i % len(script)]
            wrong = [t % (V - 2) + 1 for t in truth[good:]]  # never the target's token
            drafts.append(truth[:good] + wrong)
            self.calls.append((d.req_id, d.max_num_drafts, drafts[-1]))
        return DraftOutput(drafts)

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        self.removed.append(req_id)


# ---- the engine around them ----------------------------------------------------------------------
def make_engine(
    *,
    num_slots: int = 4,
    max_num_seqs: int | None = None,
    max_model_len: int = 64,
    max_num_batched_tokens: int = 256,
    prefix_caching: bool = False,
    share_block: int = 0,
    prefill_time_share: float = 0.0,
    target: FakeTarget | None = None,
    drafter: ScriptedDrafter | None = None,
) -> LLMEngine:
    """A real ``LLMEngine`` (scheduler, speculator, processors, ``step``) whose executor is a
    ``FakeRunner`` over a real one-layer KV pool; the speculator's proposer is ``drafter``."""
    target = target or FakeTarget()
    kv = KVCache(
        1, num_slots, 1, max_model_len, 1, torch.float32, CPU, prefix_caching,
        share_block=share_block,
    )  # fmt: skip
    tok = FakeTokenizer()
    engine = LLMEngine.__new__(LLMEngine)  # NOTE: everything __init__ builds, but the model
    engine.config, engine.device, engine.step_rows, engine.kv_events = None, CPU, None, None
    engine.tokenizer, engine.kv, engine.max_model_len = tok, kv, max_model_len
    engine.scheduler = Scheduler(
        kv, max_num_seqs or num_slots, max_num_batched_tokens, max_model_len,
        tok.eog_token_ids, prefill_time_share,
    )  # fmt: skip
    engine.executor = FakeRunner(kv, target)
    engine.spec, engine.speculator = None, None
    if drafter is not None:
        engine.spec = SpeculativeConfig(num_speculative_tokens=drafter.k, adaptive=False)
        with mock.patch("specdec.engine.speculator.make_proposer", lambda *a: drafter):
            engine.speculator = Speculator(
                engine.spec, None, kv, engine.scheduler, None, max_num_batched_tokens
            )
    engine.processor = Processor(tok, V, max_model_len, CPU, seed=0)
    engine.output_processor = OutputProcessor(tok)
    engine.requests, engine.num_prompt_tokens = {}, 0
    return engine


def fake_llm(engine: LLMEngine) -> LLM:
    """``LLM.generate`` (n > 1, shared prefills, merging) over a fake engine."""
    llm = LLM.__new__(LLM)
    llm.engine, llm.served_model_names, llm._generation_defaults, llm._metrics = (
        engine, ["fake"], {}, None,
    )  # fmt: skip
    return llm


def runner(engine: LLMEngine) -> FakeRunner:
    return engine.executor  # type: ignore[return-value]


def _check_kv(engine: LLMEngine) -> None:
    """What each running request has in the KV cache is its tokens; what each free slot keeps
    for the prefix cache is what it holds (never a rejected draft)."""
    fake, kv = runner(engine), engine.kv
    for req in engine.scheduler.running:
        n = req.num_computed_tokens
        assert n < req.num_tokens, (req.req_id, n, req.num_tokens)
        held = fake.context(req.slot, *kv.prefix_of(req.slot), n)
        assert held == req.all_token_ids[:n], f"{req.req_id}: KV holds other tokens"
    for slot in kv._free:  # NOTE: the pool's own record of what each free slot caches
        n = int(kv._num_cached[slot])
        cached = kv._cached_token_ids[slot, :n].tolist()
        assert fake.context(slot, *kv.prefix_of(slot), n) == cached, f"free slot {slot}"


def run(engine: LLMEngine, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Step until every request finished, checking the KV cache after each step."""
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        _check_kv(engine)
    raise AssertionError(f"unfinished after {max_steps} steps")


def prompt(tag: int, n: int) -> list[int]:
    """``n`` prompt tokens starting with ``tag`` (FakeTarget.forced keys on it)."""
    return [tag] + [1 + (tag * 7 + 3 * i) % (V - 2) for i in range(1, n)]


def solo(ids: list[int], sp: SamplingParams, target: FakeTarget | None = None, **kw) -> list[int]:
    """The tokens of ``ids`` run alone, without drafts or memory pressure."""
    engine = make_engine(target=target, **kw)
    req_id = engine.add_request(ids, sp)
    return list(run(engine)[req_id].outputs[0].token_ids)


def verify_rows(engine: LLMEngine, req_id: str) -> list[ScheduledRequest]:
    return [s for st in runner(engine).steps for s in st.scheduled if s.req_id == req_id]


# ---- commit and rollback -------------------------------------------------------------------------
def test_accepted_drafts_commit_and_rejected_ones_roll_back() -> None:
    target = FakeTarget()
    drafter = ScriptedDrafter(target, k=4)
    engine = make_engine(target=target, drafter=drafter, prefix_caching=True)
    ids = prompt(5, 6)
    drafter.accept["r"] = [2, 0, 4, 1, 3]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request(ids, sp, req_id="r")
    req = engine.requests["r"]
    appended: list[tuple[int, int]] = []  # per verification with drafts: (drafts, tokens appended)
    while engine.has_unfinished_requests():
        before = len(req.output_token_ids)
        engine.step()
        _check_kv(engine)
        s = runner(engine).steps[-1].scheduled[0]
        if s.num_drafts:
            appended.append((s.num_drafts, len(req.output_token_ids) - before))
        if not req.is_finished:
            # the rejected drafts' positions are given back: the next step writes over them
            assert req.num_computed_tokens == req.num_tokens - 1
    assert req.output_token_ids == solo(ids, sp)
    rows = verify_rows(engine, "r")
    for prev, nxt in zip(rows, rows[1:]):  # each step starts right after the accepted run
        accepted = nxt.output_pos - prev.output_pos - 1
        assert nxt.start_pos == prev.start_pos + len(prev.token_ids) - prev.num_drafts + accepted
    # each verification appends its accepted drafts (as scripted) and one token of the target's
    script = [2, 0, 4, 1, 3] * 10
    for (num_drafts, n), good in zip(appended, script):
        assert n == min(good, num_drafts) + 1
    stats = req.spec_stats
    assert stats.num_draft_tokens == sum(d for d, _ in appended)
    assert stats.num_accepted_tokens == sum(n - 1 for _, n in appended) > 0
    assert sum(req.output_from_draft) == stats.num_accepted_tokens


STOP = 7  # " w7": no other token's text starts with it (tokens are 1..62)


@pytest.mark.parametrize("how", ["eos", "stop_token_ids", "stop"])
def test_stop_inside_an_accepted_run_commits_and_counts_nothing_after_it(how: str) -> None:
    """The 4th output token stops the request (EOS, a stop id, a stop string's token) while the
    drafts after it are accepted too: it is the last token committed, and the statistics count
    the drafts up to it only."""
    ids = prompt(9, 5)
    stop_token = EOS if how == "eos" else STOP
    target = FakeTarget(forced={9: (len(ids) + 3, stop_token)})
    drafter = ScriptedDrafter(target, k=5)  # every draft right: the stop accepted mid-run
    engine = make_engine(target=target, drafter=drafter, prefix_caching=True)
    stops = {"stop_token_ids": {"stop_token_ids": [STOP]}, "stop": {"stop": [f" w{STOP}"]}}
    sp = SamplingParams(temperature=0.0, max_tokens=20, **stops.get(how, {}))
    engine.add_request(ids, sp, req_id="r")
    out = run(engine)["r"]
    plain = target.continuation(ids, 4, sp, 0)
    assert plain[-1] == stop_token and stop_token not in plain[:-1]
    assert out.outputs[0].token_ids == plain and out.outputs[0].finish_reason == "stop"
    words = "".join(f" w{t}" for t in plain[:-1])
    assert out.outputs[0].text == (words + f" w{STOP}" if how == "stop_token_ids" else words)
    rows = verify_rows(engine, "r")
    assert rows[-1].num_drafts == 5 and stop_token in rows[-1].draft_token_ids[:-1]
    assert engine.num_generation_tokens == 4
    stats = out.spec_decode_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 3)  # 3 kept of 5 accepted
    assert engine.spec_stats.num_accepted_tokens == 3
    # the slot caches the request's tokens, nothing accepted past the stop
    slot = rows[-1].slot
    n = int(engine.kv._num_cached[slot])
    assert engine.kv._cached_token_ids[slot, :n].tolist() == (ids + plain)[:n]
    assert n <= len(ids) + len(plain)


# ---- memory pressure -----------------------------------------------------------------------------
def test_full_kv_pool_queues_requests_and_their_tokens_equal_runs_without_pressure() -> None:
    """Two slots for five requests (max_num_seqs allows more): admission waits for a free slot,
    nobody crashes or loses a slot mid-run, and every output is the unpressured one.
    NOTE: a slot holds max_model_len positions, so a running request never runs out of room
    (there is nothing to preempt); drafts are clipped to it (test below)."""
    target = FakeTarget()
    drafter = ScriptedDrafter(target, k=3)
    engine = make_engine(
        num_slots=2, max_num_seqs=4, target=target, drafter=drafter, prefix_caching=True
    )
    sps = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(5)]
    prompts = [prompt(20 + i, 4 + 2 * i) for i in range(5)]
    for i, (ids, sp) in enumerate(zip(prompts, sps)):
        drafter.accept[f"r{i}"] = [i % 4, 3, 1]
        engine.add_request(ids, sp, req_id=f"r{i}")
    max_running = 0
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        slots = {r.req_id: r.slot for r in engine.scheduler.running}
        done |= {o.request_id: o for o in engine.step() if o.finished}
        _check_kv(engine)
        max_running = max(max_running, len(engine.scheduler.running))
        for r in engine.scheduler.running:  # a running request keeps its slot
            assert slots.get(r.req_id, r.slot) == r.slot
    assert max_running == 2
    assert engine.kv.num_used_slots == 0
    for i, (ids, sp) in enumerate(zip(prompts, sps)):
        assert done[f"r{i}"].outputs[0].token_ids == solo(ids, sp, target), i


# ---- draft clipping ------------------------------------------------------------------------------
@pytest.mark.parametrize("ignore_cap", [False, True])
def test_drafts_are_clipped_at_max_tokens(ignore_cap: bool) -> None:
    target = FakeTarget()
    drafter = ScriptedDrafter(target, k=6, ignore_cap=ignore_cap)
    engine = make_engine(target=target, drafter=drafter)
    ids, sp = prompt(3, 4), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request(ids, sp, req_id="r")
    out = run(engine)["r"].outputs[0]
    assert out.token_ids == solo(ids, sp) and out.finish_reason == "length"
    rows = verify_rows(engine, "r")
    for s in rows:  # at most max_tokens - output - 1 drafts: the step's last token is the target's
        assert s.num_drafts <= sp.max_tokens - s.output_pos - 1, s
    assert any(s.num_drafts == sp.max_tokens - s.output_pos - 1 > 0 for s in rows)
    if not ignore_cap:  # the speculator asked for no more than that either
        assert all(cap <= 6 for _, cap, _ in drafter.calls)


@pytest.mark.parametrize("ignore_cap", [False, True])
def test_drafts_are_clipped_at_max_model_len(ignore_cap: bool) -> None:
    target = FakeTarget()
    drafter = ScriptedDrafter(target, k=6, ignore_cap=ignore_cap)
    engine = make_engine(target=target, drafter=drafter, max_model_len=32)
    ids, sp = prompt(4, 19), SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    engine.add_request(ids, sp, req_id="r")
    out = run(engine)["r"].outputs[0]  # FakeRunner asserts no position reaches 32
    assert len(ids) + len(out.token_ids) == 32 and out.finish_reason == "length"
    assert out.token_ids == solo(ids, sp, max_model_len=32)
    rows = verify_rows(engine, "r")
    # the last step's drafts, clipped from 6 to 5, end at the last position a slot holds
    assert rows[-1].num_drafts == 5 and rows[-1].start_pos + len(rows[-1].token_ids) == 32


# ---- the prefill time share ----------------------------------------------------------------------
class FakeClock:
    """The scheduler's perf_counter, moved by the fake runner: a step costs 10 ms plus 1 ms per
    fed token (so a decode-only step of one row costs 11 ms)."""

    def __init__(self) -> None:
        self.now = 100.0

    def step(self, sched: SchedulerOutput) -> None:
        self.now += (10.0 + sched.num_tokens) / 1000.0


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_prefill_time_share_puts_decoding_rows_first_and_bounds_prompt_chunks(
    monkeypatch, share: float
) -> None:
    clock = FakeClock()
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock.now, monotonic=time.monotonic)
    monkeypatch.setattr(scheduler_module, "time", fake_time)
    engine = make_engine(prefill_time_share=share, max_num_batched_tokens=512, max_model_len=128)
    runner(engine).on_execute = clock.step
    sp_a = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    long_prompt = prompt(11, 100)
    engine.add_request(prompt(10, 4), sp_a, req_id="a")
    engine.step()  # a's prefill
    engine.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=2), req_id="b")
    chunks: list[int] = []
    while "b" in engine.requests and len(engine.requests["b"].output_token_ids) == 0:
        a = engine.requests["a"]
        before = len(a.output_token_ids)
        engine.step()
        _check_kv(engine)
        sched = runner(engine).steps[-1].scheduled
        assert sched[0].req_id == "a" and sched[0].needs_logits  # the decoding row first
        assert len(a.output_token_ids) == before + 1  # a's stream never waits for b's prompt
        chunks.append(sum(len(s.token_ids) for s in sched if s.req_id == "b"))
    assert sum(chunks) == len(long_prompt)
    if share == 0.0:  # no share: the whole prompt beside a's row
        assert chunks == [len(long_prompt)]
        return
    # the first step beside decoding decodes alone (what prefill is held against), then chunks
    # whose step costs at most about 1 + BURST decode-only steps (11 ms each), with decode-only
    # steps between that pay them back: on average, the prompt's extra time is the share's
    assert chunks[0] == 0 and len(chunks) >= 7 and 0 in chunks[3:]
    for n in chunks:
        assert 10 + 1 + n <= (1 + BURST) * 11 * 1.25, chunks
    assert sum(chunks) <= share * 11 * (len(chunks) + 1) * 1.25, chunks
    sp_b = engine.requests["b"].sampling
    out = run(engine)
    assert out["b"].outputs[0].token_ids == solo(long_prompt, sp_b, max_model_len=128)


def test_a_step_beside_decoding_reads_one_kind_of_prompt_rows(monkeypatch) -> None:
    """Prompt tokens and prompt-logprob rows cost differently, so each kind's chunks are sized
    apart: a step beside a decoding stream reads rows of one kind only, in arrival order."""
    clock = FakeClock()
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock.now, monotonic=time.monotonic)
    monkeypatch.setattr(scheduler_module, "time", fake_time)
    engine = make_engine(prefill_time_share=1.0, max_num_batched_tokens=512, max_model_len=128)
    runner(engine).on_execute = clock.step
    engine.add_request(prompt(10, 4), SamplingParams(temperature=0.0, max_tokens=60), req_id="a")
    engine.step()  # a's prefill
    rows = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    engine.add_request(prompt(11, 6), rows, req_id="b")  # shorter than a chunk
    engine.add_request(prompt(12, 60), SamplingParams(temperature=0.0, max_tokens=1), req_id="c")
    order = []
    while {"b", "c"} & set(engine.requests):
        engine.step()
        read = {s.req_id for s in runner(engine).steps[-1].scheduled if s.req_id in ("b", "c")}
        assert len(read) <= 1, read
        order += [r for r in read if not order or order[-1] != r]
    assert order == ["b", "c"]


# ---- abort -----------------------------------------------------------------------------------------
def test_abort_mid_run_frees_the_slot_and_leaves_the_others_exact() -> None:
    """Aborted while it holds unverified drafts (a) and mid-prefill (c), and while waiting (d):
    each leaves the scheduler, its slot and the drafter at once, is never scheduled again, its
    slot caches only verified tokens, and b's output is its solo one."""
    target = FakeTarget()
    drafter = ScriptedDrafter(target, k=3)
    engine = make_engine(
        num_slots=3, target=target, drafter=drafter, prefix_caching=True,
        max_num_batched_tokens=12,
    )  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ids = {name: prompt(30 + i, n) for i, (name, n) in enumerate(zip("abcd", (4, 5, 40, 6)))}
    for name in "abcd":
        drafter.accept[name] = [1, 2]
        engine.add_request(ids[name], sp, req_id=name)
    reqs = dict(engine.requests)
    for _ in range(3):
        engine.step()
    a, c, d = reqs["a"], reqs["c"], reqs["d"]
    assert a.draft_token_ids and not a.is_finished  # drafts proposed, not yet verified
    assert 0 < c.num_computed_tokens < len(ids["c"])  # mid-prefill
    assert d in engine.scheduler.waiting
    a_slot, a_computed = a.slot, a.num_computed_tokens
    aborted = engine.abort_output("a")
    engine.abort_request("c")
    engine.abort_request("d")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.kv.num_used_slots == 1 and [r.req_id for r in engine.scheduler.running] == ["b"]
    assert not engine.scheduler.waiting and set(engine.requests) == {"b"}
    assert {"a", "c"} <= set(drafter.removed)
    # a's slot caches its verified tokens only (its pending drafts were never fed)
    assert engine.kv._cached_token_ids[a_slot, :a_computed].tolist() == a.all_token_ids[:a_computed]
    assert int(engine.kv._num_cached[a_slot]) == a_computed
    _check_kv(engine)
    num_steps = len(runner(engine).steps)
    out = run(engine)
    later = [s.req_id for st in runner(engine).steps[num_steps:] for s in st.scheduled]
    assert set(later) == {"b"} and set(out) == {"b"}
    assert out["b"].outputs[0].token_ids == solo(ids["b"], sp, target)
    assert engine.kv.num_used_slots == 0


# ---- n > 1 on one prompt -------------------------------------------------------------------------
def test_n_samples_share_the_prompt_prefix_and_each_equals_its_solo_run() -> None:
    """``LLM.generate`` with n=3: one shared prefill leaves the prompt in the prefix cache, the
    samples read its whole blocks where they are (share_block) and compute only the rest; each
    sample (seed + i) equals its own run alone, speculation and sharing notwithstanding."""
    target = FakeTarget()
    drafter = ScriptedDrafter(target, k=3)
    engine = make_engine(
        num_slots=6, max_num_seqs=4, target=target, drafter=drafter, prefix_caching=True,
        share_block=4,
    )  # fmt: skip
    ids = prompt(40, 18)
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    for i in range(3):
        drafter.accept[f"req-0-{i}"] = [i, 3]
    llm = fake_llm(engine)
    (out,) = llm.generate([ids], sp, use_tqdm=False)
    tokens = [c.token_ids for c in out.outputs]
    assert tokens == [solo(ids, sp.for_sample(i), target) for i in range(3)]
    assert len({tuple(t) for t in tokens}) == 3  # seeded apart
    rows = [s for st in runner(engine).steps for s in st.scheduled]
    fed_prompt = sum(min(s.start_pos + len(s.token_ids), len(ids)) - s.start_pos for s in rows
                     if s.start_pos < len(ids))  # fmt: skip
    assert fed_prompt == len(ids) + 3  # the shared prefill, then each sample's last prompt token
    samples = [s for s in rows if s.req_id.startswith("req-0-")]
    assert all(s.prefix_len == 16 for s in samples)  # 4 whole blocks read where they are
    assert out.spec_decode_stats.num_accepted_tokens > 0
    assert engine.kv.num_used_slots == 0
