"""Shared fixtures: tiny random-weight models saved as Hugging Face folders, real model paths."""

from __future__ import annotations

import os
from pathlib import Path

# NOTE: before torch loads OpenMP: spinning worker threads make every small op cost ~20x more
# on shared cores (specdec/__init__.py does the same for users).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# NOTE: no test writes the user's weight cache; tests of the cache point it at a temporary folder
os.environ["SPECDEC_WEIGHT_CACHE"] = "off"

import pytest  # noqa: E402
import torch  # noqa: E402

# NOTE: the helpers live in tests/fixtures/ (plain modules: import them from there); these names
# stay importable from here for code written before they moved.
from tests.fixtures.engine import price_drafting_to_pay  # noqa: E402, F401
from tests.fixtures.models import make_tiny_model, with_chat_template  # noqa: E402, F401
from tests.fixtures.prompts import (  # noqa: E402, F401
    BENCH_GREEDY_ENGINE,
    BENCH_GREEDY_TOKENS,
    FIXTURES,
    SHARED_DATA,
    bench_chats,
    bench_prompts,
    shared_prompts,
)


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
    # smollm2_bench_greedy
    "tests/e2e/llm/test_suffix_greedy.py": "tests/e2e/llm/test_spec_greedy.py",
    # Gemma's readers
    "tests/e2e/model/test_tokenizer_parity.py": "tests/e2e/model/test_real_model_parity.py",
}
_ALONE = (
    "tests/e2e/server/test_chat_page_browser.py",
    # the 5 s compile limit (hit under 2x load)
    "tests/e2e/server/test_grammar_isolation_server.py",
    "tests/e2e/server/test_hostile_corpus.py",  # "never stalls", victim ratios
    "tests/e2e/replicas/test_replicas.py",
    "tests/e2e/replicas/test_replicas_ray.py",
    # 0.5 s, 3 s waits
    "tests/e2e/server/test_server.py::test_client_disconnect_mid_stream_frees_kv",
    "tests/e2e/server/test_server_load.py",
    "tests/e2e/server/test_server_safety.py",  # sub-second limits
    "tests/e2e/distributed/test_tensor_parallel.py",
    "tests/e2e/server/test_server_connections.py",  # 2 s head timeouts, measured
    "tests/unit/entrypoints/openai/test_connection_guard.py",  # 1.5 s head timeouts, measured
    # < 0.5 s
    "tests/unit/entrypoints/openai/test_protocol_safety.py::test_guards_refuse_blowups_at_once",
    "tests/unit/distributed/test_shm_reducer.py",
    "tests/unit/spec_decode/test_suffix.py::test_per_step_cost_on_a_long_sequence",
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
