"""Automatic prefix caching: greedy outputs never change, only the prefill that is skipped."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.engine.llm_engine import LLMEngine
from specdec.kv_cache.pool import KVCache
from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer

MAX_LEN = 256
SHARED = "You are a careful assistant. Answer in one short line, and think first. " * 2
PROMPTS = [
    SHARED + "What is the cat doing?",
    SHARED + "Where is the mat?",
    "the cat sat on the mat and the cat sat on the",
    SHARED + "What is the cat doing? And the dog?",
]


def _greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _llm(model, caching: bool = True, **kw) -> LLM:
    kw = {"max_model_len": MAX_LEN, "max_num_batched_tokens": 32} | kw
    return LLM(str(model), enable_prefix_caching=caching, **kw)


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    return _llm(tiny_llama, caching=False)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _one_by_one(llm: LLM, prompts: list[str], sp: SamplingParams):
    return [llm.generate([p], sp)[0] for p in prompts]


# ---- exactness ----------------------------------------------------------------------------------
def _count_fed_tokens(llm: LLM) -> list[int]:
    """Tokens the target runs over, per step (the runner is wrapped)."""
    runner, fed = llm.engine.runner, []
    execute = runner.execute_model

    def counting(sched):
        fed.append(sched.num_tokens)
        return execute(sched)

    runner.execute_model = counting
    return fed


def test_same_prompt_twice(tiny_llama, plain) -> None:
    llm = _llm(tiny_llama)
    fed = _count_fed_tokens(llm)
    sp = _greedy(24)
    first = llm.generate([PROMPTS[0]], sp)[0]
    num_prompt = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0 and sum(fed) == num_prompt + 23
    fed.clear()
    second = llm.generate([PROMPTS[0]], sp)[0]
    assert second.num_cached_tokens == num_prompt - 1
    assert sum(fed) == 1 + 23  # only the last prompt token is prefilled
    ref = plain.generate([PROMPTS[0]], sp)[0]
    assert _ids([first, second]) == _ids([ref, ref])


def test_prompts_sharing_a_long_prefix(tiny_llama, plain) -> None:
    llm = _llm(tiny_llama)
    sp = _greedy(20)
    got = _one_by_one(llm, PROMPTS, sp)
    assert _ids(got) == _ids(_one_by_one(plain, PROMPTS, sp))
    shared = len(llm.get_tokenizer().encode(SHARED))
    assert got[1].num_cached_tokens >= shared - 1
    assert got[2].num_cached_tokens == 0
    # PROMPTS[3] extends PROMPTS[0]: everything PROMPTS[0]'s slot held is reused
    assert got[3].num_cached_tokens >= len(got[0].prompt_token_ids) - 1


def test_requests_joining_at_different_steps(tiny_llama, plain) -> None:
    """Batches mix cached and cold prefills with decoding; the same prompt can run twice at once."""
    sp = [_greedy(10 + 3 * i) for i in range(6)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[1]]
    expected = {}
    for i, (p, s) in enumerate(zip(prompts, sp)):
        expected[i] = plain.generate([p], s)[0].outputs[0].token_ids
    llm = _llm(tiny_llama, max_num_seqs=3)
    llm.generate([PROMPTS[0]], _greedy(5))  # something in the cache before the batch
    engine = llm.engine
    ids, got, cached = {}, {}, {}
    step = 0
    while len(got) < len(prompts):
        if step < len(prompts):  # one new request per step
            ids[engine.add_request(prompts[step], sp[step])] = step
        for out in engine.step():
            if out.finished:
                got[ids[out.request_id]] = out.outputs[0].token_ids
                cached[ids[out.request_id]] = out.num_cached_tokens
        step += 1
    assert got == expected
    assert cached[0] > 0 and cached[2] > 0
    assert engine.kv.num_used_slots == 0 and engine.kv_cache_usage == 0.0


def _spec_configs(tiny_llama, tiny_draft) -> dict[str, dict]:
    fixed = {"adaptive": False}
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3} | fixed,
        "suffix": {"method": "suffix", "num_speculative_tokens": 4} | fixed,
        "draft_model": {
            "method": "draft_model",
            "model": str(tiny_draft),
            "num_speculative_tokens": 3,
        }
        | fixed,  # fmt: skip
        "draft_self": {
            "method": "draft_model",
            "model": str(tiny_llama),
            "num_speculative_tokens": 4,
        }
        | fixed,  # fmt: skip
        "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 2}
        | fixed,  # fmt: skip
    }


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "draft_self", "layer_skip"])
def test_speculative_with_caching_equals_plain_without(
    method: str, tiny_llama, tiny_draft, plain
) -> None:
    spec = _spec_configs(tiny_llama, tiny_draft)[method]
    llm = _llm(tiny_llama, speculative_config=spec, max_num_seqs=2)
    prompts = PROMPTS + PROMPTS[::-1]
    sp = [_greedy(12 + 5 * i) for i in range(len(prompts))]
    # two at a time, so a new request's prefix comes from a slot another request just freed
    got = llm.generate(prompts, sp)
    ref = [plain.generate([p], s)[0] for p, s in zip(prompts, sp)]
    assert _ids(got) == _ids(ref)
    assert sum(o.num_cached_tokens for o in got) > 0
    stats = llm.spec_decode_stats
    assert stats.num_drafts > 0
    if method == "draft_self":  # the target drafting for itself: a wrong draft KV would show here
        assert stats.num_accepted_tokens == stats.num_draft_tokens


# ---- what may be reused ---------------------------------------------------------------------------
class _ScriptedProposer(Proposer):
    """Drafts the known greedy continuation, wrong from position ``num_right`` on."""

    def __init__(self, reference: list[int], num_prompt: int, num_right: int, k: int) -> None:
        self.reference, self.num_prompt, self.num_right, self.k = (
            reference,
            num_prompt,
            num_right,
            k,
        )

    def propose(self, inp: DraftInput) -> DraftOutput:
        drafts = []
        for r in inp.requests:
            done = len(r.token_ids) - self.num_prompt
            right = self.reference[done : done + min(self.num_right, r.max_num_drafts)]
            wrong = [(t + 1) % 200 for t in self.reference[done + len(right) :]]
            drafts.append((right + wrong)[: min(self.k, r.max_num_drafts)])
        return DraftOutput(drafts, [None] * len(drafts))


def _first_new(ref: list[int], indices) -> int:
    """The first index whose token did not occur before it (so stopping on it stops there)."""
    return next(i for i in indices if ref[i] not in ref[:i])


def test_never_reuses_stale_kv_past_num_computed(tiny_llama, plain) -> None:
    """A request that stops on the token recovered from a rejected draft leaves that draft's KV
    in the slot, at the position of its last token; a prompt extending it must not trust it."""
    prompt = PROMPTS[2]
    ref = plain.generate([prompt], _greedy(40))[0].outputs[0].token_ids
    llm = _llm(
        tiny_llama, speculative_config={"method": "ngram", "adaptive": False}, max_num_seqs=1
    )
    engine: LLMEngine = llm.engine
    num_prompt = len(llm.get_tokenizer().encode(prompt))
    # Each step verifies [right, wrong]: the recovered tokens are ref[2], ref[4], ...
    engine.speculator.proposer = _ScriptedProposer(ref, num_prompt, num_right=1, k=2)
    stop = _first_new(ref, range(2, 40, 2))
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[ref[stop]])
    req_id = engine.add_request(prompt, sp)
    req = engine.requests[req_id]
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids == ref[: stop + 1] and req.finish_reason == "stop"
    assert req.num_computed_tokens == req.num_tokens - 1
    assert req.spec_stats.num_accepted_tokens == req.spec_stats.num_drafts  # one of two each step
    slot = int(next(s for s in engine.kv._free if engine.kv._num_cached[s]))
    assert engine.kv._num_cached[slot] == req.num_computed_tokens
    assert (
        list(engine.kv._cached_token_ids[slot, : req.num_computed_tokens])
        == (req.all_token_ids[: req.num_computed_tokens])
    )
    # a prompt that extends the whole sequence reuses exactly num_computed_tokens
    engine.speculator.enabled = False
    longer = req.all_token_ids + ref[stop + 1 : stop + 4]
    out = llm.generate([longer], _greedy(12))[0]
    assert out.num_cached_tokens == req.num_computed_tokens
    assert out.outputs[0].token_ids == plain.generate([longer], _greedy(12))[0].outputs[0].token_ids


def test_stop_inside_an_accepted_run_caches_only_real_tokens(tiny_llama, plain) -> None:
    """num_computed_tokens passes the last token when a stop lands inside accepted drafts."""
    prompt = PROMPTS[2]
    ref = plain.generate([prompt], _greedy(40))[0].outputs[0].token_ids
    llm = _llm(
        tiny_llama, speculative_config={"method": "ngram", "adaptive": False}, max_num_seqs=1
    )
    engine = llm.engine
    num_prompt = len(llm.get_tokenizer().encode(prompt))
    engine.speculator.proposer = _ScriptedProposer(ref, num_prompt, num_right=5, k=5)
    stop = _first_new(ref, range(1, 5))  # the first step drafts ref[1..5], all right
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[ref[stop]])
    req_id = engine.add_request(prompt, sp)
    req = engine.requests[req_id]
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids == ref[: stop + 1]
    assert req.num_computed_tokens > req.num_tokens
    slot = int(next(s for s in engine.kv._free if engine.kv._num_cached[s]))
    assert engine.kv._num_cached[slot] == req.num_tokens
    engine.speculator.enabled = False
    longer = req.all_token_ids + [ref[0]]
    out = llm.generate([longer], _greedy(8))[0]
    assert out.num_cached_tokens == req.num_tokens
    assert out.outputs[0].token_ids == plain.generate([longer], _greedy(8))[0].outputs[0].token_ids


def test_reuse_stops_before_the_last_prompt_token(tiny_llama, plain) -> None:
    llm = _llm(tiny_llama)
    long_out = llm.generate([PROMPTS[3]], _greedy(8))[0]
    prefix = long_out.prompt_token_ids[:20]  # a prompt wholly inside the cached sequence
    out = llm.generate([prefix], _greedy(8))[0]
    assert out.num_cached_tokens == len(prefix) - 1
    assert out.outputs[0].token_ids == plain.generate([prefix], _greedy(8))[0].outputs[0].token_ids
    one = llm.generate([prefix[:1]], _greedy(4))[0]  # one token: nothing can be reused
    assert one.num_cached_tokens == 0


def test_abort_mid_generation_then_resubmit(tiny_llama, plain) -> None:
    llm = _llm(tiny_llama, max_num_batched_tokens=16)
    engine = llm.engine
    sp = _greedy(20)
    a = engine.add_request(PROMPTS[0], sp)
    engine.step()  # half-way through the prompt (chunks of 16)
    computed = engine.requests[a].num_computed_tokens
    assert 0 < computed < len(engine.requests[a].prompt_token_ids)
    engine.abort_request(a)
    mid = llm.generate([PROMPTS[0]], sp)[0]
    assert mid.num_cached_tokens == computed
    b = engine.add_request(PROMPTS[1], sp)
    for _ in range(8):  # prefilled and a few tokens decoded
        engine.step()
    assert engine.requests[b].output_token_ids
    engine.abort_request(b)
    again = llm.generate([PROMPTS[1]], sp)[0]
    assert again.num_cached_tokens == len(again.prompt_token_ids) - 1
    assert _ids([mid, again]) == _ids(_one_by_one(plain, PROMPTS[:2], sp))
    assert engine.kv.num_used_slots == 0


# ---- slots and eviction -------------------------------------------------------------------------
def _slot_bytes(llm: LLM) -> int:
    cfg = llm.engine.model.cfg
    per_token = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, llm.engine.model.kv_dtype)  # fmt: skip
    return per_token * MAX_LEN


def test_slot_counts(tiny_llama) -> None:
    off = _llm(tiny_llama, caching=False, max_num_seqs=2)
    assert off.engine.kv.num_slots == 2 and not off.engine.kv.enable_prefix_caching
    on = _llm(tiny_llama, max_num_seqs=2)
    assert on.engine.scheduler.max_num_seqs == 2
    assert on.engine.kv.num_slots == 2 + 32  # DEFAULT_PREFIX_CACHE_SLOTS
    budget = 5 * _slot_bytes(on)
    assert _llm(tiny_llama, max_num_seqs=2, kv_cache_memory=budget).engine.kv.num_slots == 5
    assert (
        _llm(tiny_llama, caching=False, max_num_seqs=2, kv_cache_memory=budget).engine.kv.num_slots
        == 2
    )
    # running sequences stay limited by max_num_seqs with extra cache slots
    llm = _llm(tiny_llama, max_num_seqs=2, max_num_batched_tokens=512)
    ids = [llm.engine.add_request(p, _greedy(4)) for p in PROMPTS]
    llm.engine.step()
    assert llm.engine.num_running == 2 and llm.engine.kv_cache_usage == 1.0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert len(ids) == 4 and llm.engine.kv.num_used_slots == 0 and llm.engine.kv_cache_usage == 0


def test_lru_eviction_when_slots_run_out(tiny_llama, plain) -> None:
    probe = _llm(tiny_llama, caching=False)
    # one running slot and two cache slots
    llm = _llm(tiny_llama, max_num_seqs=1, kv_cache_memory=3 * _slot_bytes(probe))
    assert llm.engine.kv.num_slots == 3
    a, b, c, d = "alpha beta gamma", "one two three", "xyz xyz xyz", "Zebra zebra zebra"
    sp = _greedy(6)

    def cached(prompt: str) -> int:
        return llm.generate([prompt], sp)[0].num_cached_tokens

    # no two share a first token: each goes to an empty or the least recently used slot
    assert [cached(p) for p in (a, b, c)] == [0, 0, 0]
    assert cached(c) > 0  # c is now the most recently used
    assert cached(d) == 0  # evicts a, the least recently used
    assert cached(a) == 0  # evicted; a now evicts b
    assert cached(c) > 0
    assert cached(d) > 0
    assert cached(b) == 0


def test_shared_prefix_does_not_evict_the_other_prompt(tiny_llama) -> None:
    """Two prompts sharing a system prompt both stay cached (the prefix is copied, not taken)."""
    llm = _llm(tiny_llama)
    sp = _greedy(6)
    first = llm.generate([PROMPTS[0]], sp)[0]
    second = llm.generate([PROMPTS[1]], sp)[0]
    assert 0 < second.num_cached_tokens < len(first.prompt_token_ids) - 1
    again = llm.generate([PROMPTS[0]], sp)[0]
    assert again.num_cached_tokens == len(first.prompt_token_ids) - 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    again1 = llm.generate([PROMPTS[1]], sp)[0]
    assert again1.num_cached_tokens == len(second.prompt_token_ids) - 1
    assert again1.outputs[0].token_ids == second.outputs[0].token_ids


def test_caching_off_reuses_nothing(tiny_llama) -> None:
    llm = _llm(tiny_llama, caching=False)
    outs = _one_by_one(llm, [PROMPTS[0]] * 2, _greedy(4))
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert llm.engine.num_prefix_cache_queries == llm.engine.num_prefix_cache_hits == 0


def test_reset_prefix_cache(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    llm.generate([PROMPTS[0]], _greedy(4))
    llm.engine.reset_prefix_cache()
    assert llm.generate([PROMPTS[0]], _greedy(4))[0].num_cached_tokens == 0


# ---- stats ----------------------------------------------------------------------------------------
def test_counters_and_prometheus(tiny_llama) -> None:
    from specdec.metrics import EngineMetrics

    llm = _llm(tiny_llama)
    engine = llm.engine
    metrics = EngineMetrics("tiny")
    first, second = _one_by_one(llm, [PROMPTS[0]] * 2, _greedy(4))
    metrics.update(engine)
    n = len(first.prompt_token_ids)
    assert engine.num_prefix_cache_queries == 2 * n
    assert engine.num_prefix_cache_hits == second.num_cached_tokens == n - 1
    text = metrics.render().decode()
    assert f'specdec:prefix_cache_queries_total{{model_name="tiny"}} {2.0 * n}' in text
    assert f'specdec:prefix_cache_hits_total{{model_name="tiny"}} {float(n - 1)}' in text
    assert 'specdec:kv_cache_usage_perc{model_name="tiny"} 0.0' in text


# ---- flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, expected", [([], True), (["--no-enable-prefix-caching"], False),
                                            (["--enable-prefix-caching"], True)])  # fmt: skip
def test_cli_flags(monkeypatch, flag: list[str], expected: bool) -> None:
    from specdec import cli
    from specdec.bench import cli as bench_cli
    from specdec.bench import serve as bench_serve
    from specdec.entrypoints.openai import api_server

    seen = []

    def record(args) -> int:
        seen.append(args.enable_prefix_caching)
        return 0

    monkeypatch.setattr(cli, "cmd_generate", record)
    monkeypatch.setattr(api_server, "cmd_serve", record)
    monkeypatch.setattr(bench_cli, "cmd_latency", record)
    monkeypatch.setattr(bench_serve, "cmd_bench_serve", record)
    for argv in (["generate"], ["serve", "m"], ["bench", "latency", "--dataset", "d"],
                 ["bench", "serve", "--dataset", "d"]):  # fmt: skip
        assert cli.main([*argv, *flag]) == 0
    assert seen == [expected] * 4


def test_generate_compare_plain_smoke(tiny_llama, capsys) -> None:
    from specdec import cli

    argv = ["generate", "--model", str(tiny_llama), "--prompt", "the cat sat on the mat", "-n",
            "6", "--quiet", "--compare-plain", "--speculative-config", '{"method": "ngram"}']  # fmt: skip
    assert cli.main(argv) == 0
    assert "output identical to plain: yes" in capsys.readouterr().out


def test_generate_takes_the_model_positionally_and_chats_by_default(
    tiny_llama, tmp_path, monkeypatch, capsys
) -> None:
    """`specdec generate MODEL` as `serve MODEL`; the prompt goes through the model's chat template
    unless --no-chat; a model without one gets the prompt as it is, and --chat there is a one-line
    error naming --chat-template."""
    from specdec import cli
    from specdec.llm import LLM
    from tests.fixtures.models import with_chat_template

    seen: list[list[int]] = []
    real = cli._run_one

    def record(llm, prompt_ids, sp, stream):
        seen.append(list(prompt_ids))
        return real(llm, prompt_ids, sp, stream)

    monkeypatch.setattr(cli, "_run_one", record)
    tok = LLM(str(tiny_llama), max_model_len=64).get_tokenizer()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True
    )
    base = ["-p", "hi", "-n", "2", "--quiet"]
    assert cli.main(["generate", str(tiny_llama), *base]) == 0
    assert seen[-1] == chat
    assert cli.main(["generate", str(tiny_llama), "--no-chat", *base]) == 0
    assert seen[-1] == tok.encode("hi")
    plain = with_chat_template(tiny_llama, tmp_path, None)
    assert cli.main(["generate", str(plain), *base]) == 0
    assert seen[-1] == tok.encode("hi")
    capsys.readouterr()
    assert cli.main(["generate", str(plain), "--chat", *base]) == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and err.count("\n") == 1
