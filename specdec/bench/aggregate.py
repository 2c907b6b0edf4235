"""The figures of both benchmarks: pure functions over plain dicts.

``bench latency``: a record is one prompt under one configuration (see ``runners.make_record``).
Figures:
- output tokens/s = total output tokens / total seconds (prefill included), per category;
- decode tokens/s = the same after each request's first token (prefill and TTFT excluded);
- cached prompt tokens = prompt tokens whose KV came from the prefix cache (our engine only);
- speedup = tokens/s / tokens/s of our ``plain`` in the same category and run;
- mean acceptance length = 1 + accepted / verification steps with drafts, summed over prompts;
- acceptance rate at position i = steps whose draft i was accepted / steps with drafts.
Under greedy sampling every speculative configuration must reproduce plain's tokens exactly; a
difference is a failure (anchors are compared too, for information only).

``bench serve``: a record is one request (one turn) at one concurrency level (see
``serve.stream_chat``); ``summarize_level`` gives p50/p99 of TTFT, TPOT and end-to-end latency and
output tokens/s over the level's wall time, ``add_speedups`` the ratio to plain at the same
concurrency. Replies are compared as text with plain's at concurrency 1, where a difference fails.
"""

from __future__ import annotations

import math
from statistics import mean

OVERALL = "overall"
REFERENCE_CONCURRENCY = 1  # bench serve: outputs are checked against plain's at this level


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


def _request_key(record: dict) -> tuple:
    """What a record measured: the prompt (bench latency), or the turn at a level (bench serve)."""
    return record["id"], record.get("turn"), record.get("concurrency")


def _where(record: dict) -> str:
    where = record["config"]
    if "concurrency" in record:
        where += f" @ {record['concurrency']}"
    where += f" / {record['id']}"
    return where + (f" turn {record['turn']}" if "turn" in record else "")


def find_failures(records: list[dict], reference: str, config_errors: dict[str, str]) -> list[str]:
    """Everything that makes a run fail: crashed configurations, greedy outputs of our
    configurations that differ from the reference's (under bench serve: at concurrency 1), and
    requests of ours that failed where the reference's succeeded. Anchors never fail a run."""
    failures = [f"{label}: crashed: {msg}" for label, msg in config_errors.items()]
    ref_ok = {_request_key(r) for r in records if r["config"] == reference and not r["error"]}
    for r in records:
        if r["config"] == reference or r.get("backend", "specdec") != "specdec":
            continue
        checked = r.get("concurrency", REFERENCE_CONCURRENCY) == REFERENCE_CONCURRENCY
        if r["identical_to_plain"] is False and checked:
            m = r.get("first_mismatch")
            at = f" (turn {m['turn']}, token {m['token_index']})" if m else ""
            failures.append(f"{_where(r)}: output differs from {reference}{at}")
        elif r["error"] and _request_key(r) in ref_ok:
            failures.append(f"{_where(r)}: error where {reference} succeeded: {r['error']}")
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


def _totals(records: list[dict], ok: list[dict]) -> dict:
    """What every summary counts first: the errored records, and the tokens of the others."""
    return {
        "num_errors": len(records) - len(ok),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_prompt_tokens": sum(r.get("cached_prompt_tokens", 0) for r in ok),
        "output_tokens": sum(r["output_tokens"] for r in ok),
    }


def summarize_group(records: list[dict]) -> dict:
    """Totals and means over one group of records (errored ones excluded)."""
    ok = [r for r in records if not r["error"]]
    totals = _totals(records, ok)
    tokens = totals["output_tokens"]
    seconds = sum(r["seconds"] for r in ok)
    ttfts = [t["ttft_s"] for r in ok for t in r["turns"] if t["ttft_s"] is not None]
    compared = [r["identical_to_plain"] for r in ok if r["identical_to_plain"] is not None]
    decode_tokens, decode_seconds = _decode_totals(ok)
    return {
        "num_prompts": len(ok),
        **totals,
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


# ---- bench serve ----------------------------------------------------------------------------------
def percentile(values: list[float | None], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def tpot(e2e_s: float, ttft_s: float | None, output_tokens: int) -> float | None:
    """Seconds per output token after the first (None with fewer than two tokens)."""
    if ttft_s is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def summarize_level(rows: list[dict], duration_s: float) -> dict:
    """Figures over the requests of one (configuration, concurrency) level (errors excluded)."""
    ok = [r for r in rows if not r["error"]]
    totals = _totals(rows, ok)
    tokens = totals["output_tokens"]
    ttfts = [r["ttft_s"] for r in ok]
    tpots = [r["tpot_s"] for r in ok]
    e2es = [r["e2e_s"] for r in ok]
    return {
        "num_requests": len(ok),
        **totals,
        "duration_s": duration_s,
        "output_tokens_per_s": tokens / duration_s if duration_s > 0 and ok else None,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 and ok else None,
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "tpot_ms_p50": _ms(percentile(tpots, 50)),
        "tpot_ms_p99": _ms(percentile(tpots, 99)),
        "e2e_ms_p50": _ms(percentile(e2es, 50)),
        "e2e_ms_p99": _ms(percentile(e2es, 99)),
        "spec_decode": merge_spec(ok),
    }


def add_speedups(summary: list[dict], reference: str) -> None:
    """``speedup`` = output tokens/s over the reference's at the same concurrency (in place)."""
    refs = {s["concurrency"]: s for s in summary if s["config"] == reference}
    for s in summary:
        ref = refs.get(s["concurrency"], {})
        base = ref.get("output_tokens_per_s")
        tps = s["output_tokens_per_s"]
        s["speedup"] = tps / base if base and tps else None
        # Paired by round: each round ran every configuration back to back, so a round's ratio
        # is spared the drift between rounds that the pooled figure absorbs.
        mine, theirs = s.get("round_tokens_per_s") or [], ref.get("round_tokens_per_s") or []
        pairs = list(zip(mine, theirs)) if len(mine) == len(theirs) > 1 else []
        s["round_speedups"] = [a / b for a, b in pairs if a and b] or None
        s["median_round_speedup"] = percentile(s["round_speedups"] or [], 50)


def compare_texts_to_reference(records: list[dict], reference: str) -> None:
    """Set ``identical_to_plain`` on every served record against the reference's reply at
    concurrency 1 (same id and turn; text and token count).

    Left None for the reference rows themselves, errored requests and (id, turn) pairs the
    reference has no reply for.
    """
    ref = {
        (r["id"], r["turn"]): r
        for r in records
        if r["config"] == reference and r["concurrency"] == REFERENCE_CONCURRENCY and not r["error"]
    }
    for r in records:
        r["identical_to_plain"] = None
        base = ref.get((r["id"], r["turn"]))
        if base is None or base is r or r["error"]:
            continue
        r["identical_to_plain"] = (
            r["text"] == base["text"] and r["output_tokens"] == base["output_tokens"]
        )


def add_exactness_counts(summary: list[dict], records: list[dict]) -> None:
    """``num_compared`` / ``num_identical`` per (configuration, concurrency) row (in place)."""
    for s in summary:
        mine = [
            r["identical_to_plain"]
            for r in records
            if r["config"] == s["config"]
            and r["concurrency"] == s["concurrency"]
            and r["identical_to_plain"] is not None
        ]
        s["num_compared"], s["num_identical"] = len(mine), sum(mine)
