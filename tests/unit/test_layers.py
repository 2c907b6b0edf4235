"""The package's layering, read from the source with ``ast``: layers point down (entrypoints ->
engine -> worker -> model -> distributed / kernels / kv_cache), and no imports go round in a
circle. Every import counts: at module level, inside functions and under ``TYPE_CHECKING``
(the cycle check between packages leaves the last out: those never run)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "specdec"

# package (or top-level module) -> the packages it must never import
FORBIDDEN: dict[str, set[str]] = {
    "model": {"worker", "engine", "entrypoints", "bench", "train", "cli"},
    "kernels": {"model", "worker", "engine", "entrypoints", "bench", "train", "cli"},
    "kv_cache": {"model", "worker", "engine", "entrypoints", "bench", "train", "cli"},
    "distributed": {"model", "worker", "engine", "entrypoints", "bench", "train", "cli"},
    "worker": {"engine", "entrypoints", "bench", "train", "cli"},
    # NOTE: the ``specdec`` command line (specdec/cli.py) sits above entrypoints/ and bench/;
    # bench/ may start the server in-process, never the other way round
    "entrypoints": {"bench", "cli"},
    "bench": {"cli"},
}
# cycles between packages that predate this test
KNOWN_PACKAGE_CYCLES: list[set[str]] = []


# compiled extension modules (setup.py builds them): leaves, no .py source to read
EXTENSIONS = ("specdec.kernels._C", "specdec.spec_decode._suffix_native")


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, e.g. "specdec.model.llama"
    dst: str  # imported module
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:``


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module ``name`` loads: itself, else its longest known prefix."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, pkg: str, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    # NOTE: ``from specdec import kernels`` imports the module specdec.kernels
    return [
        f"{base}.{a.name}"
        if f"{base}.{a.name}" in mods or f"{base}.{a.name}" in EXTENSIONS
        else base
        for a in node.names
    ]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def _edges() -> list[Edge]:
    mods = _modules()
    edges = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        type_only = _type_checking_nodes(tree)
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _targets(node, pkg, mods):
                if name in EXTENSIONS:
                    continue  # NOTE: not the package it sits in: a leaf
                dst = _resolve(name, mods) if name.startswith("specdec") else None
                if dst is not None and dst != mod:
                    edges.append(Edge(mod, dst, node.lineno, id(node) in type_only))
    return edges


def _package(mod: str) -> str:
    """``specdec.model.llama`` -> ``model``; a top-level module is its own: ``config``."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "specdec"


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_read() -> None:
    pairs = {(e.src, e.dst, e.type_only) for e in _edges()}
    assert ("specdec.model.llama", "specdec.kv_cache.pool", False) in pairs  # module level
    assert ("specdec.model.llama", "specdec.distributed.comm", True) in pairs  # TYPE_CHECKING
    assert ("specdec.model.weight_cache", "specdec.kernels", False) in pairs  # in a function


def test_low_layers_never_import_the_layers_above() -> None:
    upward = sorted(
        {
            f"{e.src}:{e.line} imports {e.dst}" + (" (TYPE_CHECKING)" if e.type_only else "")
            for e in _edges()
            if _package(e.dst) in FORBIDDEN.get(_package(e.src), set())
        }
    )
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_the_shared_errors_module_imports_nothing_of_specdec() -> None:
    assert not [e for e in _edges() if e.src == "specdec.errors"]


def test_no_module_imports_itself_in_a_circle() -> None:
    graph: dict[str, set[str]] = {}
    for e in _edges():
        graph.setdefault(e.src, set()).add(e.dst)
    assert not _cycles(graph), f"import cycles between modules: {_cycles(graph)}"


def test_no_package_imports_itself_in_a_circle() -> None:
    graph: dict[str, set[str]] = {}
    for e in _edges():
        src, dst = _package(e.src), _package(e.dst)
        if src != dst and not e.type_only:
            graph.setdefault(src, set()).add(dst)
    cycles = _cycles(graph)
    new = [sorted(c) for c in cycles if c not in KNOWN_PACKAGE_CYCLES]
    assert not new, f"import cycles between packages: {new}"
    gone = [sorted(c) for c in KNOWN_PACKAGE_CYCLES if c not in cycles]
    assert not gone, f"cycles gone (remove them from KNOWN_PACKAGE_CYCLES): {gone}"


def test_old_import_paths_still_name_the_moved_objects() -> None:
    from specdec import errors
    from specdec.config import ConfigError
    from specdec.distributed import binding, comm, shard, shm
    from specdec.engine.executor import ExecutorError
    from specdec.engine.loading import load_model
    from specdec.engine.scheduler import SchedulerOutput
    from specdec.model import model_loader
    from specdec.model.registry import ModelNotFoundError
    from specdec.worker import binding as old_binding
    from specdec.worker import shard as old_shard
    from specdec.worker import step, tp

    assert ConfigError is errors.ConfigError and ExecutorError is errors.ExecutorError
    assert ModelNotFoundError is errors.ModelNotFoundError
    assert tp.TPGroup is comm.TPGroup and issubclass(tp.TPError, ExecutorError)
    assert tp.ShmAllReduce is shm.ShmAllReduce and tp.make_shm_file is shm.make_shm_file
    assert old_shard.plan_shard is shard.plan_shard and old_shard.vocab_range is shard.vocab_range
    assert old_binding.parse_cpu_binding is binding.parse_cpu_binding
    assert load_model is model_loader.load_model and SchedulerOutput is step.SchedulerOutput


def test_the_extensions_listed_are_the_ones_setup_builds() -> None:
    setup = (ROOT.parent / "setup.py").read_text()
    for name in EXTENSIONS:
        assert f'"{name}"' in setup, name
