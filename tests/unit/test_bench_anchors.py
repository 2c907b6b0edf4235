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

FIXTURE = Path(__file__).parents[1] / "fixtures" / "bench_tiny.jsonl"
EOG = {0}  # any id: the tiny model's replies are random bytes


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
            model=str(tiny_llama), datasets=[str(FIXTURE)], configs=["plain", SUFFIX],
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
            model=str(tiny_llama), datasets=[str(FIXTURE)], configs=["plain", SUFFIX],
            max_tokens=8, concurrency=(1,), max_model_len=256, output_dir=str(tmp_path / name),
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
