"""Every `specdec ...` command in the ```bash blocks of the README and of the manual (docs/*.md),
so neither can drift from the CLI. Each one is parsed by the real `specdec` parser (the command's
function replaced by a recorder): a command that does not parse fails here. `generate`, the
first `serve` (the README's, in a subprocess: healthy, one request, SIGTERM) and `bench latency`
/ `bench forward-cost` also run, with small sizes (4 tokens, 1 prompt); `train` (minutes of CPU),
`bench serve` and the commands on files made elsewhere (synthetic GGUFs, a trained head) are
parsed only."""

from __future__ import annotations

import json
import re
import shlex
import signal
import sys
import urllib.request
from pathlib import Path

import pytest

from specdec import cli
from tests.fixtures.server import free_port, serve

ROOT = Path(__file__).resolve().parents[3]
# size flags shrunk when a command runs: flag -> the value used
SMALL = {"--max-tokens": "4", "-n": "4", "--num-prompts": "1", "--ns": "1,2", "--repeats": "1",
         "--warmup": "0", "--rounds": "1", "--concurrency": "1"}  # fmt: skip


def readme_commands() -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv after `specdec`) for every specdec command in the bash blocks of the
    README, then of the manual's pages, each once (`\\` continuations joined; `VAR=value`
    prefixes, `&`, comments and `for ...; do` handled: a loop variable takes its first value)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    commands = []
    variables = {"SPECDEC_KEY": "a-key"}
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "specdec" not in line:
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&")
            lexer.whitespace_split = True
            parts, words = [], []
            for word in lexer:
                if word in (";", "&", "&&", "do", "done"):
                    parts, words = parts + [words], []
                else:
                    words.append(word)
            for command in [*parts, words]:
                if command[:1] == ["for"] and "in" in command:  # for a in x y: $a is x
                    variables[command[1]] = command[command.index("in") + 1]
                command = [variables.get(w[1:], w) if w.startswith("$") else w for w in command]
                names = [i for i, w in enumerate(command) if w.split("/")[-1] == "specdec"]
                if not names:
                    continue
                env = dict(w.split("=", 1) for w in command[: names[0]] if "=" in w)
                if (env, command[names[0] + 1 :]) not in commands:
                    commands.append((env, command[names[0] + 1 :]))
    return commands


def _run(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def test_every_readme_command_parses(monkeypatch, capsys) -> None:
    commands = readme_commands()
    assert len(commands) >= 20  # the extraction found the README's commands
    seen = []
    monkeypatch.setattr(cli, "run_command", lambda func, args: seen.append(args) or 0)
    failed = []
    for _, argv in commands:
        if _run(argv) != 0:
            failed.append(f"specdec {shlex.join(argv)}: {capsys.readouterr().err.strip()}")
    assert failed == []
    assert len(seen) == len(commands)


def test_a_command_that_does_not_parse_is_caught(monkeypatch) -> None:
    """What the test above relies on: a bad command returns 2 with the recorder in place."""
    monkeypatch.setattr(cli, "run_command", lambda func, args: 0)
    assert _run(shlex.split('generate -p "a b" -n 3 --no-such-flag')) == 2


def _small(argv: list[str], tmp_path: Path) -> list[str]:
    """The command with small sizes, a temporary output folder and a missing dataset replaced by
    the package's default prompts."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if flag == "--dataset" and not (ROOT / argv[i + 1]).is_file():
            i += 2
            continue
        if flag in SMALL or flag == "--output-dir":
            out += [flag, SMALL.get(flag, str(tmp_path / "out"))]
            i += 2
            continue
        out.append(flag)
        i += 1
    return out


def _runnable(kind: list[str]) -> list[list[str]]:
    """The README's ``kind`` commands that can run here (``--device cuda`` ones only where a GPU
    is, none that downloads a model; every one is parsed above)."""
    import torch

    gpu = torch.cuda.is_available()
    # NOTE: a model by hub id needs the network (tests/unit/model/test_hub.py reads a cache built offline)
    return [
        argv
        for _, argv in readme_commands()
        if argv[: len(kind)] == kind
        and (gpu or "cuda" not in argv)
        and not {"-hf", "--hf-repo"} & set(argv)
    ]


def test_readme_generate_commands_run(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("SPECDEC_WEIGHT_CACHE", str(tmp_path / "weights"))
    commands = [a for a in _runnable(["generate"]) if "runs/" not in " ".join(a)]
    assert len(commands) >= 4
    for argv in commands:
        small = _small(argv, tmp_path)
        if "--max-tokens" not in small and "-n" not in small:
            small += ["--max-tokens", "4"]
        assert _run(small) == 0, shlex.join(small)
        assert "tokens/s" in capsys.readouterr().out


def test_readme_bench_commands_run(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    latency = _runnable(["bench", "latency", "--model", "smollm2-135m"])[0]
    cost = _runnable(["bench", "forward-cost", "--model", "smollm2-135m"])[0]
    for argv in (latency, cost):
        small = _small(argv, tmp_path)
        if argv[1] == "latency":
            small += ["--num-prompts", "1", "--no-plots", "--no-progress"]
            small += ["--output-dir", str(tmp_path / "latency")]
        assert _run(small) == 0, shlex.join(small)


def test_readme_serve_command_runs() -> None:
    port = free_port()
    argv = [w if w != "8000" else str(port) for w in _runnable(["serve"])[0]]
    assert str(port) in argv  # the README's command names its port
    cli_module = (sys.executable, "-m", "specdec.cli")
    with serve(None, *argv, command=cli_module, port=port, port_flag=None, grace=0) as srv:
        body = json.dumps({"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"{srv.url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply["usage"]["completion_tokens"] >= 1
        srv.proc.send_signal(signal.SIGTERM)
        # NOTE: uvicorn re-raises the SIGTERM it handled once it has shut down
        assert srv.proc.wait(timeout=30) in (0, -signal.SIGTERM)


@pytest.fixture(autouse=True)
def _quiet_weights_cache(monkeypatch, tmp_path) -> None:
    """No README command writes outside tmp_path (the weight cache is the only other place)."""
    monkeypatch.setenv("SPECDEC_WEIGHT_CACHE", str(tmp_path / "weights"))
