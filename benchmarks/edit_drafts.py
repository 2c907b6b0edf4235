"""Suffix decoding's drafts on code edits a model would write, with and without the edit rules
(``specdec/spec_decode/edits.py``), no model run (not a test).

Each edit takes a piece of this repository's source and a change applied to it with a regular
expression (renames, quotes, return annotations); the prompt asks for the change and shows the
piece, and the response is the changed piece: what a model that follows the request writes. The
suffix proposer then drafts that response step by step as greedy verification would take it (a
draft is accepted up to its first token that differs from the response, then one token comes
from the target), and the table gives the response's tokens per verification step. The tokens
per step are the ceiling of the speedup a drafter gives; the small models that run on a laptop
copy these prompts without making the change, so this measures the drafter on the responses of
the models that would.

    .venv/bin/python benchmarks/edit_drafts.py --model smollm2-135m --drafts 8 16
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.bench.replay_trace import DrafterTrace, Trace, TraceFile, _one_row_ms
from specdec.spec_decode.base import DraftInput, DraftRequest, accepted_prefix
from specdec.spec_decode.suffix import SuffixProposer

ROOT = Path(__file__).resolve().parents[1]


def _rename(old: str, new: str) -> Callable[[str], str]:
    return lambda text: re.sub(rf"\b{re.escape(old)}\b", new, text)


def _single_quotes(text: str) -> str:
    return re.sub(r'"([^"\'\n\\]*)"', r"'\1'", text)


def _without_none_returns(text: str) -> str:
    return text.replace(") -> None:", "):")


def _none_returns(text: str) -> str:
    return re.sub(r"^(\s*def [^\n]*\))(:)$", r"\1 -> None\2", text, flags=re.M)


# (file, start, end, request, change[, before]): the piece between the offsets (``before`` applied
# to it first: the prompt's code) and what the response does to it
EDITS = [
    ("specdec/engine/fair_share.py", 3000, 6200,
     "Rename the variable `share` to `portion` everywhere in this Python code.", _rename("share", "portion")),
    ("specdec/model/layers.py", 5200, 8000,
     "Rename `inv_freq` to `inverse_frequencies` in this Python code.", _rename("inv_freq", "inverse_frequencies")),
    ("benchmarks/trees_ab.py", 1200, 4000,
     "Replace every double-quoted string with a single-quoted one in this Python code.", _single_quotes),
    ("specdec/kv_cache/memory.py", 2600, 6000,
     "Rename `nbytes` to `size_in_bytes` in this Python code.", _rename("nbytes", "size_in_bytes")),
    ("specdec/kv_cache/memory.py", 6000, 10000,
     "Add the return annotation `-> None` to every function that returns nothing in this Python code.",
     _none_returns, _without_none_returns),
    ("specdec/spec_decode/suffix.py", 9000, 12000,
     "Rename `state` to `req_state` in this Python code.", _rename("state", "req_state")),
]  # fmt: skip


def write(prompt: list[int], response: list[int], drafts: int, edit_rules: bool) -> Trace:
    """Greedy speculative decoding of ``response`` after ``prompt`` with the suffix proposer,
    every step drafting up to ``drafts``: its steps as ``specdec bench replay`` records them."""
    proposer = SuffixProposer(drafts, edit_rules=edit_rules)
    sampling = SamplingParams(temperature=0)
    trace = Trace(list(prompt), output_token_ids=list(response), category="code-edit")
    i = 0
    while i < len(response):
        req = DraftRequest(
            "r", prompt + response[:i], drafts, sampling, num_prompt_tokens=len(prompt)
        )
        start = time.perf_counter()
        draft = proposer.propose(DraftInput([req])).draft_token_ids[0]
        ms = 1000.0 * (time.perf_counter() - start)
        accepted = accepted_prefix(draft, response[i:])
        trace.steps.append((i, len(draft), accepted))
        trace.draft_ms.append(round(ms, 4) if draft else 0.0)
        trace.model_drafted.append(False)
        i += accepted + 1
    return trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer")
    ap.add_argument("--drafts", type=int, nargs="+", default=[8, 16])
    ap.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="also save the steps at the largest --drafts as a replay trace (drafters suffix and "
        "suffix-edits) for `specdec bench replay run --trace FILE --model GGUF`",
    )
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=256, max_num_seqs=1)
    tok = llm.get_tokenizer()
    print(
        "| edit | response tokens | drafts a step | tokens a step: suffix | with edit rules | gain |"
    )
    print("|---|---|---|---|---|---|")
    totals: dict[tuple[int, bool], list[int]] = {}
    k_trace = max(args.drafts)
    drafters = {
        name: DrafterTrace("suffix", k_trace, SuffixProposer.free_drafts, True)
        for name in ("suffix", "suffix-edits")
    }
    for path, start, end, ask, change, *before in EDITS:
        code = (ROOT / path).read_text()[start:end]
        for f in before:
            code = f(code)
        edited = change(code)
        assert edited != code, path
        prompt = tok.encode(f"{ask} Output only the code.\n\n```python\n{code}\n```\n")
        response = tok.encode(f"```python\n{edited}\n```", add_special_tokens=False)
        for k in args.drafts:
            without, with_rules = (write(prompt, response, k, on) for on in (False, True))
            plain, rules = len(without.steps), len(with_rules.steps)
            if k == k_trace:
                for name, t in (("suffix", without), ("suffix-edits", with_rules)):
                    t.req_id = f"{path}:{start}"
                    drafters[name].requests.append(t)
            for on, s in ((False, plain), (True, rules)):
                totals.setdefault((k, on), [0, 0])
                totals[(k, on)][0] += len(response)
                totals[(k, on)][1] += s
            n, what = len(response), f"{path} ({ask.split()[0].lower()})"
            print(
                f"| {what} | {n} | {k} | {n / plain:.2f} | {n / rules:.2f} | {plain / rules:.2f}x |"
            )
    for k in args.drafts:
        (t0, s0), (t1, s1) = totals[(k, False)], totals[(k, True)]
        print(f"| all | {t0} | {k} | {t0 / s0:.2f} | {t1 / s1:.2f} | {s0 / s1:.2f}x |")
    if args.trace:
        longest = max(len(t.output_token_ids) for t in drafters["suffix"].requests)
        step_ms = _one_row_ms(llm.engine.model)  # the trace's scale for model drafters (none here)
        TraceFile(args.model, longest, step_ms, drafters).save(args.trace)
        print(f"trace: {args.trace}")


if __name__ == "__main__":
    main()
