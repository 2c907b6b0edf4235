"""The manual under docs/ (mkdocs.yml at the root): it builds with `mkdocs build --strict` (a broken
link or anchor, a page left out of the navigation or any other warning fails), every section the
README used to hold has its page, the README links to each page, and every Python block of the
README and the manual compiles. Its `specdec` commands are parsed (and a few run) by
tests/e2e/cli/test_readme_commands.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# The README's sections before the manual (git show 610d18e:README.md): page, and the heading
# that page holds for it.
MOVED = {
    "Quick start": ("index.md", "## Quick start"),
    "Models": ("models.md", "# Models"),
    "Python API": ("python-api.md", "# Python API"),
    "Speculative methods": ("speculative.md", "# Speculative methods"),
    "Structured output and tool calls": ("structured.md", "# Structured output and tool calls"),
    "Training a head (`specdec train`)": ("training.md", "# Training a head"),
    "Prefix caching": ("kv-cache.md", "## Prefix caching"),
    "Command line": ("cli.md", "# Command line"),
    "Server (OpenAI-compatible)": ("server.md", "# Server (OpenAI-compatible)"),
    "Chat page": ("chat-page.md", "# Chat page"),
    "Metrics": ("metrics.md", "# Metrics"),
    "Acceptance figures": ("speculative.md", "## Acceptance figures"),
    "Replicas: `--data-parallel-size` and Ray Serve": ("parallel.md", "## Replicas"),
    "KV events for external routers": ("kv-events.md", "# KV events for external routers"),
    "Running it safely": ("security.md", "# Running it safely"),
    "Benchmarks": ("benchmarks.md", "# Benchmarks"),
    "GPUs (CUDA)": ("gpu.md", "# GPUs (CUDA)"),
    "Native kernels": ("kernels.md", "# Native kernels"),
    "KV cache formats (in Native kernels)": ("kv-cache.md", "## KV cache formats"),
    "Tests": ("development.md", "## Tests"),
    "Layout": ("development.md", "## Layout"),
}


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_manual_builds_strict(tmp_path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is pinned in requirements-test.txt")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log, log
    for page in _pages():
        html = page.relative_to(DOCS).with_suffix(".html")
        assert (tmp_path / "site" / html).is_file(), html


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in _pages():
        assert str(page.relative_to(DOCS)) in nav, page


def test_every_moved_section_has_a_page_the_readme_links() -> None:
    readme = (ROOT / "README.md").read_text()
    for section, (page, heading) in MOVED.items():
        text = (DOCS / page).read_text()
        assert re.search(rf"^{re.escape(heading)}", text, re.M), (section, page, heading)
        assert f"(docs/{page}" in readme, f"README.md does not link docs/{page} ({section})"


def test_readme_is_short_and_links_benchmarks() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 360
    assert "(BENCHMARKS.md)" in readme
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 310


def _python_blocks(text: str) -> list[str]:
    """```python blocks, list-indented ones included (dedented by their fence's indent)."""
    blocks = []
    for indent, body in re.findall(r"^( *)```python\n(.*?)^\1```", text, re.M | re.S):
        blocks.append("\n".join(line[len(indent) :] for line in body.splitlines()))
    return blocks


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *_pages()], ids=lambda p: str(p.relative_to(ROOT))
)
def test_python_blocks_compile(path: Path) -> None:
    for i, block in enumerate(_python_blocks(path.read_text())):
        compile(block, f"{path.name} python block {i}", "exec")


def test_no_lab_notebook_words() -> None:
    """Figures cite their measurement (machine, date), never a work session or a label."""
    pattern = re.compile(r"session [0-9]+|\[[A-Z][0-9]+\]")
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *_pages()]
    files += [p for p in (ROOT / "specdec").rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []
