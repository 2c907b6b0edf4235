"""EngineArgs: one declaration of every engine option, from which LLM() kwargs, the CLI flags of
generate / serve / bench and the benchmarks' options derive; vLLM's and llama.cpp's spellings."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams, cli, config
from specdec.bench.args import FORWARD_COST_ENGINE_ARGS, LATENCY_ENGINE_ARGS, SERVE_ENGINE_ARGS
from specdec.config import (
    ALIAS,
    ENGINE,
    IGNORED,
    SINGLE,
    ConfigError,
    EngineArgs,
    EngineConfig,
)
from specdec.entrypoints.openai import api_server

PACKAGE = Path(__file__).resolve().parents[3] / "specdec"


def _subparser(command: list[str]) -> argparse.ArgumentParser:
    """The argparse parser of ``specdec <command...>``."""
    parser = argparse.ArgumentParser(prog="specdec")
    sub = parser.add_subparsers(dest="command")
    cli._generate_parser(sub)
    api_server.add_serve_parser(sub)
    cli.add_bench_parser(sub)
    for name in command:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = actions[0].choices[name]
    return parser


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions}


def test_each_option_is_declared_in_the_dataclass_of_its_concern() -> None:
    """EngineArgs combines one dataclass per concern; each holds its --help section's options,
    and LLM()'s two positional arguments lead."""
    concerns = {
        config.ModelArgs: "model", config.CacheArgs: "cache", config.SchedulerArgs: "scheduler",
        config.SpeculativeArgs: "speculative", config.ParallelArgs: "parallel",
        config.ServerArgs: "server", config.RefusedArgs: "ignored", config.IgnoredArgs: "ignored",
    }  # fmt: skip
    leading = [f.name for f in dataclasses.fields(config.PositionalArgs)]
    assert EngineArgs.names()[:2] == leading == ["model", "speculative_config"]
    owner: dict[str, type] = {}
    for cls, section in concerns.items():
        assert issubclass(EngineArgs, cls)
        for name in cls.__annotations__:
            assert name not in owner, (name, owner.get(name), cls)
            owner[name] = cls
            assert config.help_section(name) == section, (name, cls.__name__)
    assert set(owner) | set(leading) == set(EngineArgs.names())


def test_every_option_is_declared_once_and_reaches_every_entry_point() -> None:
    names = EngineArgs.names()
    # LLM() takes exactly EngineArgs' fields, with their defaults
    params = inspect.signature(LLM).parameters
    assert list(params) == names
    for f in dataclasses.fields(EngineArgs):
        assert params[f.name].default == f.default
        assert f.metadata["help"], f.name
    # every engine field of EngineConfig is an EngineArgs field with the same default
    config_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in EngineArgs.names(ENGINE)[1:]:  # model: required in EngineConfig
        assert config_fields[name].default == EngineArgs.__dataclass_fields__[name].default, name
    assert set(EngineArgs.names(ENGINE)) == set(config_fields) - {"speculative", "extra"}
    # generate and serve have a flag per argument; the benchmarks their subsets
    for command in (["generate"], ["serve"]):
        assert set(names) <= _dests(_subparser(command)), command
    for command, subset in (
        (["bench", "latency"], LATENCY_ENGINE_ARGS),
        (["bench", "serve"], SERVE_ENGINE_ARGS),
        (["bench", "forward-cost"], FORWARD_COST_ENGINE_ARGS),
    ):
        dests = _dests(_subparser(command))
        assert set(subset) <= dests and not (set(names) - set(subset)) & dests, command
    server = api_server.make_arg_parser(argparse.ArgumentParser())
    assert set(names) <= _dests(server)


def test_cli_flags_parse_to_the_same_engine_args_as_kwargs() -> None:
    argv = [
        "generate", "--model=m.gguf", "--max-num-seqs=256", "--max-model-len=8192",
        "--max-num-batched-tokens=8192", "--dtype=bfloat16", "--tensor-parallel-size=1",
        "--gpu-memory-utilization=0.8", "--trust-remote-code", "--no-enable-prefix-caching",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
    ]  # fmt: skip
    args = _subparser([]).parse_args(argv)
    got = EngineArgs.from_cli_args(args)
    want = EngineArgs.from_kwargs(
        model="m.gguf", max_num_seqs=256, max_model_len=8192, max_num_batched_tokens=8192,
        dtype="bfloat16", tensor_parallel_size=1, gpu_memory_utilization=0.8,
        trust_remote_code=True, enable_prefix_caching=False,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )  # fmt: skip
    assert got == want
    config = got.create_engine_config()
    assert config.kv_cache_memory == 0.8 and config.speculative.num_speculative_tokens == 3


@pytest.mark.parametrize("command", [["generate"], ["serve", "m"]])
def test_legacy_speculative_flags_on_every_entry_point(command: list[str]) -> None:
    argv = [*command, "--speculative-model", "[ngram]", "--num-speculative-tokens", "5",
            "--speculative-draft-tensor-parallel-size", "1", "--ngram-prompt-lookup-max", "4",
            "--ngram-prompt-lookup-min", "2", "--speculative-disable-by-batch-size", "3"]  # fmt: skip
    spec = EngineArgs.from_cli_args(_subparser([]).parse_args(argv)).speculative()
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 5)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.disable_by_batch_size) == (2, 4, 3)
    # python -m specdec.entrypoints.openai.api_server takes the same flags
    server = api_server.make_arg_parser(argparse.ArgumentParser())
    same = EngineArgs.from_cli_args(server.parse_args(argv[len(command) :])).speculative()
    assert same == spec


def test_llama_cpp_flags(tiny_llama) -> None:
    argv = ["generate", "-m", "t.gguf", "-md", "d.gguf", "--draft-max", "6", "--draft-min", "2",
            "--draft-p-min", "0.6", "-c", "2048", "-t", "1", "-s", "7", "-ngl", "99", "-np", "3",
            "--temp", "0.5", "--top-k", "20", "--top-p", "0.9", "--repeat-penalty", "1.1",
            "-n", "12"]  # fmt: skip
    args = _subparser([]).parse_args(argv)
    assert args.max_tokens == 12  # -ngl is not read as -n gl
    assert (args.temperature, args.top_k, args.top_p, args.repetition_penalty) == (
        0.5, 20, 0.9, 1.1,
    )  # fmt: skip
    engine = EngineArgs.from_cli_args(args)
    assert (engine.model, engine.max_model_len, engine.threads, engine.seed) == (
        "t.gguf", 2048, 1, 7,
    )  # fmt: skip
    assert (engine.n_gpu_layers, engine.max_num_seqs) == (99, 3)
    spec = engine.speculative()
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "d.gguf", 6)
    assert (spec.draft_min, spec.draft_p_min) == (2, 0.6)
    with pytest.raises(ConfigError, match="need a speculative method"):
        EngineArgs(draft_max=4).speculative()
    with pytest.raises(ConfigError, match="disagree"):
        EngineArgs(model_draft="d", draft_max=4, num_speculative_tokens=5).speculative()


def test_vllm_kwargs_run_and_unsupported_ones_fail_clearly(tiny_llama, caplog) -> None:
    caplog.set_level(logging.INFO, logger="specdec")
    config._LOGGED_IGNORED.clear()  # logged once per process: forget earlier tests' lines
    llm = LLM(
        str(tiny_llama), max_model_len=64, tensor_parallel_size=1, enforce_eager=True,
        async_scheduling=True, distributed_executor_backend="mp", gpu_memory_utilization=0.01,
        trust_remote_code=True, speculative_model="[ngram]", num_speculative_tokens=3,
        speculative_draft_tensor_parallel_size=1, use_v2_block_manager=True, n_gpu_layers=99,
    )  # fmt: skip
    ignored = [r.getMessage() for r in caplog.records if "ignored on CPU" in r.getMessage()]
    assert len(ignored) == 1
    for name in ("async_scheduling", "trust_remote_code", "use_v2_block_manager", "n_gpu_layers"):
        assert name in ignored[0]
    assert "enforce_eager" not in ignored[0]  # it turns CUDA graphs off (static_runner.py)
    assert llm.engine.config.enforce_eager
    assert llm.engine.spec.method == "ngram" and llm.engine.spec.num_speculative_tokens == 3
    out = llm.generate("the the the", SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) > 0
    caplog.clear()
    LLM(str(tiny_llama), max_model_len=64, enforce_eager=True)  # logged once per process
    assert not [r for r in caplog.records if "ignored on CPU" in r.getMessage()]
    assert llm.engine.config.distributed_executor_backend == "uni"  # "mp" at TP 1: in-process
    for key in ("pipeline_parallel_size", "data_parallel_size"):
        with pytest.raises(ConfigError, match=f"{key} .--[a-z-]+. must be 1 here, got 2: "):
            LLM(str(tiny_llama), **{key: 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'; did you mean"):
        LLM(str(tiny_llama), max_num_seq=4)
    assert EngineArgs.names(SINGLE) and EngineArgs.names(IGNORED) and EngineArgs.names(ALIAS)


def test_bad_tensor_parallel_sizes_are_clear_cli_errors(tiny_llama, capsys) -> None:
    assert cli.main(["generate", "-m", str(tiny_llama), "--tensor-parallel-size", "0"]) == 2
    assert "tensor_parallel_size must be an integer >= 1, got 0" in capsys.readouterr().err
    # the tiny model has 4 attention heads: 8 ranks would leave some without one
    assert cli.main(["generate", "-m", str(tiny_llama), "-tp", "8"]) == 2
    assert "tensor_parallel_size 8 exceeds the model's 4 attention heads" in (
        capsys.readouterr().err
    )


def test_half_dtype_keeps_the_fast_kernels_and_says_so(tiny_llama, caplog) -> None:
    caplog.set_level(logging.INFO, logger="specdec")
    fast = LLM(str(tiny_llama), max_model_len=64, dtype="bfloat16")
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert fast.engine.model.ops.name == "native"
    assert "dtype bfloat16: kept the native kernels" in messages and "33 vs 334" in messages
    start = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine:"))
    for part in ("dtype float32", "kernels native", "weights f32", "KV cache float16"):
        assert part in start
    caplog.clear()
    slow = LLM(str(tiny_llama), max_model_len=64, dtype="half", kernels="torch")
    assert slow.engine.model.ops.name == "torch" and str(slow.engine.model.dtype) == "torch.float16"
    assert any("~10x slower" in r.getMessage() for r in caplog.records)


def _imports(path: Path) -> set[str]:
    """specdec modules a file imports, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdec"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("specdec"))
    return found


def test_entry_points_do_not_import_each_other_in_a_circle() -> None:
    files = [PACKAGE / "cli.py", *PACKAGE.glob("entrypoints/**/*.py"), *PACKAGE.glob("bench/*.py")]
    modules = {
        "specdec." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts): p for p in files
    }
    graph = {m: _imports(p) & set(modules) for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 1:
            raise AssertionError("import circle: " + " -> ".join([*path, m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for n in sorted(graph[m]):
            visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])
    assert "specdec.entrypoints.openai.api_server" in graph["specdec.cli"]


def test_a_draft_with_a_shorter_context_is_named_in_the_error(tiny_llama, tiny_draft, tmp_path):
    """A Hugging Face draft whose context is shorter than max_model_len: the one-line error says
    it is the draft, and which --max-model-len would do."""
    import json
    import shutil

    from specdec.config import ConfigError

    short = tmp_path / "short_draft"
    shutil.copytree(tiny_draft, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(cfg))
    spec = {"method": "draft_model", "model": str(short), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError) as e:
        LLM(str(tiny_llama), max_model_len=128, speculative_config=spec)
    msg = str(e.value)
    assert msg.startswith("speculative_config.model (the draft model):") and "\n" not in msg
    assert "--max-model-len 64" in msg
    assert (
        LLM(str(tiny_llama), max_model_len=64, speculative_config=spec)
        .generate(["hi"], SamplingParams(max_tokens=2))[0]
        .outputs[0]
        .token_ids
    )


def test_tokenizer_is_honoured_or_refused_in_one_line(tiny_llama, tmp_path) -> None:
    """LLM(..., tokenizer=) and --tokenizer: a tokenizer folder or its tokenizer.json is used
    instead of the model's; a missing one or one too big for the model is one line."""
    import shutil

    from specdec.config import ConfigError

    own = tmp_path / "tok"
    own.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, own / name)
    cfg = json.loads((own / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    (own / "tokenizer_config.json").write_text(json.dumps(cfg))
    for path in (own, own / "tokenizer.json"):
        tok = LLM(str(tiny_llama), max_model_len=64, tokenizer=str(path)).get_tokenizer()
        assert tok.chat_template == cfg["chat_template"]
    with pytest.raises(ConfigError, match=r"^tokenizer: cannot load") as e:
        LLM(str(tiny_llama), max_model_len=64, tokenizer=str(tmp_path / "missing"))
    assert "\n" not in str(e.value)


def test_flags_are_never_abbreviated_and_unknown_ones_are_listed_together(capsys) -> None:
    from specdec import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--tokenizer-m=x", "--max-tok=3", "--no-such-flag"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "specdec generate: error: unrecognized arguments: --tokenizer-m=x --max-tok=3 "
        "--no-such-flag (see specdec generate --help)\n"
    )
    with pytest.raises(SystemExit):
        cli.main(["bench", "latency", "--temperature", "warm"])
    err = capsys.readouterr().err
    assert err.startswith("specdec bench latency: error: argument --temperature")
    assert err.count("\n") == 1


def test_a_method_free_speculative_config_refines_md() -> None:
    """llama.cpp's -md/--draft with vLLM's method-free keys (adaptive, ...) combine; a key set
    twice must agree."""
    from specdec.config import ConfigError, EngineArgs

    spec = EngineArgs(
        model_draft="d.gguf", draft_max=5, speculative_config='{"adaptive": false}'
    ).speculative()
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.adaptive) == (
        "draft_model", "d.gguf", 5, False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="num_speculative_tokens is 4"):
        EngineArgs(
            model_draft="d.gguf", draft_max=5, speculative_config={"num_speculative_tokens": 4}
        ).speculative()
    with pytest.raises(ConfigError, match="give one of"):
        EngineArgs(model_draft="d.gguf", speculative_config={"method": "ngram"}).speculative()


def test_generate_takes_the_prompt_as_an_argument(tiny_llama, capsys) -> None:
    """``specdec generate MODEL "PROMPT"`` as llama.cpp and vLLM users type it; twice is an error."""
    from specdec import cli

    argv = ["generate", str(tiny_llama), "the cat sat", "--max-tokens", "3", "--no-chat"]
    import re

    assert cli.main(argv) == 0
    used = re.search(r"prompt (\d+) tokens", capsys.readouterr().out)
    assert used and int(used.group(1)) < 20  # "the cat sat", not the default code-edit prompt
    assert cli.main([*argv, "-p", "other"]) == 2
    assert "the prompt is given twice" in capsys.readouterr().err
    # the model by flag: a lone argument is the prompt
    assert cli.main(["generate", "-m", str(tiny_llama), "the cat sat", "-n", "3", "--no-chat"]) == 0
    used = re.search(r"prompt (\d+) tokens", capsys.readouterr().out)
    assert used and int(used.group(1)) < 20


def test_more_ranks_than_cores_is_a_warning(monkeypatch, caplog) -> None:
    import logging
    import os

    from specdec.config import EngineConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level(logging.WARNING, logger="specdec.config"):
        EngineConfig(model="smollm2-135m", tensor_parallel_size=4)
    assert "tensor_parallel_size 4 is more ranks than this machine's 2 usable cores" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.config"):
        EngineConfig(model="smollm2-135m", tensor_parallel_size=2)
    assert "usable cores" not in caplog.text


def test_single_options_say_what_to_use_instead(capsys) -> None:
    from specdec import cli

    assert cli.main(["generate", "-dp", "2", "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert "specdec serve --data-parallel-size" in err and "no tensor" not in err


def _help(capsys, monkeypatch, *argv: str) -> str:
    from specdec import cli

    monkeypatch.setenv("COLUMNS", "80")  # NOTE: a common terminal; argparse wraps to it
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    assert e.value.code == 0
    return capsys.readouterr().out


def _leaf(*command: str) -> argparse.ArgumentParser:
    from specdec import cli
    from specdec.entrypoints import arg_parser

    parser = cli.build_parser()
    for name in command:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    assert isinstance(parser, arg_parser.ArgumentParser)
    return parser


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_help_fits_on_a_screen_by_section(capsys, monkeypatch, cmd) -> None:
    """--help: the common flags by section, each section's others counted, the ~200 flags
    accepted without effect in one line; --help=all (and --help-all): every flag."""
    short = _help(capsys, monkeypatch, cmd, "--help")
    assert len(short.splitlines()) <= 120, len(short.splitlines())
    for section in ("model", "cache", "scheduler", "speculative", "parallel"):
        assert f"\n{section} (" in short, section
    if cmd == "serve":
        assert "\nserver (" in short and "--port" in short
    assert "--max-num-seqs" in short and "--speculative-config" in short
    assert "--enable-lora" not in short and "--prefill-time-share" not in short
    (ignored,) = [line for line in short.splitlines() if line.startswith("accepted without")]
    assert int(ignored.split()[3]) > 200 and "--help=ignored" in short
    full = _help(capsys, monkeypatch, cmd, "--help=all")
    assert _help(capsys, monkeypatch, cmd, "--help-all") == full
    assert "--enable-lora, --no-enable-lora" in full and "--prefill-time-share" in full
    assert len(full.splitlines()) > 500


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_help_all_shows_every_flag_with_its_help_and_default(capsys, monkeypatch, cmd) -> None:
    from specdec.entrypoints.arg_parser import HelpFormatter

    full = _help(capsys, monkeypatch, cmd, "--help=all")
    parser = _leaf(cmd)
    formatter = HelpFormatter(parser.prog)
    in_sections = {
        id(a) for g in parser._action_groups if getattr(g, "section", None)
        for a in g._group_actions
    }  # fmt: skip
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        shown = formatter._get_help_string(action)
        assert action.help and action.help.strip(), action.dest
        assert id(action) in in_sections, action.dest  # every flag belongs to a section
        if action.option_strings:
            assert "default" in shown.lower() or "required" in shown, action.dest
        for flag in action.option_strings:
            name = flag[2:] if flag.startswith("--") else flag
            assert name in full, flag


def test_help_shows_one_section_or_the_flags_asked_for(capsys, monkeypatch) -> None:
    spec = _help(capsys, monkeypatch, "serve", "--help=speculative")
    assert spec == _help(capsys, monkeypatch, "serve", "--help=SpeculativeConfig")
    assert spec == _help(capsys, monkeypatch, "serve", "--help=Speculative")
    assert "--draft-p-min" in spec and "--max-num-seqs" not in spec and "--port" not in spec
    model = _help(capsys, monkeypatch, "serve", "--help=modelconfig")
    assert "--tokenizer" in model and "--kernels" in model and "--draft-max" not in model
    assert "--enable-lora" in _help(capsys, monkeypatch, "generate", "--help=LoRAConfig")
    flag = _help(capsys, monkeypatch, "serve", "--help=max_model_len")
    assert "--max-model-len" in flag and "default min(4096" in flag and len(flag) < 400
    found = _help(capsys, monkeypatch, "generate", "--help=draft")
    for name in ("--draft-max", "--draft-min", "--draft-p-min", "--model-draft"):
        assert name in found
    assert "No section or flag matches" in _help(capsys, monkeypatch, "serve", "--help=zzz")
    # sub-commands whose flags sit outside the sections ("options") too
    assert "No section or flag matches" in _help(
        capsys, monkeypatch, "bench", "latency", "--help=zzz"
    )


def test_help_listgroup_and_page(capsys, monkeypatch) -> None:
    groups = _help(capsys, monkeypatch, "serve", "--help=listgroup")
    for section in ("model", "cache", "scheduler", "speculative", "parallel", "server"):
        assert f"\n  {section}: " in groups, section
    assert "--help=SpeculativeConfig" in groups and len(groups.splitlines()) < 20
    monkeypatch.setenv("PAGER", "cat")  # NOTE: off a TTY pydoc writes plainly anyway
    page = _help(capsys, monkeypatch, "serve", "--help=page")
    assert page == _help(capsys, monkeypatch, "serve", "--help=all")


def test_train_help_shows_every_default(capsys, monkeypatch) -> None:
    text = _help(capsys, monkeypatch, "train", "eagle3", "--help")
    train = text.split("options:", 1)[1]
    for flag in ("--epochs", "--lr", "--draft-vocab", "--time-limit", "--resume"):
        assert "(default:" in train.split(flag, 1)[1].split("\n  --", 1)[0], flag
    for flag in ("--model", "--data", "--out"):
        assert "(required)" in train.split(flag, 1)[1].split("\n  --", 1)[0], flag
