"""From per-prompt records to per-category figures: pure functions over plain dicts.

A record is one prompt under one configuration (see ``runners.make_record``). Figures:
- output tokens/s = total output tokens / total seconds (prefill included), per category;
- decode tokens/s = the same after each request's first token (prefill and TTFT excluded);
- cached prompt tokens = prompt tokens whose KV came from the prefix cache (our engine only);
- speedup = tokens/s / tokens/s of our ``plain`` in the same category and run;
- mean acceptance length = 1 + accepted / verification steps with drafts, summed over prompts;
- acceptance rate at position i = steps whose draft i was accepted / steps with drafts.
Under greedy sampling every speculative configuration must reproduce plain's tokens exactly; a
difference is a failure (anchors are compared too, for information only).
"""

from __future__ import annotations

from statistics import mean

OVERALL = "overall"


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> dict | None:
    """Where two multi-turn outputs first differ: ``{"turn", "token_index"}``, or None if equal."""
    for turn, (x, y) in enumerate(zip(a, b)):
        n = min(len(x), len(y))
        for i in range(n):
            if x[i] != y[i]:
                return {"turn": turn, "token_index": i}
        if len(x) != len(y):
            return {"turn": turn, "token_index": n}
    if len(a) != len(b):
        return {"turn": min(len(a), len(b)), "token_index": 0}
    return None


def _turn_tokens(record: dict) -> list[list[int]]:
    return [t["output_token_ids"] for t in record["turns"]]


def compare_to_reference(records: list[dict], reference: str, greedy: bool) -> None:
    """Set ``identical_to_plain`` / ``first_mismatch`` on every non-reference record (in place).

    Left None when sampling is random, for the reference itself, and where either side errored.
    """
    ref = {r["id"]: r for r in records if r["config"] == reference and not r["error"]}
    for r in records:
        r["identical_to_plain"], r["first_mismatch"] = None, None
        if not greedy or r["config"] == reference or r["error"] or r["id"] not in ref:
            continue
        where = first_mismatch(_turn_tokens(ref[r["id"]]), _turn_tokens(r))
        r["identical_to_plain"] = where is None
        r["first_mismatch"] = where


def find_failures(records: list[dict], reference: str, config_errors: dict[str, str]) -> list[str]:
    """Everything that makes the run fail: greedy mismatches and errors of our configurations."""
    failures = [f"{label}: crashed: {msg}" for label, msg in config_errors.items()]
    ref_ok = {r["id"] for r in records if r["config"] == reference and not r["error"]}
    for r in records:
        if r["backend"] != "specdec":
            continue
        if r["identical_to_plain"] is False:
            m = r["first_mismatch"]
            failures.append(
                f"{r['config']} / {r['id']}: output differs from plain "
                f"(turn {m['turn']}, token {m['token_index']})"
            )
        elif r["error"] and r["id"] in ref_ok and r["config"] != reference:
            failures.append(f"{r['config']} / {r['id']}: error where plain succeeded: {r['error']}")
    return failures


def merge_spec(records: list[dict]) -> dict | None:
    """Sum the per-prompt acceptance counters; derived rates are computed from the sums."""
    specs = [r["spec_decode"] for r in records if r.get("spec_decode") is not None]
    if not specs:
        return None
    num_drafts = sum(s["num_drafts"] for s in specs)
    num_draft_tokens = sum(s["num_draft_tokens"] for s in specs)
    num_accepted = sum(s["num_accepted_tokens"] for s in specs)
    width = max((len(s["accepted_per_pos"]) for s in specs), default=0)
    per_pos = [
        sum(s["accepted_per_pos"][i] for s in specs if i < len(s["accepted_per_pos"]))
        for i in range(width)
    ]
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "accepted_per_pos": per_pos,
        "mean_acceptance_length": 1.0 + num_accepted / num_drafts if num_drafts else 1.0,
        "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        "acceptance_rate_per_pos": [n / num_drafts for n in per_pos] if num_drafts else [],
    }


def summarize_group(records: list[dict]) -> dict:
    """Totals and means over one group of records (errored ones excluded)."""
    ok = [r for r in records if not r["error"]]
    tokens = sum(r["output_tokens"] for r in ok)
    seconds = sum(r["seconds"] for r in ok)
    ttfts = [t["ttft_s"] for r in ok for t in r["turns"] if t["ttft_s"] is not None]
    compared = [r["identical_to_plain"] for r in ok if r["identical_to_plain"] is not None]
    decode_tokens, decode_seconds = _decode_totals(ok)
    return {
        "num_prompts": len(ok),
        "num_errors": len(records) - len(ok),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_prompt_tokens": sum(r.get("cached_prompt_tokens", 0) for r in ok),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "decode_tokens_per_s": decode_tokens / decode_seconds if decode_seconds > 0 else None,
        "ttft_ms_mean": 1000.0 * mean(ttfts) if ttfts else None,
        "spec_decode": merge_spec(ok),
        "num_compared": len(compared),
        "num_identical": sum(compared),
    }


def _decode_totals(records: list[dict]) -> tuple[int, float]:
    """Tokens after the first and the time after the first token, summed over turns."""
    tokens, seconds = 0, 0.0
    for r in records:
        for t in r["turns"]:
            if t.get("ttft_s") is not None and t.get("seconds") is not None:
                tokens += max(0, len(t["output_token_ids"]) - 1)
                seconds += t["seconds"] - t["ttft_s"]
    return tokens, seconds


def summarize(records: list[dict], configs: list[tuple[str, str]], reference: str) -> list[dict]:
    """Rows for every (config, category) plus (config, overall), with speedups filled in.

    ``configs`` is [(label, backend)] in display order. ``speedup`` is over our plain in the same
    category; ``speedup_vs_own_plain`` is over ``<backend>:plain`` for anchors.
    """
    categories = list(dict.fromkeys(r["category"] for r in records))
    rows = []
    for label, backend in configs:
        mine = [r for r in records if r["config"] == label]
        if not mine:
            continue
        for cat in [*categories, OVERALL]:
            group = mine if cat == OVERALL else [r for r in mine if r["category"] == cat]
            if group:
                rows.append(
                    {"config": label, "backend": backend, "category": cat, **summarize_group(group)}
                )
    index = {(r["config"], r["category"]): r for r in rows}
    for row in rows:
        row["speedup"] = _ratio(row, index.get((reference, row["category"])))
        own = reference if row["backend"] == "specdec" else f"{row['backend']}:plain"
        row["speedup_vs_own_plain"] = _ratio(row, index.get((own, row["category"])))
    return rows


def _ratio(row: dict, base: dict | None) -> float | None:
    if base is None or not row["tokens_per_s"] or not base["tokens_per_s"]:
        return None
    return row["tokens_per_s"] / base["tokens_per_s"]
