"""What a long prompt read beside a decoding stream costs each of them, in one process (the
engine's own steps, no server): the stream's time between tokens while the prompt is read, against
the stream alone, and the prompt's time to first token, against the prompt alone.

For each ``--shares`` value (``--prefill-time-share``; 0: no limit), alternating, ``--rounds``
times: the stream (greedy, ``--stream-tokens``) decodes alone; the prompt (``--prompt-tokens``
tokens of this repository's prose, a fresh first word each time so that nothing comes from the
prefix cache; one output token) is read alone; then the stream starts, decodes a few tokens, and
the prompt arrives beside it. Reported: the stream's median and longest gap between tokens while
the prompt is read, over its median alone ("x idle": the median of its first 64 gaps alone), the
prompt's time to first token over its time alone (the issue's fair-share goal with one stream: at
most 2x), and the longest gap of the stream alone over as many tokens (what this machine's own
pauses give a stream with no prompt beside it). With
``--prompt-logprobs N`` the prompt asks for its rows' top-N log-probabilities (every row's logits).

    .venv/bin/python benchmarks/prefill_share.py --model smollm2-135m --shares 1 0 --rounds 2
    PYTHONPATH=../older-checkout .venv/bin/python benchmarks/prefill_share.py ...  # before/after

Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _prompt(llm: LLM, tokens: int, tag: int) -> list[int]:
    tok = llm.get_tokenizer()
    text = (ROOT / "README.md").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < tokens:
        ids += ids
    head = tok.encode(f"Draft{tag} ", add_special_tokens=False)
    return (head + ids)[:tokens]


def _stream_alone(engine, n: int, tag: str) -> list[float]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    engine.add_request("Once upon a time", sp, f"s-{tag}")
    stamps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == f"s-{tag}":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _prompt_params(prompt_logprobs: int | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=prompt_logprobs)


def _prompt_alone(engine, ids: list[int], tag: str, plp: int | None) -> float:
    start = time.perf_counter()
    engine.add_request(ids, _prompt_params(plp), f"p-{tag}")
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _together(
    engine, n: int, ids: list[int], tag: str, plp: int | None
) -> tuple[list[float], float]:
    """The stream's gaps while the prompt is read, and the prompt's time to first token."""
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    sid, pid = f"s-{tag}", f"p-{tag}"
    engine.add_request("Once upon a time", sp, sid)
    stamps: list[float] = []
    while len(stamps) < 8:  # the stream's prefill and a few decode steps: its pace is known
        stamps += [time.perf_counter() for o in engine.step() if o.request_id == sid]
    start = time.perf_counter()
    engine.add_request(ids, _prompt_params(plp), pid)
    ttft, during = None, [stamps[-1]]
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == pid and ttft is None:
                ttft = now - start
            elif o.request_id == sid and ttft is None:
                during.append(now)
        if ttft is not None:
            break
    assert ttft is not None, "the prompt never produced its token"
    engine.abort_request(sid)
    while engine.has_unfinished_requests():
        engine.step()
    return [b - a for a, b in zip(during, during[1:])], ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-logprobs", type=int, default=None, metavar="N")
    args = ap.parse_args()
    llms = {
        s: LLM(
            args.model,
            max_model_len=4096,
            max_num_seqs=4,
            prefill_time_share=s,
            threads=args.threads,
        )  # fmt: skip
        for s in args.shares
    }
    rows: dict[float, dict[str, list[float]]] = {s: {} for s in args.shares}
    tag = 0
    for _ in range(args.rounds):
        for share, llm in llms.items():
            engine = llm.llm_engine
            tag += 1
            alone = _stream_alone(engine, args.stream_tokens, f"a{tag}")
            ids = _prompt(llm, args.prompt_tokens, tag)
            prompt_alone = _prompt_alone(engine, ids, f"a{tag}", args.prompt_logprobs)
            tag += 1
            ids = _prompt(llm, args.prompt_tokens, tag)
            gaps, ttft = _together(engine, args.stream_tokens, ids, f"t{tag}", args.prompt_logprobs)
            idle = statistics.median(alone[:64])
            r = rows[share]
            r.setdefault("idle_ms", []).append(1e3 * idle)
            r.setdefault("median_x", []).append(statistics.median(gaps) / idle)
            r.setdefault("mean_x", []).append(statistics.mean(gaps) / idle)
            r.setdefault("longest_x", []).append(max(gaps) / idle)
            r.setdefault("ttft_alone_s", []).append(prompt_alone)
            r.setdefault("ttft_x", []).append(ttft / prompt_alone)
            # the machine's own floor: the stream alone's longest gap over as many tokens
            r.setdefault("alone_longest_x", []).append(max(alone[: len(gaps)]) / idle)
    print("| share | stream idle ms/token | while the prompt is read: median gap / idle | mean "
          "| longest | prompt TTFT alone s | prompt TTFT beside the stream / alone "
          "| the stream alone: longest gap / idle |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for share, r in rows.items():
        cells = [f"{min(v):.2f}-{max(v):.2f}" for v in r.values()]
        print(f"| {share:g} | " + " | ".join(cells) + " |")
    print(json.dumps({str(s): r for s, r in rows.items()}))


if __name__ == "__main__":
    main()
