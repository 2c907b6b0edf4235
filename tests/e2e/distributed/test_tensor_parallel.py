"""Tensor parallelism (issue 31): TP 2 on the mp backend, exact against TP 2 plain for every
drafter, close to TP 1, bad sizes and bindings, a worker killed mid-generation, the server."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import ConfigError, EngineConfig
from specdec.engine.executor import ExecutorError
from specdec.model.llama import SeqBatch
from specdec.worker.binding import parse_cpu_binding
from specdec.worker.shard import plan_shard
from tests.fixtures.engine import _record_prefixes
from tests.fixtures.server import REPO, _start, serve

PROMPTS = ["a b a b a b a", "the cat sat on the mat, the cat", "1 2 3 4 1 2 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
HEAD = str(REPO / "specdec" / "heads" / "smollm2-135m-eagle3")


def _worker_pids(parent: int) -> list[int]:
    """Live ``specdec.worker.tp`` processes whose parent is ``parent``."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == parent and b"specdec.worker.tp" in cmd:
            pids.append(int(d.name))
    return pids


def _gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False


def _tokens(llm: LLM, prompts: list[str], sp: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def _runs(llm: LLM) -> tuple:
    """Greedy and seeded, batched and each prompt alone."""
    alone = [_tokens(llm, [p], GREEDY)[0] for p in PROMPTS[:2]]
    return _tokens(llm, PROMPTS, GREEDY), _tokens(llm, PROMPTS, SEEDED), alone


def _llm(model: str, tp: int, spec: dict | None = None, **kw) -> LLM:
    return LLM(model, max_model_len=128, tensor_parallel_size=tp, speculative_config=spec, **kw)


def test_every_drafter_at_tp2_equals_tp2_plain_on_the_tiny_model(tiny_llama, tiny_draft) -> None:
    plain = _llm(str(tiny_llama), 2)
    assert plain.engine.executor.num_ranks == 2 and len(plain.engine.executor.workers.pids) == 1
    want = _runs(plain)
    plain.engine.shutdown()
    specs = [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
        {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 3},
    ]
    for spec in specs:
        llm = _llm(str(tiny_llama), 2, spec)
        assert _runs(llm) == want, spec["method"]
        llm.engine.shutdown()


def test_tp2_with_an_int8_cache_speculates_exactly_and_mirrors_prefixes(tiny_llama) -> None:
    """Each rank keeps its heads' 8-bit KV; drafts and prefix-cache copies stay exact."""
    plain = _llm(str(tiny_llama), 2, kv_cache_dtype="int8")
    assert plain.engine.kv.k.dtype == torch.int8
    want = _runs(plain)
    plain.engine.shutdown()
    spec = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
    llm = _llm(str(tiny_llama), 2, spec, kv_cache_dtype="int8", enable_prefix_caching=True)
    assert _runs(llm) == want
    assert _runs(llm) == want  # the second pass reuses prefixes: copies mirrored to the worker
    assert llm.engine.kv.num_prefix_cache_hits > 0
    llm.engine.shutdown()


def test_tp2_int8_keys_take_every_ranks_key_transform(tiny_llama) -> None:
    """Every rank measures its own heads' key transform for the 8-bit cache, in lockstep, as
    TP 1 measures all of them: with float32 activations (no rounding of the linears' inputs) TP 2's
    logits stay as close to TP 1's as with a float cache. A rank storing its keys another way
    rounds them otherwise (~1e-2 of the logits here)."""
    kw = {"kv_cache_dtype": "int8", "activation_dtype": "float32"}
    one, two = _llm(str(tiny_llama), 1, **kw), _llm(str(tiny_llama), 2, **kw)
    heads = one.engine.model.cfg.num_kv_heads // 2
    assert torch.allclose(
        two.engine.model.key_shift, one.engine.model.key_shift[:, :heads], rtol=1e-4, atol=1e-5
    )
    ids = [5, 17, 33, 2, 9, 100, 7, 64, 5, 17, 33, 2, 9, 100, 7, 64]
    assert (_logits(one, ids) - _logits(two, ids)).abs().max().item() < 1e-3
    two.engine.shutdown()


def test_tp2_shares_prefixes_exactly(tiny_llama) -> None:
    """Four requests on one 300-token document: each rank reads the shared block of its heads
    where the other slot holds it, and the copies of the rest reach the worker."""
    doc = torch.randint(3, 250, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [{"prompt_token_ids": doc + [5 + i, 9, 11 + i]} for i in range(4)]
    sp = SamplingParams(temperature=0.8, seed=2, max_tokens=12, ignore_eos=True)
    kw = {"max_model_len": 512, "max_num_batched_tokens": 64}
    plain = LLM(str(tiny_llama), tensor_parallel_size=2, enable_prefix_caching=False, **kw)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, sp, use_tqdm=False)]
    plain.engine.shutdown()
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **kw)
    assert llm.engine.kv.share_block == 256
    seen = _record_prefixes(llm)
    for _ in range(2):  # cold (the first request's prompt shared), then cached
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want
    assert len(seen) > 8 and all(n == 256 for _, n in seen)  # shared reads, not only copies
    llm.engine.shutdown()


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [T, V]
    m = llm.engine.model
    kv = m.make_kv_cache(1, 64)
    h = m.forward(torch.tensor(ids), torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv)
    return m.compute_logits(h)


def test_tp2_is_close_to_tp1_and_kv_mirrors_prefix_reuse(tiny_llama) -> None:
    one, two = _llm(str(tiny_llama), 1), _llm(str(tiny_llama), 2, enable_prefix_caching=True)
    ids = [5, 17, 33, 2, 9, 100, 7, 64]
    assert (_logits(one, ids) - _logits(two, ids)).abs().max().item() < 1e-3
    # the output layer split by vocabulary rows, gathered: the same bits as the whole one
    lo, hi = two.engine.model.vocab_range
    assert lo == 0 < hi < two.engine.model.vocab_rows and one.engine.model.vocab_range is None
    h = torch.randn(3, one.engine.model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(one.engine.model.compute_logits(h), two.engine.model.compute_logits(h))
    # a second pass reuses cached prefixes (a slot copy on rank 0, mirrored to the workers)
    for llm in (one, two):
        _tokens(llm, PROMPTS, GREEDY)
    assert _tokens(one, PROMPTS, SEEDED) == _tokens(two, PROMPTS, SEEDED)
    assert _tokens(one, PROMPTS, GREEDY) == _tokens(two, PROMPTS, GREEDY)
    two.engine.shutdown()


def test_tp2_fused_stack_equals_python_layers_over_gloo(tiny_llama, monkeypatch) -> None:
    """The fused layer stack with the native shared-memory all-reduce inside gives the bits of
    the Python layers reduced by gloo (at 2 ranks both add rank 0 + rank 1)."""
    fused = _llm(str(tiny_llama), 2)
    assert fused.engine.model.use_fused_layers
    ids = [5, 17, 33, 2, 9, 100, 7, 64]
    want, tokens = _logits(fused, ids), _tokens(fused, PROMPTS, SEEDED)
    fused.engine.shutdown()
    monkeypatch.setenv("SPECDEC_TP_SHM", "0")
    slow = _llm(str(tiny_llama), 2)
    assert not slow.engine.model.use_fused_layers
    assert torch.equal(_logits(slow, ids), want)
    assert _tokens(slow, PROMPTS, SEEDED) == tokens
    slow.engine.shutdown()


def test_row_parallel_biases_are_added_once(tmp_path) -> None:
    """o_proj and down_proj biases (Llama's attention_bias / mlp_bias) belong to rank 0's
    partial sum only: TP 2 stays close to TP 1 (each rank adding them would double them)."""
    from safetensors.torch import load_file, save_file

    from tests.fixtures.models import make_tiny_model

    folder = make_tiny_model(tmp_path / "biased", "llama", 9, 2, attention_bias=True, mlp_bias=True)
    weights = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(9)
    for name, t in weights.items():
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            weights[name] = torch.randn(t.shape, generator=g)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    one, two = _llm(str(folder), 1), _llm(str(folder), 2)
    ids = [5, 17, 33, 2, 9, 100, 7, 64]
    assert (_logits(one, ids) - _logits(two, ids)).abs().max().item() < 1e-3
    two.engine.shutdown()


def test_smollm2_tp2_eagle3_and_ngram_exact_and_close_to_tp1() -> None:
    from specdec.model.registry import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    prompts = ["def fibonacci(n):", "The capital of France is"]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=16)
    one = _llm("smollm2-135m", 1)
    ref = _tokens(one, prompts, greedy)
    out = {}
    eagle3 = {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3,
              "draft_tensor_parallel_size": 1}  # fmt: skip
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    for name, spec in (("plain", None), ("eagle3", eagle3), ("ngram", ngram)):
        llm = _llm("smollm2-135m", 2, spec, distributed_executor_backend="mp")
        out[name] = (_tokens(llm, prompts, greedy), _tokens(llm, prompts, seeded))
        llm.engine.shutdown()
    assert out["eagle3"] == out["plain"] and out["ngram"] == out["plain"]
    # TP 1 against TP 2 (int8 activations): the texts run together for a while, then a near-tie
    # may flip (the 90% goal is over 30 prompts x 128 tokens: benchmarks/tp_bench.py)
    for a, b in zip(out["plain"][0], ref):
        assert a[:8] == b[:8]
    # NOTE: float32 activations: the partial sums add in another order (30 layers amplify it to
    # ~3e-4 of the largest logit); with int8 activations an order-level change can flip a
    # rounding to int8, so TP 1 and TP 2 logits differ by quantization noise (~1 on ~25)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    f32 = _logits(_llm("smollm2-135m", 1, activation_dtype="float32"), ids)
    two = _llm("smollm2-135m", 2, activation_dtype="float32")
    assert (f32 - _logits(two, ids)).abs().max() < 1e-3 * f32.abs().max()
    two.engine.shutdown()


def test_bad_sizes_and_bindings_are_one_line_errors(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size 8 exceeds the model's 4 attention"):
        _llm(str(tiny_llama), 8)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(model="x", tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="distributed_executor_backend uni runs one rank"):
        EngineConfig(model="x", tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ConfigError, match="distributed_executor_backend must be one of"):
        EngineConfig(model="x", tensor_parallel_size=2, distributed_executor_backend="mpi")
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=f"cpu_binding '0|{missing}' names cores .*: {missing}"):
        EngineConfig(model="x", tensor_parallel_size=2, cpu_binding=f"0|{missing}")
    with pytest.raises(ConfigError, match="names 1 core groups for tensor_parallel_size 2"):
        EngineConfig(model="x", tensor_parallel_size=2, cpu_binding="0")
    with pytest.raises(ConfigError, match="cpu_binding 'a-b': expected core lists"):
        EngineConfig(model="x", tensor_parallel_size=2, cpu_binding="a-b")
    usable = sorted(os.sched_getaffinity(0))
    groups = parse_cpu_binding(None, 2)
    assert len(groups) == 2 and sorted(sum(groups, [])) == usable[: len(usable) // 2 * 2]
    os.environ["SPECDEC_CPU_OMP_THREADS_BIND"] = f"{usable[0]}|{usable[0]}"
    try:
        assert parse_cpu_binding(None, 2) == [[usable[0]], [usable[0]]]
    finally:
        del os.environ["SPECDEC_CPU_OMP_THREADS_BIND"]


def test_uneven_head_splits_keep_gqa_groups_whole_or_copy_them() -> None:
    from specdec.model.arch import ArchConfig

    smol = ArchConfig("llama", 100, 576, 1536, 2, 9, 3, 64, 1e-5, 1e4, 2048)
    # 9 query heads over 3 KV heads (groups of 3): TP 2 splits whole groups 1 / 2; at TP 4
    # (fewer KV heads than ranks) each partial group's query heads get their own KV copy
    two = [plan_shard(smol, r, 2) for r in range(2)]
    assert [(p.q_lo, p.q_hi) for p in two] == [(0, 3), (3, 9)]
    assert [p.kv_heads for p in two] == [(0,), (1, 2)]
    assert [plan_shard(smol, r, 3).kv_heads for r in range(3)] == [(0,), (1,), (2,)]
    four = [plan_shard(smol, r, 4) for r in range(4)]
    assert [(p.q_lo, p.q_hi) for p in four] == [(0, 2), (2, 4), (4, 6), (6, 9)]
    assert [p.kv_heads for p in four] == [(0,), (0, 1), (1,), (2,)]
    assert sum(p.f_hi - p.f_lo for p in four) == 1536 and all(p.f_lo % 32 == 0 for p in four)


def test_tp4_with_fewer_kv_heads_than_ranks_copies_partial_groups_and_stays_close(tmp_path) -> None:
    """6 query heads over 3 KV heads at TP 4: a rank whose query heads span two groups keeps a
    KV copy per query head; logits stay within 1e-3 of TP 1 and greedy text equal."""
    from tests.fixtures.models import make_tiny_model

    folder = make_tiny_model(tmp_path / "gqa", "llama", 11, 2, hidden_size=96,
                             num_attention_heads=6, num_key_value_heads=3)  # fmt: skip
    one, four = _llm(str(folder), 1), _llm(str(folder), 4)
    assert plan_shard(one.engine.model.cfg, 1, 4).kv_heads == (0, 1)  # q heads 1, 2
    ids = [5, 17, 33, 2, 9, 100, 7, 64]
    assert (_logits(one, ids) - _logits(four, ids)).abs().max().item() < 1e-3
    assert _tokens(one, PROMPTS[:2], GREEDY) == _tokens(four, PROMPTS[:2], GREEDY)
    four.engine.shutdown()


def test_a_worker_killed_mid_generation_fails_the_step_without_hang_or_orphan(tiny_llama) -> None:
    llm = _llm(str(tiny_llama), 2)
    pids = llm.engine.executor.workers.pids
    assert _worker_pids(os.getpid()) == pids
    llm.engine.add_request("a b a b", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    llm.engine.step()
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(
        ExecutorError, match=r"^tensor-parallel (rank 1 \(pid \d+\) exited|all-reduce failed)"
    ) as e:
        for _ in range(50):
            llm.engine.step()
    assert "\n" not in str(e.value) and time.monotonic() - start < 30
    assert _gone(pids)
    with pytest.raises(ExecutorError):  # the engine stays down: no restart
        llm.generate("a b", GREEDY, use_tqdm=False)


def test_a_tp2_server_answers_then_503_after_a_worker_dies(tiny_llama) -> None:
    srv = _start(str(tiny_llama), tensor_parallel_size=2)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
        assert r.choices[0].message.content is not None
        pids = _worker_pids(os.getpid())
        os.kill(pids[0], signal.SIGKILL)
        codes = []
        for _ in range(2):
            resp = httpx.post(
                f"{srv.url}/v1/chat/completions",
                json={"model": "tiny", "messages": msgs, "max_tokens": 4}, timeout=60,
            )  # fmt: skip
            codes.append(resp.status_code)
            assert "Traceback" not in resp.text
        assert codes[-1] == 503 and _gone(pids)
    finally:
        srv.stop()


def _serve_tp2(tiny_llama):
    """`specdec serve -tp 2` in a subprocess, healthy."""
    return serve(
        str(tiny_llama), "-tp", "2", "--max-model-len", "128", "--uvicorn-log-level", "warning",
        command=(sys.executable, "-m", "specdec", "serve"),
    )  # fmt: skip


def test_serve_exits_1_for_a_restart_when_a_worker_dies(tiny_llama) -> None:
    """A dead tensor-parallel worker cannot come back in-process: /health says why (503) for a
    moment, then `specdec serve` exits with status 1 (a supervisor restarts it), no orphan."""
    with _serve_tp2(tiny_llama) as srv:
        proc = srv.proc
        pids = _worker_pids(proc.pid)
        os.kill(pids[0], signal.SIGKILL)
        body = {"model": str(tiny_llama), "prompt": "hi", "max_tokens": 4}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code >= 500 and "Traceback" not in r.text
        health = httpx.get(f"{srv.url}/health", timeout=5)
        assert health.status_code == 503 and "not running" in health.text
        assert proc.wait(timeout=30) == 1
        err = srv.log()
        assert "exits with status 1 for a restart" in err and "Traceback" not in err
        assert _gone(pids)


def test_serve_tp2_subprocess_sigterm_leaves_no_worker(tiny_llama) -> None:
    with _serve_tp2(tiny_llama) as srv:
        proc = srv.proc
        body = {"model": str(tiny_llama), "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}  # fmt: skip
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, json.dumps(r.json())[:200]
        pids = _worker_pids(proc.pid)
        assert len(pids) == 1
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert _gone(pids)


def test_ray_backend_equals_mp_and_a_killed_actor_fails_the_step(tiny_llama) -> None:
    """distributed_executor_backend="ray": rank 1 in a Ray actor (a local cluster), the same
    tokens as mp; its process killed by its PID fails the next step, and shutdown leaves no
    actor process."""
    ray = pytest.importorskip("ray")
    mp = _llm(str(tiny_llama), 2)
    want = _tokens(mp, PROMPTS, GREEDY), _tokens(mp, PROMPTS, SEEDED)
    mp.engine.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        llm = _llm(str(tiny_llama), 2, distributed_executor_backend="ray")
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert (_tokens(llm, PROMPTS, GREEDY), _tokens(llm, PROMPTS, SEEDED)) == want
        llm.engine.shutdown()
        assert _gone(llm.engine.executor.workers.pids)
        llm = _llm(str(tiny_llama), 2, distributed_executor_backend="ray")
        pids = llm.engine.executor.workers.pids
        llm.engine.add_request("a b", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        llm.engine.step()
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(ExecutorError, match=r"^tensor-parallel ") as e:
            for _ in range(50):
                llm.engine.step()
        assert "\n" not in str(e.value)
        assert not ray.util.placement_group_table() or all(
            g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()
        )
    finally:
        ray.shutdown()
