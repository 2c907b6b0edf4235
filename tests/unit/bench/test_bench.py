"""The benchmark harness: config strings, aggregation, exactness failures, outputs, forward cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.bench import aggregate
from specdec.bench.configs import parse_config, parse_configs
from specdec.bench.dataset import DEFAULT_CODE_PREFIX, BenchItem, PromptBuilder, load_items
from specdec.bench.report import format_latency_table
from specdec.cli import main
from specdec.config import ConfigError

FIXTURE = Path(__file__).parents[2] / "fixtures" / "bench_tiny.jsonl"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- config strings ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, backend, method, options",
    [
        ("plain", "specdec", "plain", {}),
        ("ngram:k=5", "specdec", "ngram", {"num_speculative_tokens": 5}),
        ("ngram:k=5,max=4,min=2", "specdec", "ngram",
         {"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
        ("layer_skip:k=3,layers=8", "specdec", "layer_skip", {"num_speculative_tokens": 3, "num_draft_layers": 8}),
        ("draft_model:model=smollm2-135m,k=4", "specdec", "draft_model",
         {"model": "smollm2-135m", "num_speculative_tokens": 4}),
        ("suffix:k=8,max_tree_depth=24,x=0.5", "specdec", "suffix",
         {"num_speculative_tokens": 8, "max_tree_depth": 24, "x": 0.5}),
        ("hf:plain", "hf", "plain", {}),
        ("hf:prompt_lookup:k=10", "hf", "prompt_lookup", {"prompt_lookup_num_tokens": 10}),
        ("hf:assistant:model=smollm2-135m", "hf", "assistant", {"assistant_model": "smollm2-135m"}),
        ("llama_cpp:prompt_lookup:k=10", "llama_cpp", "prompt_lookup", {"num_pred_tokens": 10}),
        (" ngram : k = 3 ", "specdec", "ngram", {"num_speculative_tokens": 3}),
    ],
)  # fmt: skip
def test_parse_config(text, backend, method, options) -> None:
    cfg = parse_config(text)
    assert (cfg.backend, cfg.method, cfg.options) == (backend, method, options)
    assert cfg.label == text.strip()
    if backend == "specdec" and method != "plain":
        assert cfg.speculative_config() == {"method": method, **options}


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("ngram:k", "expected key=value"),
        ("ngram:=3", "expected key=value"),
        ("ngram:k=", "expected key=value"),
        ("ngram:k=3,k=4", "given twice"),
        ("ngram:k=3,num_speculative_tokens=4", "same key"),
        ("ngram:k=abc", "must be an integer"),
        ("plain:k=3", "plain takes no options"),
        ("k=3", "missing method"),
        ("hf:", "missing method"),
        ("hf:medusa", "hf supports"),
        ("llama_cpp:assistant:model=x", "llama_cpp supports"),
        ("hf:assistant:k=3", "needs model="),
    ],
)
def test_parse_config_rejects_bad_strings(text, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


def test_parse_configs_puts_plain_first_anchors_last_and_validates() -> None:
    labels = [
        c.label
        for c in parse_configs(["hf:plain", "ngram:k=3", "llama_cpp:plain", "layer_skip:k=2"])
    ]
    assert labels == ["plain", "ngram:k=3", "layer_skip:k=2", "hf:plain", "llama_cpp:plain"]
    with pytest.raises(ConfigError, match="given twice"):
        parse_configs(["ngram:k=3", "ngram:k=3"])
    with pytest.raises(ConfigError, match="ngram:k=0"):  # the engine's own validation, up front
        parse_configs(["ngram:k=0"])
    with pytest.raises(ConfigError, match="unknown speculative_config key"):
        parse_configs(["ngram:bogus=1"])


# ---- prompts ----------------------------------------------------------------------------------
class _FakeTokenizer:
    chat_template = "x"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [ord(c) for c in json.dumps(messages)]

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_load_items_filters_and_caps_per_category(tmp_path) -> None:
    assert [it.id for it in load_items([FIXTURE])] == ["tiny/edit-0", "tiny/edit-1", "tiny/chat-0"]
    assert [it.id for it in load_items([FIXTURE], num_per_category=1)] == [
        "tiny/edit-0",
        "tiny/chat-0",
    ]
    assert [it.id for it in load_items([FIXTURE], categories=["chat"])] == ["tiny/chat-0"]
    with pytest.raises(ValueError, match="no prompts in category nope"):
        load_items([FIXTURE], categories=["nope"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "category": "c", "turns": []}\n')
    with pytest.raises(ValueError, match="turns"):
        load_items([bad])


def test_prompt_builder_feeds_replies_back_and_prefixes_code() -> None:
    tok = _FakeTokenizer()
    chat = PromptBuilder(tok, chat=True)
    item = BenchItem("a", "chat", ["first?", "second?"])
    ids = chat.prompt_ids(item, ["my reply"])
    messages = json.loads("".join(chr(i) for i in ids))
    assert messages == [
        {"role": "user", "content": "first?"},
        {"role": "assistant", "content": "my reply"},
        {"role": "user", "content": "second?"},
    ]
    code = BenchItem("h", "code_completion", ["def f():\n"])
    first = json.loads("".join(chr(i) for i in chat.prompt_ids(code, [])))
    assert first[0]["content"] == DEFAULT_CODE_PREFIX + "def f():\n"
    none = json.loads("".join(chr(i) for i in PromptBuilder(tok, True, "").prompt_ids(code, [])))
    assert none[0]["content"] == "def f():\n"
    raw = PromptBuilder(tok, chat=False)
    assert raw.prompt_ids(code, []) == [ord(c) for c in "def f():\n"]  # no prefix without chat
    assert "".join(chr(i) for i in raw.prompt_ids(item, ["R"])) == "first?R\n\nsecond?"


# ---- aggregation --------------------------------------------------------------------------------
def _rec(config, pid, cat, tokens, seconds, outputs, spec=None, backend="specdec", ttft=0.1):
    return {
        "id": pid,
        "category": cat,
        "config": config,
        "backend": backend,
        "num_turns": len(outputs),
        "prompt_tokens": 10,
        "output_tokens": tokens,
        "seconds": seconds,
        "ttft_s": ttft,
        "turns": [
            {"output_token_ids": o, "ttft_s": ttft, "seconds": seconds / len(outputs)}
            for o in outputs
        ],
        "spec_decode": spec,
        "identical_to_plain": None,
        "first_mismatch": None,
        "error": None,
    }


def _spec(drafts, draft_tokens, accepted, per_pos):
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos}  # fmt: skip


def _records(spec_b_tokens=(1, 2)):
    return [
        _rec("plain", "a", "x", 100, 10.0, [[1, 2, 3]]),
        _rec("plain", "b", "y", 50, 10.0, [[1, 2], [3]]),
        _rec("ngram:k=2", "a", "x", 100, 5.0, [[1, 2, 3]], _spec(10, 20, 15, [9, 6])),
        _rec(
            "ngram:k=2", "b", "y", 50, 2.5, [list(spec_b_tokens), [3]], _spec(30, 40, 5, [4, 1, 0])
        ),
        _rec("hf:plain", "a", "x", 100, 20.0, [[1, 2, 4]], backend="hf"),
        _rec("hf:plain", "b", "y", 50, 20.0, [[1, 2], [3]], backend="hf"),
    ]


CONFIGS = [("plain", "specdec"), ("ngram:k=2", "specdec"), ("hf:plain", "hf")]


def test_summary_speedup_and_acceptance_from_known_counts() -> None:
    records = _records()
    aggregate.compare_to_reference(records, "plain", greedy=True)
    rows = {(r["config"], r["category"]): r for r in aggregate.summarize(records, CONFIGS, "plain")}
    assert rows[("plain", "x")]["tokens_per_s"] == pytest.approx(10.0)
    assert rows[("plain", "overall")]["tokens_per_s"] == pytest.approx(150 / 20)
    # decode: tokens after the first over time after the first token, per turn
    assert rows[("plain", "x")]["decode_tokens_per_s"] == pytest.approx(2 / 9.9)
    assert rows[("plain", "y")]["decode_tokens_per_s"] == pytest.approx(1 / 9.8)
    assert rows[("ngram:k=2", "x")]["speedup"] == pytest.approx(2.0)
    assert rows[("ngram:k=2", "y")]["speedup"] == pytest.approx(4.0)
    assert rows[("ngram:k=2", "overall")]["speedup"] == pytest.approx((150 / 7.5) / (150 / 20))
    assert rows[("hf:plain", "overall")]["speedup"] == pytest.approx((150 / 40) / (150 / 20))
    assert rows[("hf:plain", "x")]["speedup_vs_own_plain"] == pytest.approx(1.0)
    x = rows[("ngram:k=2", "x")]["spec_decode"]
    assert x["mean_acceptance_length"] == pytest.approx(1 + 15 / 10)
    assert x["acceptance_rate"] == pytest.approx(15 / 20)
    assert x["acceptance_rate_per_pos"] == pytest.approx([0.9, 0.6])
    overall = rows[("ngram:k=2", "overall")]["spec_decode"]
    assert overall["accepted_per_pos"] == [13, 7, 0]
    assert overall["mean_acceptance_length"] == pytest.approx(1 + 20 / 40)
    assert overall["acceptance_rate"] == pytest.approx(20 / 60)
    assert overall["acceptance_rate_per_pos"] == pytest.approx([13 / 40, 7 / 40, 0.0])
    assert rows[("plain", "x")]["spec_decode"] is None
    assert rows[("ngram:k=2", "overall")]["ttft_ms_mean"] == pytest.approx(100.0)
    # The anchor differs from plain on prompt a: informative, never a failure.
    assert rows[("hf:plain", "overall")]["num_identical"] == 1
    assert aggregate.find_failures(records, "plain", {}) == []
    table = format_latency_table(list(rows.values()), greedy=True, reference="plain")
    assert "| ngram:k=2 | **overall** | 2 | 150 | 20.0 | 2.67x |" in table
    assert "no (1/2, informative)" in table and "FAIL" not in table


def test_mismatch_is_a_failure() -> None:
    assert aggregate.first_mismatch([[1, 2, 3]], [[1, 2, 3]]) is None
    assert aggregate.first_mismatch([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == {
        "turn": 1,
        "token_index": 1,
    }
    assert aggregate.first_mismatch([[1, 2]], [[1, 2, 3]]) == {"turn": 0, "token_index": 2}
    records = _records(spec_b_tokens=(1, 9))
    aggregate.compare_to_reference(records, "plain", greedy=True)
    failures = aggregate.find_failures(
        records, "plain", {"draft_model:model=x": "RuntimeError: boom"}
    )
    assert failures[0] == "draft_model:model=x: crashed: RuntimeError: boom"
    assert failures[1] == "ngram:k=2 / b: output differs from plain (turn 0, token 1)"
    assert len(failures) == 2
    rows = aggregate.summarize(records, CONFIGS, "plain")
    assert "**NO (1/2) FAIL**" in format_latency_table(rows, greedy=True, reference="plain")
    # Random sampling: nothing is compared, nothing fails.
    aggregate.compare_to_reference(records, "plain", greedy=False)
    assert aggregate.find_failures(records, "plain", {}) == []


# ---- end to end on the tiny model -----------------------------------------------------------
def _latency(tiny_llama, out: Path, *extra: str) -> int:
    return main([
        "bench", "latency", "--model", str(tiny_llama), "--dataset", str(FIXTURE), "--max-tokens", "12",
        "--output-dir", str(out), "--no-progress", *extra,
    ])  # fmt: skip


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5000  # a real figure, not an empty canvas


def test_latency_end_to_end(tiny_llama, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert _latency(tiny_llama, out, "--configs", "plain", "ngram:k=3") == 0
    result = json.loads((out / "results.json").read_text())
    assert {
        "environment",
        "reference",
        "greedy",
        "configs",
        "failures",
        "passed",
        "summary",
        "records",
    } <= set(result)
    assert result["passed"] is True and result["failures"] == [] and result["reference"] == "plain"
    env = result["environment"]
    for key in ("cpu_model", "cpu_cores_logical", "torch_threads", "torch_version", "specdec_version",
                "model", "git_commit", "date", "command", "settings"):  # fmt: skip
        assert key in env
    assert env["settings"]["max_tokens"] == 12 and env["settings"]["chat"] is True
    records = result["records"]
    assert len(records) == 6  # 3 prompts x 2 configs
    assert {(r["config"], r["id"]) for r in records} == {
        (c, i)
        for c in ("plain", "ngram:k=3")
        for i in ("tiny/edit-0", "tiny/edit-1", "tiny/chat-0")
    }
    for r in records:
        for key in ("id", "category", "config", "prompt_tokens", "output_tokens", "seconds", "ttft_s",
                    "spec_decode", "identical_to_plain", "turns"):  # fmt: skip
            assert key in r
        assert r["output_tokens"] == sum(len(t["output_token_ids"]) for t in r["turns"])
        assert r["seconds"] > 0 and r["ttft_s"] > 0
        if r["config"] == "ngram:k=3":
            assert r["identical_to_plain"] is True
            assert set(r["spec_decode"]) >= {
                "num_drafts",
                "accepted_per_pos",
                "mean_acceptance_length",
            }
        else:
            assert r["spec_decode"] is None
    chat = next(r for r in records if r["id"] == "tiny/chat-0")
    assert chat["num_turns"] == 2 and len(chat["turns"]) == 2
    assert chat["turns"][1]["prompt_tokens"] > chat["turns"][0]["prompt_tokens"]  # reply fed back
    summary = {(r["config"], r["category"]) for r in result["summary"]}
    assert summary == {
        (c, k) for c in ("plain", "ngram:k=3") for k in ("code_edit", "chat", "overall")
    }
    table = (out / "table.md").read_text()
    assert table.startswith("| config | category |") and table.count("\n") == 2 + 6
    _check_png(out / "speedup.png")
    _check_png(out / "acceptance_by_position.png")
    assert "| ngram:k=3 | **overall** |" in capsys.readouterr().out


def test_latency_interleaved_runs_each_prompt_on_every_config(
    tiny_llama, tmp_path, monkeypatch
) -> None:
    from specdec.bench import runners

    order: list[tuple[str, int]] = []
    real = runners.run_item

    def spy(runner, builder, item, params, config):
        order.append((config.label, len(item.turns)))
        return real(runner, builder, item, params, config)

    monkeypatch.setattr("specdec.bench.latency.run_item", spy)
    out = tmp_path / "inter"
    code = _latency(
        tiny_llama, out, "--configs", "plain", "ngram:k=3", "--interleave", "--no-plots"
    )
    assert code == 0
    # prompt by prompt, every configuration in turn, the order rotating
    assert [label for label, _ in order] == [
        "plain", "ngram:k=3", "ngram:k=3", "plain", "plain", "ngram:k=3",
    ]  # fmt: skip
    result = json.loads((out / "results.json").read_text())
    assert result["passed"] is True and len(result["records"]) == 6
    assert result["environment"]["settings"]["interleave"] is True
    spec = [r for r in result["records"] if r["config"] == "ngram:k=3"]
    assert all(r["identical_to_plain"] is True for r in spec)
    assert {(r["config"], r["category"]) for r in result["summary"]} == {
        (c, k) for c in ("plain", "ngram:k=3") for k in ("code_edit", "chat", "overall")
    }


def test_latency_repeated_task_hits_the_prefix_cache(tiny_llama, tmp_path) -> None:
    """Both passes run in one engine per config: pass 2 reuses pass 1's prompts; the warm-up
    leaves nothing behind; --no-enable-prefix-caching reuses nothing."""
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()[:2]]
    data = tmp_path / "repeated.jsonl"
    data.write_text("".join(
        json.dumps(r | {"id": f"{p}/{r['id']}", "category": p}) + "\n"
        for p in ("pass1", "pass2") for r in rows
    ))  # fmt: skip
    argv = ["bench", "latency", "--model", str(tiny_llama), "--dataset", str(data), "--max-tokens",
            "8", "--no-progress", "--no-plots", "--configs", "plain", "ngram:k=3"]  # fmt: skip
    assert main([*argv, "--output-dir", str(tmp_path / "on")]) == 0
    result = json.loads((tmp_path / "on" / "results.json").read_text())
    for r in result["records"]:
        first = r["id"] == "pass1/tiny/edit-0"  # the warm-up's prompt: not cached
        if r["category"] == "pass2":
            assert r["cached_prompt_tokens"] == r["prompt_tokens"] - 1
        elif first:
            assert r["cached_prompt_tokens"] == 0
        else:  # the chat template's first tokens are shared
            assert 0 < r["cached_prompt_tokens"] < r["prompt_tokens"] // 2
    overall = {r["config"]: r for r in result["summary"] if r["category"] == "overall"}
    cached = sum(r["cached_prompt_tokens"] for r in result["records"] if r["config"] == "plain")
    assert overall["plain"]["cached_prompt_tokens"] == cached > 0
    table = (tmp_path / "on" / "table.md").read_text()
    assert "cached prompt tokens" in table.splitlines()[0]
    assert f"| {cached}/{overall['plain']['prompt_tokens']} (" in table
    assert main([*argv, "--output-dir", str(tmp_path / "off"), "--no-enable-prefix-caching"]) == 0
    result = json.loads((tmp_path / "off" / "results.json").read_text())
    assert all(r["cached_prompt_tokens"] == 0 for r in result["records"])
    assert result["environment"]["settings"]["enable_prefix_caching"] is False


def test_latency_forced_mismatch_fails(tiny_llama, tmp_path, monkeypatch, capsys) -> None:
    from specdec.bench import runners

    real = runners.SpecdecRunner.generate

    def corrupt(self, prompt_ids, params):
        result = real(self, prompt_ids, params)
        if self.llm.engine.spec is not None:  # speculative configs only
            result.output_token_ids[-1] += 1
        return result

    monkeypatch.setattr(runners.SpecdecRunner, "generate", corrupt)
    out = tmp_path / "bad"
    assert (
        _latency(
            tiny_llama, out, "--categories", "code_edit", "--configs", "ngram:k=3", "--no-plots"
        )
        == 1
    )
    result = json.loads((out / "results.json").read_text())
    assert result["passed"] is False and len(result["failures"]) == 2
    bad = [r for r in result["records"] if r["config"] == "ngram:k=3"]
    assert all(r["identical_to_plain"] is False for r in bad)
    assert bad[0]["first_mismatch"] == {"turn": 0, "token_index": bad[0]["output_tokens"] - 1}
    assert "FAILURE" in capsys.readouterr().err
    assert "FAIL**" in (out / "table.md").read_text()


def test_latency_anchors(tiny_llama, tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "anchors"
    configs = ["--configs", "plain", "hf:plain", "llama_cpp:plain"]
    assert (
        _latency(
            tiny_llama,
            out,
            "--num-prompts",
            "1",
            "--categories",
            "code_edit",
            "--no-plots",
            *configs,
        )
        == 0
    )
    result = json.loads((out / "results.json").read_text())
    hf = [r for r in result["records"] if r["config"] == "hf:plain"]
    assert len(hf) == 1 and hf[0]["backend"] == "hf" and hf[0]["output_tokens"] > 0
    assert hf[0]["identical_to_plain"] is not None  # informative
    row = next(
        r for r in result["summary"] if r["config"] == "hf:plain" and r["category"] == "overall"
    )
    assert row["speedup"] is not None
    # its own process, without the OMP_WAIT_POLICY specdec set for itself; settings recorded
    info = result["anchors"]["hf:plain"]
    assert info["environment"]["omp_wait_policy"] is None
    assert "OMP_WAIT_POLICY" in info["environment"]["removed_from_ours"]
    assert info["settings"]["dtype"] == "float32" and "transformers" in info["library"]
    table = (out / "table.md").read_text()
    assert "- `hf:plain`: transformers " in table and "OMP_WAIT_POLICY unset" in table
    # llama.cpp: not installed (CI), or installed but the tiny model is no GGUF file
    assert "llama_cpp:plain" in result["skipped"] and "llama_cpp:plain" not in result["anchors"]
    assert "skipped llama_cpp:plain" in capsys.readouterr().out


def test_latency_too_long_prompts_are_reported_not_failed(tiny_llama, tmp_path, capsys) -> None:
    out = tmp_path / "long"
    argv = ["--max-model-len", "100", "--configs", "plain", "ngram:k=2", "--no-plots"]
    assert _latency(tiny_llama, out, *argv) == 0  # the same prompts fail for plain too
    result = json.loads((out / "results.json").read_text())
    errors = {(r["config"], r["id"]) for r in result["records"] if r["error"]}
    assert ("plain", "tiny/edit-0") in errors and ("ngram:k=2", "tiny/edit-0") in errors
    overall = next(
        r for r in result["summary"] if r["config"] == "plain" and r["category"] == "overall"
    )
    assert overall["num_errors"] == len(errors) // 2
    assert "max_model_len 100" in capsys.readouterr().err


def test_bad_config_is_a_clear_cli_error(tiny_llama, tmp_path, capsys) -> None:
    assert _latency(tiny_llama, tmp_path / "x", "--configs", "ngram:k") == 2
    assert "expected key=value" in capsys.readouterr().err


# ---- forward cost ---------------------------------------------------------------------------
def test_forward_cost_smoke(tiny_llama, tmp_path, capsys) -> None:
    path = tmp_path / "fc.json"
    argv = ["bench", "forward-cost", "--model", str(tiny_llama), "--context", "20", "--ns", "2,4",
            "--repeats", "2", "--warmup", "1", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["n"] for r in rows] == [1, 2, 4]
    assert rows[0]["ratio"] == 1.0
    assert all(r["ms"] > 0 and len(r["ms_all"]) == 2 for r in rows)
    assert "ratio to N=1" in capsys.readouterr().out


def test_latency_runs_without_a_dataset_on_the_packaged_prompts(tiny_llama, tmp_path) -> None:
    """No --dataset: the package's own prompt set (written for specdec, no benchmark's)."""
    items = load_items(None)
    assert len(items) >= 8 and all(it.id.startswith("default/") for it in items)
    assert {"code_edit", "extraction", "chat"} <= {it.category for it in items}
    out = tmp_path / "run"
    argv = ["bench", "latency", "--model", str(tiny_llama), "--max-tokens", "4", "--num-prompts",
            "1", "--categories", "code_edit,chat", "--configs", "plain", "--no-plots",
            "--max-model-len", "512", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    assert {r["id"] for r in records} == {"default/edit-0", "default/chat-0"}
