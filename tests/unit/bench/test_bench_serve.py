"""``specdec bench serve``: the figures on hand-made records, and a short run on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.bench import aggregate, report, serve
from specdec.cli import main

FIXTURE = Path(__file__).parents[2] / "fixtures" / "bench_tiny.jsonl"


def _row(config, c, id_, ttft, e2e, tokens, text="x", turn=0, error=None, spec=None) -> dict:
    return {
        "config": config, "concurrency": c, "id": id_, "category": "cat", "turn": turn,
        "prompt_tokens": 10, "output_tokens": tokens, "ttft_s": ttft, "e2e_s": e2e,
        "tpot_s": aggregate.tpot(e2e, ttft, tokens), "text": text, "spec_decode": spec, "error": error,
    }  # fmt: skip


# ---- figures -------------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy() -> None:
    assert aggregate.percentile([], 50) is None
    assert aggregate.percentile([None, 3.0], 99) == 3.0
    assert aggregate.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert aggregate.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert aggregate.percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert aggregate.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    xs = [float(x) for x in range(101)]
    assert aggregate.percentile(xs, 99) == pytest.approx(99.0)


def test_tpot_excludes_the_first_token() -> None:
    assert aggregate.tpot(1.0, 0.2, 5) == pytest.approx(0.2)  # 0.8 s over 4 tokens
    assert aggregate.tpot(1.0, 0.2, 1) is None
    assert aggregate.tpot(1.0, None, 5) is None


def test_summary_throughput_percentiles_speedup_and_acceptance() -> None:
    spec = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
            "accepted_per_pos": [3, 2, 1]}  # fmt: skip
    plain = [
        _row("plain", 1, "a", 0.1, 1.1, 11),  # TPOT 0.1
        _row("plain", 1, "b", 0.3, 2.3, 11),  # TPOT 0.2
        _row("plain", 1, "c", 0.1, 0.1, 0, error="HTTP 400: too long"),
    ]
    ngram = [
        _row("ngram:k=3", 1, "a", 0.1, 0.6, 11, spec=spec),  # TPOT 0.05
        _row("ngram:k=3", 1, "b", 0.2, 1.2, 11, spec=spec),  # TPOT 0.1
    ]
    s_plain = {"config": "plain", "concurrency": 1, **aggregate.summarize_level(plain, 4.0)}
    s_ngram = {"config": "ngram:k=3", "concurrency": 1, **aggregate.summarize_level(ngram, 2.0)}
    assert s_plain["num_requests"] == 2 and s_plain["num_errors"] == 1
    assert s_plain["output_tokens"] == 22 and s_plain["output_tokens_per_s"] == pytest.approx(5.5)
    assert s_plain["requests_per_s"] == pytest.approx(0.5)
    assert s_plain["ttft_ms_p50"] == pytest.approx(200.0)
    assert s_plain["ttft_ms_p99"] == pytest.approx(298.0)
    assert s_plain["tpot_ms_p50"] == pytest.approx(150.0)
    assert s_plain["tpot_ms_p99"] == pytest.approx(199.0)
    assert s_plain["e2e_ms_p50"] == pytest.approx(1700.0)
    assert s_plain["spec_decode"] is None
    aggregate.add_speedups([s_plain, s_ngram], "plain")
    assert s_plain["speedup"] == pytest.approx(1.0)
    assert s_ngram["speedup"] == pytest.approx(11.0 / 5.5)
    merged = s_ngram["spec_decode"]
    assert merged["num_drafts"] == 8 and merged["accepted_per_pos"] == [6, 4, 2]
    assert merged["mean_acceptance_length"] == pytest.approx(1.0 + 12 / 8)


def test_speedup_is_per_concurrency_and_missing_reference_gives_none() -> None:
    rows = [
        {"config": "plain", "concurrency": 1, "output_tokens_per_s": 10.0},
        {"config": "plain", "concurrency": 4, "output_tokens_per_s": 20.0},
        {"config": "ngram", "concurrency": 1, "output_tokens_per_s": 15.0},
        {"config": "ngram", "concurrency": 4, "output_tokens_per_s": 50.0},
        {"config": "ngram", "concurrency": 8, "output_tokens_per_s": 50.0},
    ]
    aggregate.add_speedups(rows, "plain")
    assert [r["speedup"] for r in rows] == [1.0, 1.0, 1.5, 2.5, None]


def test_speedup_per_round_pairs_each_round_with_the_reference_round() -> None:
    def level(config: str, rounds: list[float]) -> dict:
        rows = [_row(config, 16, "a", 0.1, 1.1, 11)]
        return {"config": config, "concurrency": 16, "num_clients": 16, "num_not_sent": 0,
                "num_compared": 0, "num_identical": 0,
                **aggregate.summarize_level(rows, 1.0), "round_tokens_per_s": rounds}  # fmt: skip

    plain = level("plain", [500.0, 300.0, 400.0])
    ngram = level("ngram", [450.0, 330.0, 420.0])
    single = level("suffix", [390.0])
    aggregate.add_speedups([plain, ngram, single], "plain")
    assert ngram["round_speedups"] == pytest.approx([0.9, 1.1, 1.05])
    assert ngram["median_round_speedup"] == pytest.approx(1.05)
    assert single["round_speedups"] is None and single["median_round_speedup"] is None
    notes = report.format_serve_table([plain, ngram], "plain")
    assert "speedup per round 0.90x, 1.10x, 1.05x (median 1.05x)" in notes


def test_mismatch_at_concurrency_1_fails_higher_concurrency_informs() -> None:
    records = [
        _row("plain", 1, "a", 0.1, 1.0, 3, text="abc"),
        _row("plain", 1, "a", 0.1, 1.0, 3, text="def", turn=1),
        _row("plain", 2, "a", 0.1, 1.0, 3, text="abX"),
        _row("ngram", 1, "a", 0.1, 1.0, 3, text="abc"),
        _row("ngram", 1, "a", 0.1, 1.0, 3, text="deX", turn=1),
        _row("ngram", 2, "a", 0.1, 1.0, 3, text="abX"),
        _row("ngram", 2, "a", 0.1, 1.0, 3, text="def", turn=1),
        _row("other", 1, "a", 0.1, 1.0, 4, text="abc"),  # same text, one more token
        _row("other", 1, "a", 0.1, 1.0, 0, turn=1, error="boom"),
    ]
    aggregate.compare_texts_to_reference(records, "plain")
    assert [r["identical_to_plain"] for r in records] == [
        None, None, False, True, False, False, True, False, None,
    ]  # fmt: skip
    failures = aggregate.find_failures(records, "plain", {"draft_model": "RuntimeError: x"})
    assert failures == [
        "draft_model: crashed: RuntimeError: x",
        "ngram @ 1 / a turn 1: output differs from plain",
        "other @ 1 / a turn 0: output differs from plain",
        "other @ 1 / a turn 1: error where plain succeeded: boom",
    ]
    summary = [
        {"config": c, "concurrency": n}
        for c, n in [("plain", 1), ("plain", 2), ("ngram", 1), ("ngram", 2)]
    ]
    aggregate.add_exactness_counts(summary, records)
    cells = [report.identical_cell(s, "plain") for s in summary]
    assert cells == ["reference", "no (0/1, informative)", "**NO (1/2) FAIL**", "no (1/2, informative)"]  # fmt: skip


def test_table_rows_and_notes() -> None:
    rows = [_row("plain", 1, "a", 0.1, 1.1, 11), _row("plain", 1, "b", 0.3, 2.3, 11)]
    s = {"config": "plain", "concurrency": 1, "num_clients": 1, "num_not_sent": 2,
         **aggregate.summarize_level(rows, 4.0)}  # fmt: skip
    aggregate.add_speedups([s], "plain")
    aggregate.compare_texts_to_reference(rows, "plain")
    aggregate.add_exactness_counts([s], rows)
    table = report.format_serve_table([s], "plain")
    lines = table.splitlines()
    assert lines[0].startswith("| config | concurrency | requests | out tokens |")
    assert lines[1] == "|" + "---|" * 14
    assert lines[2] == (
        "| plain | 1 | 2 (2 not sent) | 22 | 4.00 | 5.5 | 1.00x | 200 | 298 | 150.0 | 199.0 "
        "| 1700 | - | reference |"
    )
    assert "duration limit reached, 2 request(s) not sent" in table


# ---- end to end on the tiny model -------------------------------------------------------------
def _bench(tiny_llama, out: Path, *extra: str) -> int:
    return main([
        "bench", "serve", "--model", str(tiny_llama), "--dataset", str(FIXTURE), "--max-tokens", "8",
        "--max-model-len", "256", "--output-dir", str(out), *extra,
    ])  # fmt: skip


def test_serve_end_to_end(tiny_llama, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    code = _bench(tiny_llama, out, "--concurrency", "1,2", "--configs", "plain", "ngram:k=3")
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    assert result["schema"] == serve.SCHEMA and result["passed"] is True
    assert result["failures"] == [] and result["reference"] == "plain"
    assert result["concurrency"] == [1, 2]
    env = result["environment"]
    for key in ("cpu_model", "torch_threads", "torch_version", "git_commit", "command", "settings"):
        assert key in env
    assert env["settings"]["max_tokens"] == 8 and "api_key" not in env["settings"]
    records = result["records"]
    # 3 conversations, 4 turns in all; 2 configs x 2 concurrency levels
    assert len(records) == 16
    assert {(r["config"], r["concurrency"]) for r in records} == {
        (c, n) for c in ("plain", "ngram:k=3") for n in (1, 2)
    }
    for r in records:
        assert r["error"] is None
        assert 1 <= r["output_tokens"] <= 8 and r["prompt_tokens"] > 0
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        if r["output_tokens"] > 1:
            assert r["tpot_s"] == pytest.approx(
                (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
            )
        if r["config"] == "plain":
            assert r["spec_decode"] is None
        else:
            assert {"num_drafts", "mean_acceptance_length"} <= set(r["spec_decode"])
        if r["config"] == "ngram:k=3" and r["concurrency"] == 1:
            assert r["identical_to_plain"] is True
    chat = [r for r in records if r["id"] == "tiny/chat-0" and r["config"] == "plain"]
    assert sorted(r["turn"] for r in chat) == [0, 0, 1, 1]
    turn0, turn1 = (
        next(r for r in chat if r["turn"] == t and r["concurrency"] == 1) for t in (0, 1)
    )
    assert turn1["prompt_tokens"] > turn0["prompt_tokens"]  # the reply went back in
    # the prefix cache: a later turn reuses its conversation so far; every level starts cold
    # (without the reset, the warm-up or the previous level would have cached edit-0 whole)
    for r in records:
        if r["turn"] == 1:
            first = next(x for x in records if x["turn"] == 0 and x["id"] == r["id"]
                         and x["config"] == r["config"] and x["concurrency"] == r["concurrency"])  # fmt: skip
            assert r["cached_prompt_tokens"] >= first["prompt_tokens"]
        elif r["id"] == "tiny/edit-0":
            assert r["cached_prompt_tokens"] < r["prompt_tokens"] - 1
    summary = result["summary"]
    assert [(s["config"], s["concurrency"]) for s in summary] == [
        ("plain", 1), ("plain", 2), ("ngram:k=3", 1), ("ngram:k=3", 2),
    ]  # fmt: skip
    for s in summary:
        assert s["num_requests"] == 4 and s["output_tokens_per_s"] > 0
        assert 0 < s["cached_prompt_tokens"] < s["prompt_tokens"]
        assert s["ttft_ms_p50"] <= s["ttft_ms_p99"]
        assert s["speedup"] is not None
    assert summary[0]["speedup"] == 1.0 and summary[0]["spec_decode"] is None
    assert summary[2]["spec_decode"]["mean_acceptance_length"] >= 1.0
    assert summary[2]["num_compared"] == 4 and summary[2]["num_identical"] == 4
    table = (out / "table.md").read_text()
    assert table.startswith("| config | concurrency |") and table.count("\n") == 2 + 4
    assert "| ngram:k=3 | 1 | 4 |" in table and "yes (4/4)" in table
    assert "| ngram:k=3 | 1 | 4 |" in capsys.readouterr().out


def test_serve_rounds_interleave_configurations(tiny_llama, tmp_path) -> None:
    out = tmp_path / "rounds"
    code = _bench(tiny_llama, out, "--concurrency", "1,2", "--configs", "plain", "ngram:k=3",
                  "--rounds", "2")  # fmt: skip
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    assert result["passed"] is True
    # execution order, one entry per level run: configurations alternate within a level and
    # their order rotates each round
    order = []
    for r in result["records"]:
        key = (r["config"], r["concurrency"])
        if not order or order[-1] != key:
            order.append(key)
    assert order == [
        ("plain", 1), ("ngram:k=3", 1), ("plain", 2), ("ngram:k=3", 2),
        ("ngram:k=3", 1), ("plain", 1), ("ngram:k=3", 2), ("plain", 2),
    ]  # fmt: skip
    for s in result["summary"]:
        assert s["rounds"] == 2 and s["num_requests"] == 8 and len(s["round_tokens_per_s"]) == 2
        tokens = sum(r["output_tokens"] for r in result["records"]
                     if (r["config"], r["concurrency"]) == (s["config"], s["concurrency"]))  # fmt: skip
        assert s["output_tokens"] == tokens
    ngram_1 = [r for r in result["records"] if r["config"] == "ngram:k=3" and r["concurrency"] == 1]
    assert len(ngram_1) == 8 and all(r["identical_to_plain"] is True for r in ngram_1)
    assert "- `ngram:k=3` @ 2: out tok/s per round " in (out / "table.md").read_text()


def test_serve_against_a_running_server_with_duration_limit(tiny_llama, tmp_path) -> None:
    from specdec.config import EngineConfig, SpeculativeConfig
    from specdec.engine.async_llm import AsyncLLM
    from specdec.entrypoints.openai.api_server import BackgroundServer, build_app

    config = EngineConfig(
        model=str(tiny_llama),
        max_model_len=256,
        max_num_seqs=2,
        speculative=SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 2}),
    )
    llm = AsyncLLM.from_config(config, log_stats=False)
    with BackgroundServer(build_app(llm, ["tiny"])) as srv:

        def bench(out: Path, *extra: str) -> int:
            return main([
                "bench", "serve", "--base-url", srv.url, "--dataset", str(FIXTURE),
                "--max-tokens", "4", "--concurrency", "1", "--configs", "ngram:k=2",
                "--output-dir", str(out), *extra,
            ])  # fmt: skip

        assert bench(tmp_path / "remote") == 0
        assert bench(tmp_path / "limited", "--duration-limit", "1e-9") == 0
    result = json.loads((tmp_path / "remote" / "results.json").read_text())
    assert result["environment"]["model_path"] is None
    (s,) = result["summary"]
    assert s["num_requests"] == 4 and s["num_not_sent"] == 0
    assert s["spec_decode"]["num_drafts"] >= 0 and s["speedup"] is None  # no plain to compare with
    assert all(r["identical_to_plain"] is None for r in result["records"])
    # the limit has passed before the first request: nothing is sent, and the table says so
    limited = json.loads((tmp_path / "limited" / "results.json").read_text())
    (s,) = limited["summary"]
    assert s["num_requests"] == 0 and s["num_not_sent"] == 4 and limited["records"] == []
    assert s["output_tokens_per_s"] is None and s["ttft_ms_p50"] is None
    table = (tmp_path / "limited" / "table.md").read_text()
    assert "| ngram:k=2 | 1 | 0 (4 not sent) | 0 |" in table
    assert "duration limit reached, 4 request(s) not sent" in table


def test_bad_arguments_are_clear_cli_errors(tiny_llama, tmp_path, capsys) -> None:
    assert _bench(tiny_llama, tmp_path / "a", "--configs", "hf:plain") == 2
    assert "not hf:plain (see bench latency)" in capsys.readouterr().err
    code = main([
        "bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", str(FIXTURE),
        "--configs", "plain", "ngram:k=3", "--output-dir", str(tmp_path / "b"),
    ])  # fmt: skip
    assert code == 2
    assert "give one --configs label" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _bench(tiny_llama, tmp_path / "c", "--concurrency", "0")
