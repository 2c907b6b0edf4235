"""``specdec bench multiturn``: the checks on hand-made records, and a short run on the real model
(two conversations of three turns: a code edit and an agent loop with tool results)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.bench import multiturn
from specdec.bench.configs import parse_config
from specdec.cli import main


def _rec(config: str, turn: int, cached: int, text: str = "x", id_: str = "a") -> dict:
    return {"config": config, "id": id_, "category": "c", "turn": turn, "prompt_tokens": 100,
            "cached_prompt_tokens": cached, "output_tokens": 3, "ttft_s": 0.1, "e2e_s": 0.3,
            "text": text, "spec_decode": None, "error": None}  # fmt: skip


def test_methods_keep_their_options() -> None:
    assert multiturn.parse_methods("plain, suffix,ngram:k=5,max=4,hybrid") == [
        "plain", "suffix", "ngram:k=5,max=4", "hybrid",
    ]  # fmt: skip


def test_the_packaged_conversations_load() -> None:
    convs = multiturn.load_conversations(multiturn.DEFAULT_CONVERSATIONS)
    assert len(convs) >= 12 and {"chat", "code_edit", "agent"} <= {c.category for c in convs}
    assert all(len(c.turns) >= 3 for c in convs)
    roles = {m["role"] for c in convs for turn in c.turns for m in turn}
    assert roles == {"user", "tool"}
    note = json.loads(multiturn.DEFAULT_CONVERSATIONS.read_text())["note"]
    assert "hand-written" in note.lower()


def test_bad_conversations_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"conversations": [{"id": "a", "category": "c", "turns": [[]]}]}))
    with pytest.raises(ValueError, match="turn 1"):
        multiturn.load_conversations(path)


def test_fewer_cached_tokens_or_another_reply_fail() -> None:
    records = [
        _rec("plain", 1, 0), _rec("plain", 2, 50), _rec("plain", 3, 90),
        _rec("suffix", 1, 0), _rec("suffix", 2, 40), _rec("suffix", 3, 95),
        _rec("ngram", 1, 0, text="y"), _rec("ngram", 2, 10), _rec("ngram", 3, 0),
    ]  # fmt: skip
    failures = multiturn.compare_to_reference(records, "plain")
    assert sorted(failures) == [
        "ngram / a turn 1: the reply differs from plain's",
        "suffix / a turn 2: 40 prompt tokens from the prefix cache, plain 50",
    ]  # ngram's later prompts differ from plain's: their cache is not compared
    configs = [parse_config(m) for m in ("plain", "suffix", "ngram")]
    summary = multiturn.summarize(records, configs)
    rows = {(s["config"], s["turn"]): s for s in summary}
    assert rows["plain", "2"]["prefix_hit_rate"] == 0.5
    assert rows["suffix", "3+"]["prefix_hit_rate"] == 0.95
    assert rows["suffix", "all"]["num_fewer_cached"] == 1
    assert rows["ngram", "1"]["num_identical"] == 0
    assert rows["suffix", "all"]["decode_speedup"] == pytest.approx(1.0)


def test_real_model_two_conversations(tmp_path: Path, capsys) -> None:
    convs = json.loads(multiturn.DEFAULT_CONVERSATIONS.read_text())["conversations"]
    picked = [c for c in convs if c["id"] in ("code/settings-parser", "agent/failing-test")]
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"conversations": picked}))
    out_dir = tmp_path / "out"
    code = main([
        "bench", "multiturn", "--model", "smollm2-135m", "--methods", "plain,suffix,ngram",
        "--conversations", str(path), "--max-turns", "3", "--max-tokens", "24",
        "--request-timeout", "120", "--output-dir", str(out_dir),
    ])  # fmt: skip
    payload = json.loads((out_dir / "results.json").read_text())
    assert code == 0, payload["failures"]
    records = payload["records"]
    assert len(records) == 3 * 2 * 3 and not any(r["error"] for r in records)
    plain = {(r["id"], r["turn"]): r for r in records if r["config"] == "plain"}
    for r in records:
        base = plain[r["id"], r["turn"]]
        assert r["text"] == base["text"], (r["config"], r["id"], r["turn"])
        # speculation serves as much of every prompt from the prefix cache as plain decoding
        assert r["cached_prompt_tokens"] == base["cached_prompt_tokens"], (r["config"], r["id"])
        assert (r["cached_prompt_tokens"] > 0) == (r["turn"] >= 2)
    rows = {(s["config"], s["turn"]): s for s in payload["summary"]}
    for turn in ("1", "2", "3"):
        hit = rows["plain", turn]["prefix_hit_rate"]
        assert (
            rows["suffix", turn]["prefix_hit_rate"] == rows["ngram", turn]["prefix_hit_rate"] == hit
        )
        assert (hit > 0) == (turn != "1")
    assert rows["suffix", "all"]["spec_decode"]["num_drafts"] > 0
    table = (out_dir / "table.md").read_text()
    assert "| suffix | 3 |" in table and "prefix hit rate" in table
    assert "prefix hit rate" in capsys.readouterr().out


def test_base_urls_and_concurrency(tmp_path: Path) -> None:
    """Two conversations at once against a server already running (--base-url), and the flags'
    errors."""
    from specdec.config import ConfigError
    from tests.fixtures.server import serve

    with pytest.raises(ConfigError, match="LABEL=URL"):
        multiturn.parse_base_urls(["http://127.0.0.1:1"])
    convs = json.loads(multiturn.DEFAULT_CONVERSATIONS.read_text())["conversations"]
    picked = [c for c in convs if c["id"] in ("code/settings-parser", "agent/failing-test")]
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"conversations": picked}))
    out_dir = tmp_path / "out"
    with serve(
        "smollm2-135m", "--max-model-len", "2048", "--max-num-seqs", "2", timeout=120
    ) as srv:
        code = main([
            "bench", "multiturn", "--model", "smollm2-135m", "--base-url", f"plain={srv.url}",
            "--concurrency", "2", "--conversations", str(path), "--max-turns", "3",
            "--max-tokens", "16", "--request-timeout", "120", "--output-dir", str(out_dir),
        ])  # fmt: skip
    payload = json.loads((out_dir / "results.json").read_text())
    assert code == 0, payload["failures"]
    records = payload["records"]
    assert len(records) == 2 * 3 and not any(r["error"] for r in records)
    assert all(r["cached_prompt_tokens"] > 0 for r in records if r["turn"] >= 2)
    assert payload["environment"]["settings"]["base_urls"] == {"plain": srv.url}
