"""Shared fixtures: tiny random-weight models saved as Hugging Face folders, real model paths."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# NOTE: before torch loads OpenMP: spinning worker threads make every small op cost ~20x more
# on shared cores (specdec/__init__.py does the same for users).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# NOTE: no test writes the user's weight cache; tests of the cache point it at a temporary folder
os.environ["SPECDEC_WEIGHT_CACHE"] = "off"

import pytest  # noqa: E402
import torch  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "bench" / "data"


def _byte_tokenizer_json(folder: Path) -> int:
    """A byte-level BPE tokenizer with a few merges and chat special tokens; returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from specdec.model.tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
        " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": template,
            }
        )
    )
    return tok.get_vocab_size()


def with_chat_template(model: Path, folder: Path, template: str | None) -> Path:
    """A copy of a Hugging Face model folder with another chat template (None: none)."""
    for f in model.iterdir():
        shutil.copy(f, folder / f.name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


# Tiny mixtures of experts: Qwen3-MoE renormalising its top-k (as Qwen3-30B-A3B) with a dense
# layer (mlp_only_layers), Qwen2-MoE not renormalising, with its gated shared expert.
_MOE_ARCHS = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1],
        ),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=96, norm_topk_prob=False,
        ),
    ),
}  # fmt: skip


def make_tiny_model(
    folder: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2, **overrides
) -> Path:
    """Random weights in a Hugging Face folder (config.json + model.safetensors + tokenizer)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = _byte_tokenizer_json(folder)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        bos_token_id=vocab - 3,
        eos_token_id=vocab - 1,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common,
            head_dim=32,
            sliding_window=16,
            query_pre_attn_scalar=32,
            tie_word_embeddings=True,
        )
        model = transformers.Gemma3ForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        # explicit head_dim (not hidden / heads, as the real ones), tied embeddings (0.6B-4B)
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch in _MOE_ARCHS:
        config_cls, model_cls, moe = _MOE_ARCHS[arch]
        cfg = getattr(transformers, config_cls)(**(common | moe), tie_word_embeddings=False)
        model = getattr(transformers, model_cls)(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.ndim == 1:  # biases
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0, num_layers=4)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """A different tiny model with the same tokenizer, as a draft for tiny_llama."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_draft"), "llama", seed=1, num_layers=1)


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_gemma"), "gemma3", seed=2, num_layers=6)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=3, num_layers=2)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=4, num_layers=2)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", 6, num_layers=3)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", 7, num_layers=2)


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_moe"), "qwen2_moe", 8, num_layers=2)


def price_drafting_to_pay(llm) -> None:
    """Wake a model drafter and give its controller fixed prices at which drafting pays.

    NOTE: on tiny models a model drafter's start-up timings sit near the break-even (a draft 0.24
    ms against a 0.20 ms target step on one CI machine): the speculator may stay dormant, and
    awake, the controller may never choose a draft. Fixed prices (a clock that never moves, so no
    step teaches the cost model anything) keep the controller's choice of k, varying with each
    request's rates, under test wherever the suite runs. (No time is ever measured, so the probe
    budget stays empty: probes are tested in test_controller.)"""
    from specdec.spec_decode.controller import CostModel

    spec = llm.engine.speculator
    spec.dormant = False
    ctl = spec.controller
    if ctl is None:
        return
    ctl.clock = lambda: 0.0
    ctl._record = lambda *_: None
    ctl.cost = spec.proposer.cost_model = CostModel([10.0 + 2.0 * n for n in range(16)])


def bench_prompts(n: int | None = None) -> list[dict]:
    """The prompt fixture copied from ../shared/bench/data (works without shared/)."""
    rows = [
        json.loads(line)
        for line in (FIXTURES / "bench_prompts.jsonl").read_text().splitlines()
        if line
    ]
    return rows[:n] if n else rows


def shared_prompts(n_per_file: int) -> list[dict]:
    """Prompts from ../shared/bench/data when present, else the copied fixture."""
    if not SHARED_DATA.is_dir():
        return bench_prompts()
    rows = []
    for name in ("stdlib_edit.jsonl", "humaneval.jsonl", "mt_bench.jsonl", "gsm8k_test.jsonl"):
        lines = (SHARED_DATA / name).read_text().splitlines()
        rows.extend(json.loads(line) for line in lines[:n_per_file])
    return rows


BENCH_GREEDY_TOKENS = 40
BENCH_GREEDY_ENGINE = {"max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 1024}


def bench_chats() -> list[list[dict]]:
    """Each prompt of the bench fixture as a one-turn chat."""
    return [[{"role": "user", "content": p["turns"][0]}] for p in bench_prompts()]


@pytest.fixture(scope="session")
def smollm2_bench_greedy() -> list[list[int]]:
    """Plain SmolLM2-135M's greedy token ids for bench_chats(), BENCH_GREEDY_TOKENS each, with
    BENCH_GREEDY_ENGINE (once a session: the real-model drafter tests all compare against it).

    NOTE: greedy decoding is deterministic and the kernels are batch-invariant, so the first n
    tokens of these are plain's n-token output (an EOS before n ends both alike).
    """
    from specdec import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=BENCH_GREEDY_TOKENS)
    llm = LLM("smollm2-135m", **BENCH_GREEDY_ENGINE)
    return [list(o.outputs[0].token_ids) for o in llm.chat(bench_chats(), sp)]


@pytest.fixture
def server_process():
    """``start_server`` (tests/fixtures/server.py: ``specdec serve`` in a subprocess, healthy);
    every server it started is stopped after the test, by PID, with bounded waits."""
    from tests.fixtures.server import ServerProcess, start_server

    started: list[ServerProcess] = []

    def start(model: str | None, *args: str, **kwargs) -> ServerProcess:
        started.append(start_server(model, *args, **kwargs))
        return started[-1]

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "2")))


SYNTHETIC_GGUF_SCRIPT = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "make_synthetic_gguf.py"
)


@pytest.fixture(scope="session")
def mk():
    """benchmarks/make_synthetic_gguf.py as a module (once: it caches SmolLM2's tokenizer)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("make_synthetic_gguf", SYNTHETIC_GGUF_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def shared_gguf_readers():
    """transformers' GGUF loaders share one parsed ``gguf.GGUFReader`` per file for the session.

    NOTE: parsing Gemma 3's 262k-token vocabulary field by field took ~25 s a reader, and
    transformers builds one for the config, one for the weights and one for the tokenizer
    (the suite's slowest set-ups). The reader is read-only; keyed by path, size and mtime.
    Its bytes are a plain ndarray view of the same read-only memory map: parsing slices the file
    millions of times, and each ``np.memmap`` slice pays for the subclass' bookkeeping (~2.5x
    the parse time); the bytes, and so every field and tensor, are the same.
    The weight loader also builds gguf's (read-only) tensor name map once per submodule (~400
    times, ~10 s a model); it is built once per (architecture, layers).
    """
    import functools

    import gguf
    import numpy as np

    class PlainBytesReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray)

    readers: dict[tuple, object] = {}

    def cached(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = PlainBytesReader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", cached)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield readers


# --- Two workers (pytest-xdist) ---------------------------------------------------------------
# scripts/test.sh runs the suite in two steps: `-n 2 --dist loadgroup -m "not alone"`, then
# `-m alone` in one process. Each test file runs whole on one worker (its module fixtures, servers
# mostly, are built once); files sharing an expensive session fixture run on the same worker (built
# once). `alone` tests time themselves against limits (a loaded machine fails them), or start
# processes that want every core (tensor parallel, replicas, Ray, the shared-memory all-reduce,
# the browser). Should they run under xdist all the same (`pytest -n 2` by hand), a lock across
# the workers still runs each alone, the other worker waiting between its tests (idle: slower).
# Without xdist (plain `pytest`) none of this changes anything.
_SAME_WORKER = {
    "tests/e2e/test_suffix_greedy.py": "tests/e2e/test_spec_greedy.py",  # smollm2_bench_greedy
    "tests/e2e/test_tokenizer_parity.py": "tests/e2e/test_real_model_parity.py",  # Gemma's readers
}
_ALONE = (
    "tests/e2e/test_chat_page_browser.py",
    "tests/e2e/test_grammar_isolation_server.py",  # the 5 s compile limit (hit under 2x load)
    "tests/e2e/test_hostile_corpus.py",  # "never stalls"
    "tests/e2e/test_replicas.py",
    "tests/e2e/test_replicas_ray.py",
    "tests/e2e/test_server.py::test_client_disconnect_mid_stream_frees_kv",  # 0.5 s, 3 s waits
    "tests/e2e/test_server_load.py",
    "tests/e2e/test_server_safety.py",  # sub-second limits
    "tests/e2e/test_tensor_parallel.py",
    "tests/e2e/test_server_connections.py",  # 2 s head timeouts, measured
    "tests/unit/test_connection_guard.py",  # 1.5 s head timeouts, measured
    "tests/unit/test_protocol_safety.py::test_guards_refuse_blowups_at_once",  # < 0.5 s
    "tests/unit/test_shm_reducer.py",
    "tests/unit/test_suffix.py::test_per_step_cost_on_a_long_sequence",
)


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--phase",
        choices=("shared", "alone"),
        default=None,
        help="scripts/test.sh's steps: only the tests that may share the machine, or only the "
        "`alone` ones (composes with -m, which a marker expression of its own would replace)",
    )


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "alone: under xdist, no other test runs meanwhile")


@pytest.hookimpl(tryfirst=True)  # NOTE: before -m deselects
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(_SAME_WORKER.get(path, path)))
        if any(item.nodeid == a or item.nodeid.startswith(a + "::") or path == a for a in _ALONE):
            item.add_marker(pytest.mark.alone)
    phase = config.getoption("--phase")
    if phase is not None:
        keep, dropped = [], []
        for item in items:
            alone = item.get_closest_marker("alone") is not None
            (keep if alone == (phase == "alone") else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep


@pytest.fixture(autouse=True)
def _alone_under_xdist(request, tmp_path_factory):
    """A readers-writer lock across workers: every test holds it shared, an `alone` test
    exclusively. The turnstile keeps a waiting `alone` test from being starved by the others."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import fcntl

    root = tmp_path_factory.getbasetemp().parent  # NOTE: shared by the workers of one run
    alone = request.node.get_closest_marker("alone") is not None
    with open(root / "alone.turnstile", "a") as gate, open(root / "alone.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
