"""The ``specdec`` command: generate, serve, bench and train. Engine flags come from
``EngineArgs``. It sits above entrypoints/ and bench/ (``specdec bench serve`` runs the server
in-process), so neither of those imports it."""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from specdec.bench.cli import add_bench_parser
from specdec.config import ConfigError, EngineArgs, common, section_group
from specdec.entrypoints.arg_parser import (
    ArgumentParser,
    expand_dotted,
    help_query,
    json_flags,
    walk,
)
from specdec.entrypoints.openai.api_server import add_serve_parser
from specdec.entrypoints.utils import (
    add_sampling_args,
    configure_logging,
    read_chat_template,
    run_command,
    sampling_defaults,
)
from specdec.train.cli import add_parser as add_train_parser

# A code edit from ../shared/bench/data/stdlib_edit.jsonl (CPython's Lib/colorsys.py, PSF License):
# the answer copies most of the prompt, which is where prompt lookup shines.
DEFAULT_PROMPT = "Here is a Python function `hsv_to_rgb` from the Python standard library file `Lib/colorsys.py`.\n\n```python\ndef hsv_to_rgb(h, s, v):\n    if s == 0.0:\n        return v, v, v\n    i = int(h*6.0) # XXX assume int() truncates!\n    f = (h*6.0) - i\n    p = v*(1.0 - s)\n    q = v*(1.0 - s*f)\n    t = v*(1.0 - s*(1.0-f))\n    i = i%6\n    if i == 0:\n        return v, t, p\n    if i == 1:\n        return q, v, p\n    if i == 2:\n        return p, v, t\n    if i == 3:\n        return p, q, v\n    if i == 4:\n        return t, p, v\n    if i == 5:\n        return v, p, q\n```\n\nRename this function from `hsv_to_rgb` to `hsvToRgb`. Do not change anything else. Reply with only the complete updated function in a single ```python code block, with no explanation."


def _generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt, streaming to stdout",
        usage="%(prog)s [MODEL] [PROMPT] [options]",
    )
    p.sectioned = True  # NOTE: --help by section (entrypoints/arg_parser.py)
    run = section_group(p, "prompt")
    common(run.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)"))  # fmt: skip
    common(run.add_argument("prompt_text", nargs="?", default=None, metavar="PROMPT", help="the prompt (same as --prompt)"))  # fmt: skip
    EngineArgs.add_cli_args(p)
    common(run.add_argument(
        "--prompt", "-p", default=None,
        help="the prompt (default: a code-edit request, where speculation shows well)",
    ), "the prompt (default: a code edit, where speculation shows)")  # fmt: skip
    chat = run.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the model's chat template (the default when it has one)",
    )
    chat.add_argument(
        "--no-chat",
        "--no-conversation",
        dest="chat",
        action="store_false",
        help="the prompt as it is, no chat template (llama.cpp's -no-cnv)",
    )
    run.add_argument(
        "--chat-template", default=None, help="with --chat: this template (a file, or the text)"
    )
    common(run.add_argument(
        "--max-tokens", "-n", "--n-predict", dest="max_tokens", type=int, default=256,
        help="tokens to generate at most",
    ))  # fmt: skip
    run.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    run.add_argument("--ignore-eos", action="store_true", help="go on past end-of-text tokens")
    common(run.add_argument(
        "--compare-plain", action="store_true",
        help="also run plain decoding; print the speedup",
    ))  # fmt: skip
    common(run.add_argument("--quiet", action="store_true", help="print only the summary"))
    add_sampling_args(
        p,
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
        "the prompt's",
        common_dests=("temperature",),
    )
    section_group(p, "sampling").add_argument(
        "--sampling-seed", type=int, default=None, help="the request's seed (default: from --seed)"
    )
    so = section_group(p, "structured")
    so.add_argument("--grammar", default=None, help="a GBNF (llama.cpp) or Lark grammar")
    so.add_argument("--grammar-file", default=None, help="a file holding the grammar")
    so.add_argument("--json-schema", "-j", default=None, help="a JSON schema, as text")
    so.add_argument("--json-schema-file", default=None, help="a file holding a JSON schema")
    so.add_argument("--regex", default=None, help="a regular expression the output matches")
    p.set_defaults(func=cmd_generate)


def _run_one(llm, prompt_ids: list[int], sp, stream: bool) -> tuple[object, float]:
    engine = llm.llm_engine
    start = time.perf_counter()
    req_id = engine.add_request(prompt_ids, sp)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != req_id:
                continue
            if stream and out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    elapsed = time.perf_counter() - start
    if stream:
        sys.stdout.write("\n")
    return final, elapsed


def _structured_flags(args: argparse.Namespace) -> dict | None:
    """--grammar / --grammar-file / --json-schema / --json-schema-file / --regex as a
    structured_outputs dict (one line on the CLI for a bad one)."""
    given = {
        name: value
        for name, value in (
            ("--grammar", args.grammar), ("--grammar-file", args.grammar_file),
            ("--json-schema", args.json_schema), ("--json-schema-file", args.json_schema_file),
            ("--regex", args.regex),
        )
        if value is not None
    }  # fmt: skip
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(given)}")
    ((flag, value),) = given.items()
    if flag.endswith("-file"):
        try:
            value = Path(value).read_text()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {value}: {e.strerror}") from None
    kind = "grammar" if flag.startswith("--grammar") else "regex" if flag == "--regex" else "json"
    return {kind: value}


def _use_chat(flag: bool | None, has_template: bool) -> bool:
    """--chat / --no-chat, else the chat template when the model has one (llama.cpp's habit).
    --chat on a model without one is a one-line error naming --chat-template."""
    if flag and not has_template:
        raise ValueError(
            "--chat: this model has no chat template; give one with --chat-template FILE"
        )
    return has_template if flag is None else flag


_MODEL_FLAGS = ("-m", "--model", "-hf", "-hfr", "--hf-repo")


def _model_flag_given(args: argparse.Namespace) -> bool:
    """Whether the command line named the model by a flag (then a lone argument is the prompt)."""
    raw = getattr(args, "raw_argv", None) or []
    return any(a in _MODEL_FLAGS or a.split("=", 1)[0] in _MODEL_FLAGS for a in raw)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    if args.model_tag is not None and args.prompt_text is None and _model_flag_given(args):
        args.model_tag, args.prompt_text = None, args.model_tag  # `-m MODEL "PROMPT"`
    args.model = args.model_tag or args.model
    if args.prompt_text is not None and args.prompt is not None:
        raise ConfigError("the prompt is given twice (as an argument and as --prompt): give one")
    args.prompt = next(p for p in (args.prompt_text, args.prompt, DEFAULT_PROMPT) if p is not None)
    engine_args = EngineArgs.from_cli_args(args)
    spec = engine_args.speculative()  # a bad config fails before the model loads
    sp = SamplingParams(
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        structured_outputs=_structured_flags(args),
        **sampling_defaults(args),
    )
    if args.compare_plain and spec is not None and sp.seed is None and not sp.is_greedy:
        # NOTE: both runs need one seed to be comparable; a seeded sampled run is a pure
        # function of (seed, prompt, sampling parameters), with or without speculation.
        sp.seed = random.Random(args.seed).getrandbits(63)
        print(f"--- sampling seed {sp.seed} (set --sampling-seed to choose it)")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    configure_logging()
    llm = LLM.from_engine_args(engine_args)
    tok = llm.get_tokenizer()
    if template is not None:
        tok.chat_template = template
    chat = _use_chat(args.chat, tok.chat_template is not None)
    if chat and args.chat is None and not args.quiet:
        print("--- the prompt goes through the model's chat template (--no-chat: as it is)")
    if chat:
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
    else:
        prompt_ids = tok.encode(args.prompt)
    _run_one(
        llm, prompt_ids[:8], SamplingParams(max_tokens=4, temperature=0.0), stream=False
    )  # warm-up
    engine = llm.llm_engine
    engine.reset_spec_stats()
    plain = None
    # NOTE: each timed run starts with an empty prefix cache, so neither reuses the other's prompt.
    if args.compare_plain and spec is not None:
        engine.set_speculation(False)
        engine.reset_prefix_cache()
        plain, plain_time = _run_one(llm, prompt_ids, sp, stream=False)
        engine.set_speculation(True)
    engine.reset_prefix_cache()
    out, elapsed = _run_one(llm, prompt_ids, sp, stream=not args.quiet)
    n = len(out.outputs[0].token_ids)
    label = f"speculative ({spec.method}, k={spec.num_speculative_tokens})" if spec else "plain"
    print(f"--- {label}: {n} tokens in {elapsed:.2f} s = {n / elapsed:.1f} tokens/s "
          f"(prompt {len(prompt_ids)} tokens, finish: {out.outputs[0].finish_reason})")  # fmt: skip
    if spec is not None:
        st = out.spec_decode_stats
        rates = ", ".join(f"{r:.2f}" for r in st.acceptance_rate_per_pos())
        print(f"--- acceptance: mean length {st.mean_acceptance_length:.2f}, rate {st.acceptance_rate:.2f}, "
              f"drafts {st.num_drafts}, per position [{rates}]")  # fmt: skip
    if plain is not None:
        pn = len(plain.outputs[0].token_ids)
        same = plain.outputs[0].token_ids == out.outputs[0].token_ids
        print(f"--- plain: {pn} tokens in {plain_time:.2f} s = {pn / plain_time:.1f} tokens/s; "
              f"speedup {(n / elapsed) / (pn / plain_time):.2f}x; "
              f"output identical to plain: {'yes' if same else 'NO'}")  # fmt: skip
    return 0


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """No parser takes a prefix of a flag for the flag (``--tokenizer`` is not
    ``--tokenizer-mode``): a pasted flag we lack must fail, not land on a neighbour."""
    for p in walk(parser):
        p.allow_abbrev = False


# NOTE: one line per error, under the sub-command's own name; --help by section
_Parser = ArgumentParser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost sub-command's parser that ``args`` went through."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen(action.choices[name], args)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from specdec.entrypoints.replicas.serve import cmd_serve_any

    return cmd_serve_any(args)


def build_parser() -> ArgumentParser:
    """The ``specdec`` command line: generate, serve, bench and train."""
    parser = _Parser(prog="specdec", description="speculative decoding inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_train_parser(sub)
    _no_abbreviations(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # NOTE: --help=all / --help=SECTION / --help=FLAG (--help-all: all) are --help, shown so
    argv, query = help_query(argv)
    parser = build_parser()
    for p in walk(parser):
        p.help_query = query
    argv = expand_dotted(argv, json_flags(walk(parser)))  # vLLM's --speculative-config.method
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # NOTE: every unknown flag at once, named by the sub-command that did not know them
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":
        args.func = _serve  # NOTE: one engine, replicas or Ray Serve (replicas/serve.py)
    raw = argv
    args.raw_argv = raw[raw.index(args.command) + 1 :] if args.command in raw else raw
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
