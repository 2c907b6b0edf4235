"""Prompt reading beside decoding (engine/fair_share.py): the chunk the time share allows, learnt
from step times; the scheduler feeding decoding rows first and at most that chunk of prompt
tokens; and outputs identical whatever the chunks."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.config import ConfigError
from specdec.engine.fair_share import (
    BURST,
    DECODE_WINDOW,
    FIRST_CHUNK,
    GAP,
    MIN_CHUNK,
    REFRESH_STEPS,
    PrefillShare,
)


def test_off_or_alone_a_step_takes_the_whole_budget() -> None:
    assert PrefillShare(0.0).budget(512, decoding=True) == 512
    assert PrefillShare(1.0).budget(512, decoding=False) == 512


def test_a_step_decodes_alone_first_then_reads_a_chunk() -> None:
    share = PrefillShare(1.0)
    assert share.budget(512, decoding=True) == 0  # nothing measured yet: decode alone
    share.observe(0, True, 5.0)
    assert share.decode_ms == 5.0
    assert share.budget(512, decoding=True) == FIRST_CHUNK
    assert share.budget(8, decoding=True) == 8  # never past the token budget


def test_the_chunk_moves_toward_a_burst_of_the_decode_time() -> None:
    share = PrefillShare(1.0)
    share.observe(0, True, 5.0)
    # 1.25 ms a prompt token: BURST decode steps of 5 ms hold BURST * 4 tokens
    for _ in range(12):
        share.observe(share.chunk, True, 5.0 + 1.25 * share.chunk)
    assert abs(share.chunk - BURST * 4) <= 1 and share.chunk >= MIN_CHUNK
    # cheap prompt tokens: the chunk grows, at most doubling a step
    before = share.chunk
    share.observe(before, True, 5.0 + 0.01 * before)
    assert share.chunk == 2 * before
    # a share above BURST: the share itself, every step
    share4 = PrefillShare(4.0)
    share4.observe(0, True, 6.0)
    for _ in range(20):
        share4.observe(share4.chunk, True, 6.0 + 0.5 * share4.chunk)
    assert abs(share4.chunk - 48) <= 3  # 0.5 ms a token, 24 ms allowed


def _simulate(share: PrefillShare, steps: int, decode_ms: float, token_ms: float) -> list[int]:
    """Prompt tokens each step reads beside decoding, its time decode_ms + token_ms a token."""
    fed = []
    for _ in range(steps):
        n = share.budget(10_000, decoding=True)
        share.observe(n, True, decode_ms + token_ms * n)
        fed.append(n)
    return fed


@pytest.mark.parametrize("value", [0.25, 1.0, 2.0, 4.0])
def test_the_prompt_takes_its_share_on_average_in_bursts(value: float) -> None:
    """The token bucket: the prompt's extra time over many steps is the share of the decoding's
    time, and no step takes more than 1 + max(share, BURST) decode steps (within the learning)."""
    share = PrefillShare(value)
    fed = _simulate(share, 400, 5.0, 1.25)[100:]  # past the learning
    extra = 1.25 * sum(fed)
    assert extra == pytest.approx(value * 5.0 * len(fed), rel=0.15)
    assert max(fed) * 1.25 <= max(value, BURST) * 5.0 * 1.3
    if value < BURST:  # chunks with decode-only steps between them that pay them back
        assert fed.count(0) >= len(fed) * (1 - value / BURST) * 0.8
    if value <= BURST / 2:
        assert all(a == 0 or b == 0 for a, b in zip(fed, fed[1:]))


def test_a_decode_only_step_comes_back_to_refresh_the_average() -> None:
    share = PrefillShare(1.0)
    share.observe(0, True, 5.0)
    for _ in range(REFRESH_STEPS):
        assert share.budget(512, decoding=True) > 0
        share.observe(share.chunk, True, 10.0)
    assert share.budget(512, decoding=True) == 0
    share.observe(0, True, 7.0)
    assert share.decode_ms == pytest.approx(6.0)  # the median of 5 and 7
    assert share.budget(512, decoding=True) > 0


def test_a_slow_decode_step_does_not_inflate_the_chunks() -> None:
    """The steps in which a server takes a long prompt in run 2-3x a decode step: the chunks are
    sized from the median decode step, so one or two such steps change neither."""
    share = PrefillShare(1.0)
    for _ in range(DECODE_WINDOW):
        share.observe(0, True, 5.0)
    share.observe(0, True, 14.0)
    share.observe(0, True, 11.0)
    assert share.decode_ms == pytest.approx(5.0)
    for _ in range(40):  # chunks of 0.5 ms a prompt token: BURST decode steps is 25 tokens
        n = share.budget(512, decoding=True)
        share.observe(n, True, 5.0 + 0.5 * n) if n else share.observe(0, True, 5.0)
    assert share.chunk == pytest.approx(BURST * 5.0 / 0.5, rel=0.15)


def test_steps_without_decoding_or_with_bad_times_teach_nothing() -> None:
    share = PrefillShare(1.0)
    share.observe(512, False, 400.0)
    share.observe(0, True, float("nan"))
    share.observe(0, True, -1.0)
    assert share.decode_ms is None and share.chunk == FIRST_CHUNK


def _long_prompt() -> str:
    return " ".join(f"word{i % 89} thing{i % 13}" for i in range(30))


def _prompt_steps(tiny_llama, share: float) -> list[int]:
    """Prompt tokens each step reads of a long prompt arriving beside a decoding request (steps
    run as LLMEngine.step runs them, untimed: the chunk stays the first one)."""
    llm = LLM(str(tiny_llama), max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
              prefill_time_share=share)  # fmt: skip
    engine, sched = llm.engine, llm.engine.scheduler
    engine.add_request("the cat sat", SamplingParams(max_tokens=200, ignore_eos=True), "dec")
    for _ in range(4):
        engine.step()  # a prefill, then decode-only steps: the decode time is known
    engine.add_request(_long_prompt(), SamplingParams(max_tokens=4, ignore_eos=True), "long")
    prompt_len = len(engine.requests["long"].prompt_token_ids)
    assert prompt_len > 256
    seen = []
    while engine.requests["long"].num_computed_tokens < prompt_len:
        out = sched.schedule()
        sched._step = None  # untimed
        assert out.scheduled[0].req_id == "dec" and len(out.scheduled[0].token_ids) == 1
        seen.append(sum(len(s.token_ids) for s in out.scheduled if s.req_id == "long"))
        sched.update_from_output(out, engine.executor.execute_model(out).results, engine.requests)
    assert sum(seen) == prompt_len
    return seen


def test_scheduler_feeds_decoding_rows_first_and_a_bounded_prompt_chunk(tiny_llama) -> None:
    bounded = _prompt_steps(tiny_llama, 1.0)
    assert all(n == FIRST_CHUNK for n in bounded[:-1]) and 0 < bounded[-1] <= FIRST_CHUNK
    # no time limit: the prompt takes the rest of the token budget
    assert _prompt_steps(tiny_llama, 0.0)[0] == 255


def test_outputs_are_the_same_whatever_the_share(tiny_llama) -> None:
    prompts = ["the cat sat on the mat", _long_prompt(), "Once upon a time"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = {}
    for share in (0.0, 1.0, 0.25):
        llm = LLM(str(tiny_llama), max_model_len=512, max_num_batched_tokens=64,
                  prefill_time_share=share)  # fmt: skip
        got[share] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got[1.0] == got[0.0] and got[0.25] == got[0.0]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1"])
def test_a_bad_share_is_refused(tiny_llama, bad) -> None:
    with pytest.raises(ConfigError, match="prefill_time_share"):
        LLM(str(tiny_llama), prefill_time_share=bad)


def test_the_chunk_follows_the_batch_it_is_read_beside() -> None:
    """A batch of two decoding requests steps slower (9 ms) than one stream alone (5 ms): a
    chunk step beside either holds BURST of the lone stream's steps, within GAP of them in all,
    so a stream waits at most that many of its idle steps whatever decodes beside it; and a batch
    size not timed yet first decodes alone once."""
    share = PrefillShare(1.0)
    for _ in range(DECODE_WINDOW):
        share.observe(0, 1, 5.0)
    assert share.budget(512, decoding=2) == 0  # two decoding requests: not timed yet
    for _ in range(DECODE_WINDOW):
        share.observe(0, 2, 9.0)
    for _ in range(30):  # 0.5 ms a prompt token beside two requests
        n = share.budget(512, decoding=2)
        share.observe(n, 2, 9.0 + 0.5 * n) if n else share.observe(0, 2, 9.0)
    assert share.decode_ms == pytest.approx(9.0)
    assert share.chunk == pytest.approx(min(BURST * 5.0, GAP * 5.0 - 9.0) / 0.5, rel=0.15)
    while not (n := share.budget(512, decoding=1)):  # back to one stream, once paid back
        share.observe(0, 1, 5.0)
    assert share.decode_ms == pytest.approx(5.0)
    assert n == pytest.approx(BURST * 5.0 / 0.5, rel=0.15)


def test_a_loaded_machine_does_not_stretch_the_chunk_steps() -> None:
    """The decode-only steps around the chunks run slower under a server's load (7 ms) than the
    same stream's quick steps (5 ms): a chunk step still takes at most GAP of the quick steps,
    not BURST of the slow ones on top of a slow one."""
    share = PrefillShare(1.0)
    for _ in range(40):
        share.observe(0, 1, 5.0)
    for _ in range(DECODE_WINDOW):
        share.observe(0, 1, 7.0)
    assert share.decode_ms == pytest.approx(7.0) and share.quick_ms == pytest.approx(5.0)
    steps = []
    for _ in range(60):  # 0.5 ms a prompt token beside the stream
        n = share.budget(512, decoding=1)
        ms = 7.0 + 0.5 * n
        share.observe(n, 1, ms)
        steps.append(ms)
    assert max(steps) <= GAP * 5.0 * 1.05
    assert share.chunk == pytest.approx((GAP * 5.0 - 7.0) / 0.5, rel=0.15)


def test_prompt_tokens_and_prompt_logprob_rows_are_priced_apart() -> None:
    """A prompt-logprob row costs more than a prompt token (every row's logits are kept): a chunk
    of either kind is sized from its own time per token, however the two alternate."""
    share = PrefillShare(1.0)
    for _ in range(DECODE_WINDOW):
        share.observe(0, 1, 5.0)
    per_token = {"prompt": 0.5, "logprobs": 1.25}
    for i in range(60):
        kind = "prompt" if (i // 3) % 2 else "logprobs"
        n = share.budget(512, 1, kind)
        if n:
            share.observe(n, 1, 5.0 + per_token[kind] * n, kind)
        else:
            share.observe(0, 1, 5.0)
    for kind, ms in per_token.items():
        share.observe(0, 1, 5.0)
        assert share.budget(512, 1, kind) == pytest.approx(BURST * 5.0 / ms, rel=0.15)
