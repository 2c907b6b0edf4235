"""row_logprobs works on all rows at once and gives exactly what one row at a time gave (the former
implementation, kept here as the reference), whatever rows share the call; prompt_logprobs are
computed per capped prefill chunk and equal the reference on the model's own logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.outputs import Logprob
from specdec.sample.logprobs import TokenLogprobs, row_logprobs


def _reference(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """The former implementation: one row at a time, on one thread."""
    out: list[TokenLogprobs] = []
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for r, token in enumerate(token_ids):
            lp = logits[r].float().log_softmax(dim=-1)
            chosen = lp[token]
            rank = int((lp > chosen).sum()) + 1
            ids: list[int] = []
            values: list[float] = []
            if num_top:
                top_values, top_ids = lp.topk(min(num_top, lp.numel()))
                ids, values = top_ids.tolist(), top_values.tolist()
            out.append(TokenLogprobs(token, float(chosen), rank, ids, values))
    finally:
        torch.set_num_threads(num)
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 9),  # rows
    st.integers(2, 40),  # vocabulary
    st.integers(0, 20),  # num_top
    st.booleans(),  # bfloat16 logits
    st.data(),
)
def test_rows_at_once_equal_one_row_at_a_time(num_rows, vocab, num_top, bf16, data) -> None:
    # few distinct values: ties at every rank
    values = data.draw(st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, 7.25]),
                                min_size=num_rows * vocab, max_size=num_rows * vocab))  # fmt: skip
    logits = torch.tensor(values).reshape(num_rows, vocab)
    if bf16:
        logits = logits.to(torch.bfloat16)
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=num_rows, max_size=num_rows))
    assert row_logprobs(logits, tokens, num_top) == _reference(logits, tokens, num_top)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_does_not_depend_on_the_rows_beside_it(threads) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 49152, generator=g) * 4
    logits[:, 100:160] = logits[:, :1]  # a block of exact ties
    tokens = torch.randint(0, 49152, (37,), generator=g).tolist()
    tokens[3] = 120
    num = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        every = row_logprobs(logits, tokens, 20)
        assert row_logprobs(logits[5:6], tokens[5:6], 20) == every[5:6]
        assert row_logprobs(logits[:9], tokens[:9], 20) == every[:9]
    finally:
        torch.set_num_threads(num)
    assert every == _reference(logits, tokens, 20)
    assert row_logprobs(logits[:0], [], 3) == []


def test_prompt_logprobs_per_capped_chunk_equal_the_reference(tiny_llama) -> None:
    # NOTE: no time share (engine/fair_share.py): the chunks are the row cap's alone
    llm = LLM(str(tiny_llama), max_model_len=256, max_num_batched_tokens=128, prefill_time_share=0)
    engine = llm.engine
    assert engine.scheduler.max_prompt_logprob_rows == 16
    ids = [(7 * i + 3) % 200 + 5 for i in range(150)]
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5)
    rid = engine.add_request(ids, sp)
    engine.step()  # alone: the whole budget
    other = engine.add_request("the cat sat", SamplingParams(max_tokens=40, ignore_eos=True))
    fed, built = [], []
    while not engine.requests[rid].output_token_ids:
        fed.append(engine.requests[rid].num_computed_tokens)
        built.append(len(engine.output_processor._logprob_dicts[rid].prompt) - 1)
        engine.step()
    # beside another request, the rest in chunks of the cap (16), each chunk's dicts built in
    # its own step
    assert fed == [128, 144] and built == [128, 144]
    engine.abort_request(rid)
    engine.abort_request(other)
    out = llm.generate([ids], sp)[0]
    # the reference: one forward over the whole prompt, rows one at a time
    ref = LLM(str(tiny_llama), max_model_len=256, enable_prefix_caching=False)
    rows = _reference(_model_logits(ref, ids)[:-1], ids[1:], 5)
    tok = llm.get_tokenizer()
    expected = [None] + [list(_dict(t, tok).items()) for t in rows]
    assert [d and list(d.items()) for d in out.prompt_logprobs] == expected  # in order


def _dict(t: TokenLogprobs, tok) -> dict:  # noqa: ANN001
    """vLLM's dict: the prompt token first, then the top-N (without it) by rank."""
    text = lambda i: tok.decode([i], skip_special_tokens=False)  # noqa: E731
    out = {t.token_id: Logprob(t.logprob, t.rank, text(t.token_id))}
    for rank, (i, lp) in enumerate(zip(t.top_token_ids, t.top_logprobs), start=1):
        out.setdefault(i, Logprob(lp, rank, text(i)))
    return out


def _model_logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [len(ids), V]
    from specdec.model.llama import SeqBatch

    model, kv = llm.engine.model, llm.engine.kv
    slot = kv.allocate()
    with torch.inference_mode():
        hidden = model.forward(
            torch.tensor(ids), torch.arange(len(ids)), SeqBatch([slot], [0], [len(ids)]), kv
        )
        logits = model.compute_logits(hidden)
    kv.free(slot)
    return logits
