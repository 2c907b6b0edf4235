"""Accepted drafts a stop cuts off are not counted: the per-token provenance the engine streams
and its per-request statistics agree, also when a stop token ends an accepted run (issue 35)."""

from __future__ import annotations

from specdec import LLM, SamplingParams

ECHO = "Repeat exactly: <script>alert(1)</script> <img src=x onerror=alert(2)> the end. " * 2


def _run(llm: LLM, sp: SamplingParams) -> tuple[list[int], list[bool], int]:
    engine = llm.engine
    messages = [{"role": "user", "content": ECHO}]
    prompt = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    engine.add_request(engine.tokenizer.encode(prompt, add_special_tokens=False), sp)
    flags: list[bool] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            flags += [p.from_draft for p in out.delta_provenance]
            final = out
    assert final is not None and final.finished
    return final.outputs[0].token_ids, flags, final.spec_decode_stats.num_accepted_tokens


def test_stop_inside_accepted_run_keeps_counts_equal():
    # suffix decoding: its global tree learns from the earlier runs, so long accepted runs follow
    llm = LLM("smollm2-135m", {"method": "suffix", "adaptive": False})
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    tokens, flags, accepted = _run(llm, sp)
    assert len(flags) == len(tokens) and sum(flags) == accepted > 0
    # stop at tokens that came as accepted drafts: some end a run whose later drafts were
    # accepted too (those must not be counted)
    for pos in [i for i, f in enumerate(flags) if f][:12]:
        sp = SamplingParams(
            temperature=0, max_tokens=96, ignore_eos=True, stop_token_ids=[tokens[pos]]
        )
        out_tokens, out_flags, out_accepted = _run(llm, sp)
        assert len(out_flags) == len(out_tokens)
        assert sum(out_flags) == out_accepted, pos
