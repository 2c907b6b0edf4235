"""Honest anchors: each in its own process with a clean environment, settings recorded; and a
warm-up that leaves nothing behind in any drafter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.bench.anchor_worker import LLAMA_N_BATCH, llama_settings
from specdec.bench.configs import parse_config
from specdec.bench.dataset import WARMUP_PROMPT, load_items
from specdec.bench.latency import LatencyOptions, run_latency
from specdec.bench.runners import ANCHOR_WORKER, AnchorRunner, GenParams, anchor_environment
from specdec.bench.serve import ServeOptions, run_serve
from specdec.config import EngineArgs

FIXTURE = Path(__file__).parents[2] / "fixtures" / "bench_tiny.jsonl"
EOG = {0}  # any id: the tiny model's replies are random bytes
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A random-weight llama in float32 GGUF, with a byte-level vocabulary and a chat template:
    small enough for llama.cpp and our engine alike to load in a blink."""
    import gguf
    import numpy as np

    from specdec.model.tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    merges = ["Ġ t", "h e", "i n", "Ġ a"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges] + specials
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)
    hidden, ff, heads, kv_heads, layers = 64, 128, 4, 2, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def add(name: str, *shape: int, scale: float = 0.3) -> None:
        data = rng.normal(0.0, scale, shape) if len(shape) > 1 else 1.0 + rng.normal(0, 0.1, shape)
        w.add_tensor(name, data.astype(np.float32))

    add("token_embd.weight", len(tokens), hidden)
    add("output_norm.weight", hidden)
    head_dim = hidden // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", ff, hidden)
        add(f"blk.{i}.ffn_up.weight", ff, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.f32.gguf")


def test_anchor_environment_strips_what_specdec_sets(monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own: kept
    env, removed = anchor_environment()
    assert "OMP_WAIT_POLICY" not in env and removed == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env["OMP_NUM_THREADS"] == "3" and env["PATH"] == os.environ["PATH"]
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # ours is untouched
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert anchor_environment()[1] == {}


def test_llama_cpp_settings_plain_and_prompt_lookup() -> None:
    req = {"method": "plain", "options": {}, "n_ctx": 4096, "seed": 7}
    plain = llama_settings(req, num_cores=6)
    assert plain == {
        "n_ctx": 4096, "n_batch": LLAMA_N_BATCH, "n_threads": 6, "n_threads_batch": 6,
        "flash_attn": True, "logits_all": False, "draft_model": None, "seed": 7, "verbose": False,
    }  # fmt: skip
    lookup = llama_settings(
        req | {"method": "prompt_lookup", "options": {"num_pred_tokens": 10}}, 2
    )
    assert lookup["logits_all"] is True  # its draft API needs every row's logits
    assert lookup["draft_model"] == {"class": "LlamaPromptLookupDecoding", "num_pred_tokens": 10}
    assert lookup["flash_attn"] is True and lookup["n_threads"] == lookup["n_threads_batch"] == 2


def test_hf_anchor_runs_in_its_own_clean_process(tiny_llama, monkeypatch) -> None:
    import torch
    import transformers

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_DISPLAY_ENV", "FALSE")
    runner = AnchorRunner(parse_config("hf:plain"), tiny_llama, EOG, n_ctx=256, seed=0)
    try:
        assert runner.proc is not None and runner.proc.pid != os.getpid()
        env = runner.info["environment"]
        assert env["pid"] == runner.proc.pid and env["python"] == sys.executable
        assert env["omp_wait_policy"] is None and "OMP_WAIT_POLICY" not in env["env"]
        assert env["env"]["OMP_DISPLAY_ENV"] == "FALSE"  # the user's settings reach it
        assert env["removed_from_ours"] == {"OMP_WAIT_POLICY": "PASSIVE"}
        assert env["specdec_imported"] is False
        assert runner.info["library"]["transformers"] == transformers.__version__
        assert runner.info["settings"]["dtype"] == "float32"
        prompt = list(range(40, 60))
        turn = runner.generate(prompt, GenParams(max_tokens=6, ignore_eos=True))
    finally:
        proc = runner.proc
        runner.close()
    assert runner.proc is None and proc is not None and proc.returncode == 0
    assert 0 < turn.ttft_s <= turn.seconds and turn.num_prompt_tokens == len(prompt)
    # the same computation as transformers in this process
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          min_new_tokens=6, do_sample=False, pad_token_id=0)  # fmt: skip
    assert turn.output_token_ids == want[0, len(prompt) :].tolist()


def test_worker_replies_stay_clean_when_libraries_print(tiny_llama, tmp_path) -> None:
    """Whatever is printed after the worker starts (Python or C level) goes to stderr."""
    driver = f"""
import importlib.util, os
spec = importlib.util.spec_from_file_location("anchor_worker", {str(ANCHOR_WORKER)!r})
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
real_load = worker.load
def noisy_load(req):
    print("python noise", flush=True)
    os.write(1, b"fd noise\\n")
    return real_load(req)
worker.load = noisy_load
worker.main()
"""
    requests = [
        {"op": "generate", "prompt_ids": [1], "max_tokens": 1, "temperature": 0.0, "seed": 0,
         "ignore_eos": False},  # before load: an error reply, not a crash
        {"op": "load", "backend": "hf", "method": "plain", "options": {},
         "model_path": str(tiny_llama), "eog_token_ids": [0], "n_ctx": 64, "seed": 0},
        {"op": "generate", "prompt_ids": [40, 41, 42], "max_tokens": 3, "temperature": 0.0,
         "seed": 0, "ignore_eos": True},
        {"op": "close"},
    ]  # fmt: skip
    env, _ = anchor_environment()
    done = subprocess.run(
        [sys.executable, "-c", driver],
        input="".join(json.dumps(r) + "\n" for r in requests),
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["ok"] for r in replies] == [False, True, True]
    assert replies[0]["error_type"] == "RuntimeError" and replies[0]["unavailable"] is False
    assert len(replies[2]["output_token_ids"]) == 3
    assert "python noise" in done.stderr and "fd noise" in done.stderr


def test_missing_anchor_package_is_unavailable_before_any_process(monkeypatch, tmp_path) -> None:
    from specdec.bench import runners

    monkeypatch.setattr(runners.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(runners.subprocess, "Popen", None)  # would fail if a child were started
    with pytest.raises(runners.AnchorUnavailable, match="pip install llama-cpp-python"):
        AnchorRunner(parse_config("llama_cpp:plain"), tmp_path / "m.gguf", EOG, n_ctx=64, seed=0)


def test_anchor_load_failure_is_an_error_not_a_hang(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="hf:plain: .*Error"):
        AnchorRunner(parse_config("hf:plain"), tmp_path / "missing", EOG, n_ctx=64, seed=0)


# ---- the warm-up leaves nothing behind ----------------------------------------------------------
# NOTE: adaptive=false: the controller's choices follow measured step times, so only fixed-k
# drafting makes the drafted and accepted counts a function of the drafter's memory alone.
SUFFIX = "suffix:k=4,adaptive=false"


def _counts(record: dict) -> tuple:
    """The drafting figures that do not depend on the clock."""
    spec = record["spec_decode"] or {}
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos",
            "mean_acceptance_length")  # fmt: skip
    return tuple(spec.get(k) for k in keys)


def test_latency_first_prompt_does_not_depend_on_the_warm_up(tiny_llama, tmp_path) -> None:
    first = load_items([FIXTURE])[0]

    def run(warmup: str, name: str) -> list[dict]:
        opts = LatencyOptions(
            engine=EngineArgs(model=str(tiny_llama)), datasets=[str(FIXTURE)], configs=["plain", SUFFIX],
            max_tokens=12, output_dir=str(tmp_path / name), plots=False, progress=False,
            warmup_prompt=warmup,
        )  # fmt: skip
        result = run_latency(opts)
        assert result.exit_code == 0
        return result.payload["records"]

    # the old warm-up (the first measured prompt itself) against the built-in one
    repeat, fresh = run(first.turns[0], "repeat"), run(WARMUP_PROMPT, "fresh")
    assert first.turns[0] != WARMUP_PROMPT

    def figures(records: list[dict]) -> list[tuple]:
        return [(r["config"], r["id"], [t["output_token_ids"] for t in r["turns"]], _counts(r))
                for r in records]  # fmt: skip

    assert figures(repeat) == figures(fresh)
    measured = next(r for r in repeat if r["config"] == SUFFIX and r["id"] == first.id)
    assert measured["spec_decode"]["num_drafts"] > 0  # it drafted: the tree's memory mattered
    assert measured["cached_prompt_tokens"] == 0  # and the prefix cache forgot the warm-up


def test_serve_first_prompt_does_not_depend_on_the_warm_up(tiny_llama, tmp_path) -> None:
    first = load_items([FIXTURE])[0]

    def run(warmup: str, name: str) -> list[dict]:
        opts = ServeOptions(
            engine=EngineArgs(model=str(tiny_llama), max_model_len=256), datasets=[str(FIXTURE)],
            configs=["plain", SUFFIX], max_tokens=8, concurrency=(1,), output_dir=str(tmp_path / name),
            warmup_prompt=warmup,
        )  # fmt: skip
        result = run_serve(opts)
        assert result.exit_code == 0
        return sorted(result.payload["records"], key=lambda r: (r["config"], r["id"], r["turn"]))

    repeat, fresh = run(first.turns[0], "repeat"), run(WARMUP_PROMPT, "fresh")

    def figures(records: list[dict]) -> list[tuple]:
        keys = ("config", "id", "turn", "text", "output_tokens", "cached_prompt_tokens")
        return [(*(r[k] for k in keys), _counts(r)) for r in records]

    assert figures(repeat) == figures(fresh)
    assert sum(r["spec_decode"]["num_drafts"] for r in repeat if r["config"] == SUFFIX) > 0


def test_llama_cpp_anchors_run_plain_and_as_their_api_needs(tiny_gguf, tmp_path) -> None:
    pytest.importorskip("llama_cpp")  # an optional extra: CI does not install it
    lookup = "llama_cpp:prompt_lookup:k=4"
    opts = LatencyOptions(
        engine=EngineArgs(model=str(tiny_gguf)), datasets=[str(FIXTURE)], configs=["plain", "llama_cpp:plain", lookup],
        max_tokens=12, output_dir=str(tmp_path / "run"), plots=False, progress=False,
    )  # fmt: skip
    result = run_latency(opts)
    assert result.exit_code == 0 and result.payload["skipped"] == {}
    anchors = result.payload["anchors"]
    plain = anchors["llama_cpp:plain"]
    cores = len(os.sched_getaffinity(0))
    assert plain["settings"] == {
        "n_ctx": 4096, "n_batch": 512, "n_threads": cores, "n_threads_batch": cores,
        "flash_attn": True, "logits_all": False, "draft_model": None, "seed": 0, "verbose": False,
        "prefix_reuse": True,  # llama-cpp-python's default, as our prefix caching is on
    }  # fmt: skip
    assert anchors[lookup]["settings"]["logits_all"] is True
    assert anchors[lookup]["settings"]["draft_model"]["num_pred_tokens"] == 4
    for info in anchors.values():
        assert info["environment"]["omp_wait_policy"] is None
        assert info["environment"]["specdec_imported"] is False
        assert info["library"]["llama_cpp_python"]
    for r in result.payload["records"]:
        assert r["error"] is None and r["output_tokens"] > 0 and 0 < r["ttft_s"] <= r["seconds"]
        if r["config"] == "llama_cpp:plain":  # float32 weights: the same greedy tokens as ours
            assert r["identical_to_plain"] is True
    table = (tmp_path / "run" / "table.md").read_text()
    assert "- `llama_cpp:plain`: llama_cpp_python " in table and "logits_all False" in table


def test_serve_measures_llama_cpp_server_in_its_own_process(tiny_gguf, tmp_path) -> None:
    for module in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"):
        pytest.importorskip(module)  # llama-cpp-python[server]: an optional extra
    opts = ServeOptions(
        engine=EngineArgs(model=str(tiny_gguf), max_model_len=256), datasets=[str(FIXTURE)],
        configs=["plain", "llama_cpp:plain"], max_tokens=8, concurrency=(1, 2), output_dir=str(tmp_path / "run"),
    )  # fmt: skip
    result = run_serve(opts)
    assert result.exit_code == 0 and result.payload["skipped"] == {}  # its differences inform
    info = result.payload["anchors"]["llama_cpp:plain"]
    assert info["environment"]["omp_wait_policy"] is None
    assert "OMP_WAIT_POLICY" in info["environment"]["removed_from_ours"]
    settings = info["settings"]
    assert settings["logits_all"] is False and settings["flash_attn"] is True
    assert settings["interrupt_requests"] is False and settings["request"]["repeat_penalty"] == 1.0
    records = result.payload["records"]
    ours = {(r["id"], r["turn"]): r for r in records if r["config"] == "plain"}
    theirs = [r for r in records if r["config"] == "llama_cpp:plain"]
    assert len(theirs) == 8 and all(r["backend"] == "llama_cpp" for r in theirs)
    for r in theirs:
        assert r["error"] is None and 1 <= r["output_tokens"] <= 9 and 0 < r["ttft_s"] <= r["e2e_s"]
        if r["turn"] == 0:  # counted here with the same chat template: the same prompt tokens
            assert r["prompt_tokens"] == ours[r["id"], 0]["prompt_tokens"]
    rows = [s for s in result.payload["summary"] if s["config"] == "llama_cpp:plain"]
    assert [s["concurrency"] for s in rows] == [1, 2] and all(s["speedup"] for s in rows)
    table = (tmp_path / "run" / "table.md").read_text()
    assert "| llama_cpp:plain | 1 | 4 |" in table and "FAIL" not in table
    assert "- `llama_cpp:plain`: llama_cpp_python " in table
    assert (tmp_path / "run" / "llama_cpp_server.log").exists()
