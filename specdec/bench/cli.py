"""``specdec bench latency`` and ``specdec bench forward-cost``; ``serve`` and ``multiturn`` register
their own parsers."""

from __future__ import annotations

import argparse

from specdec.bench.args import (
    FORWARD_COST_ENGINE_ARGS,
    LATENCY_ENGINE_ARGS,
    add_command,
    add_dataset_args,
    csv,
    flag_values,
    int_csv,
    shared_options,
)
from specdec.bench.dataset import DEFAULT_CODE_PREFIX
from specdec.bench.forward_cost import DEFAULT_NS
from specdec.bench.multiturn import add_multiturn_parser
from specdec.bench.replay import DEFAULT_METHODS, REPLAY_ENGINE_ARGS
from specdec.bench.serve import add_serve_parser
from specdec.config import EngineArgs

LATENCY_EPILOG = """\
configurations ([backend:]method[:key=value,...]):
  plain                              our plain decoding (the reference; added when missing)
  ngram:k=5,min=1,max=4              k -> num_speculative_tokens, min/max -> prompt_lookup_min/max
  layer_skip:k=3,layers=8            layers -> num_draft_layers
  draft_model:model=smollm2-135m,k=4 model -> the draft; quant -> draft_quantization
  METHOD:key=value                   any other key goes to speculative_config unchanged
  hf:plain  hf:prompt_lookup:k=10  hf:assistant:model=M,k=5     transformers generate (anchor)
  llama_cpp:plain  llama_cpp:prompt_lookup:k=10                 llama-cpp-python (anchor)
Anchors run in processes of their own with their libraries' defaults (results.json records
them) and are skipped with one line when their package is missing. Under greedy sampling, a
speculative output that differs from plain's is a FAILURE and the exit code is 1.

examples:
  specdec bench latency --model smollm2-135m     # the package's own small prompt set
  specdec bench latency --model smollm2-135m \\
      --dataset ../shared/bench/data/stdlib_edit.jsonl --dataset ../shared/bench/data/mt_bench.jsonl \\
      --num-prompts 5 --max-tokens 256 --configs plain ngram:k=5 ngram:k=5,max=4 hf:plain
"""


def _latency_parser(sub) -> None:
    p = add_command(
        sub,
        "latency",
        "tokens/s, speedup, acceptance and exactness per configuration and category",
        LATENCY_EPILOG,
    )
    EngineArgs.add_cli_args(p, LATENCY_ENGINE_ARGS)
    add_dataset_args(p)
    p.add_argument("--configs", nargs="+", default=["plain", "ngram:k=5"], metavar="CONFIG",
                   help="configurations to compare (syntax below; default: plain ngram:k=5)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (exactness is checked)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="use the chat template (default: when the model has one)")  # fmt: skip
    p.add_argument("--code-prefix", default=DEFAULT_CODE_PREFIX,
                   help="with --chat, put this before code_completion prompts (HumanEval), as EAGLE "
                        "does; '' for none (default: %(default)r)")  # fmt: skip
    p.add_argument("--output-dir", default=None, help="default: bench_out/<timestamp>")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--interleave", action="store_true",
                   help="load every configuration at once and run each prompt on all of them in "
                   "turn (order rotating), so a machine whose speed drifts shifts them alike")  # fmt: skip
    p.set_defaults(func=cmd_latency)


def _forward_cost_parser(sub) -> None:
    p = sub.add_parser(
        "forward-cost", help="ms of one target forward over N new tokens (with logits)"
    )
    EngineArgs.add_cli_args(p, FORWARD_COST_ENGINE_ARGS)
    p.add_argument("--context", type=int, default=200, help="tokens already in the KV cache")
    p.add_argument(
        "--ns", type=int_csv, default=DEFAULT_NS, help="comma-separated N (default: %(default)s)"
    )
    p.add_argument("--repeats", type=int, default=10, help="timed runs per N (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per N before the timed ones")
    p.add_argument(
        "--json", dest="json_path", default=None, help="also write the results to this JSON file"
    )
    p.add_argument(
        "--moe-one-by-one", action="store_true",
        help="mixture of experts: run each row's experts one by one (the baseline of the "
        "expert-grouped step)",
    )  # fmt: skip
    p.set_defaults(func=cmd_forward_cost)


REPLAY_EPILOG = """\
record: the real model runs each prompt per drafter (greedy, one at a time, every step drafting
up to the cap); per step the drafts proposed, how many were accepted and the drafter's time.
run: a GGUF file (random weights of a real shape: benchmarks/make_synthetic_gguf.py) runs each
prompt plain, then each drafter replayed with the adaptive controller live: real forwards, the
recorded acceptance and drafting time. Random weights change no speed, but the speedups are
replays of another model's acceptance, and are labelled so.

examples:
  specdec bench replay record --model smollm2-135m --methods suffix,ngram --max-tokens 64 \\
      --out bench_out/replay/trace.json
  specdec bench replay run --trace bench_out/replay/trace.json \\
      --model bench_out/synthetic/qwen3-1.7b-Q4_0.gguf
"""


def _replay_parser(sub) -> None:
    p = add_command(
        sub,
        "replay",
        "each drafter's speedup on a random-weight GGUF of a real shape, replaying drafts "
        "recorded on a real model",
        REPLAY_EPILOG,
    )
    rsub = p.add_subparsers(dest="replay_command", required=True)
    rec = rsub.add_parser("record", help="record each drafter's steps on a real model")
    rec.add_argument("--model", default="smollm2-135m", help="the real model recorded on")
    rec.add_argument("--methods", type=csv, default=list(DEFAULT_METHODS),
                     help="comma-separated drafters (default: %(default)s)")  # fmt: skip
    rec.add_argument("--prompts", action="append", default=None, metavar="FILE.jsonl",
                     help="prompt set (lines {id, category, turns}); repeatable (default: the "
                     "package's own set)")  # fmt: skip
    rec.add_argument("--categories", type=csv, default=None)
    rec.add_argument("--num-prompts", type=int, default=None, help="first N of each category")
    rec.add_argument("--max-tokens", type=int, default=128)
    rec.add_argument("--k", type=int, default=None, help="every drafter's cap (default: its own)")
    rec.add_argument("--threads", type=int, default=None)
    rec.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="use the chat template (default: when the model has one)")  # fmt: skip
    rec.add_argument("--out", required=True, help="the trace (JSON)")
    rec.set_defaults(func=cmd_replay_record)
    run = rsub.add_parser("run", help="replay a trace on a GGUF file, the controller live")
    run.add_argument("--trace", required=True)
    run.add_argument("--model", required=True, help="the GGUF file replayed on")
    run.add_argument("--methods", type=csv, default=None, help="default: every drafter recorded")
    run.add_argument("--categories", type=csv, default=None)
    run.add_argument("--max-tokens", type=int, default=None, help="default: the trace's")
    EngineArgs.add_cli_args(run, REPLAY_ENGINE_ARGS)
    run.add_argument("--model-drafter-scale", type=float, default=None,
                     help="a head's or draft model's time here per recorded ms (default: this "
                     "file's one-row step over the recording model's)")  # fmt: skip
    run.add_argument("--ns", type=int_csv, default=(1, 2, 3, 4, 6, 8, 12, 16),
                     help="forward-cost's N (reported)")  # fmt: skip
    run.add_argument("--repeats", type=int, default=5, help="forward-cost's timed runs per N")
    run.add_argument("--bandwidth-gib", type=float, default=1.0,
                     help="the read-bandwidth test's size (0: no roof)")  # fmt: skip
    run.add_argument("--json", dest="json_path", default=None)
    run.set_defaults(func=cmd_replay_run)


def add_bench_parser(subparsers) -> None:
    """Register ``bench`` and its subcommands on the main ``specdec`` parser."""
    p = subparsers.add_parser(
        "bench", help="benchmarks: latency, forward-cost, serve, multiturn, replay"
    )
    sub = p.add_subparsers(dest="bench_command", required=True)
    _latency_parser(sub)
    _forward_cost_parser(sub)
    add_serve_parser(sub)
    add_multiturn_parser(sub)
    _replay_parser(sub)


def cmd_latency(args: argparse.Namespace) -> int:
    from specdec.bench.latency import LatencyOptions, run_latency

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    opts = LatencyOptions(
        **shared_options(args),
        **flag_values(args, "temperature", "ignore_eos", "chat", "code_prefix", "output_dir"),
        plots=not args.no_plots,
        progress=not args.no_progress,
        interleave=args.interleave,
    )
    return run_latency(opts).exit_code


def cmd_forward_cost(args: argparse.Namespace) -> int:
    from specdec.bench.forward_cost import ForwardCostOptions, run_forward_cost

    if args.repeats < 1 or args.warmup < 0 or args.context < 1:
        raise ValueError("--repeats and --context must be >= 1, --warmup >= 0")
    run_forward_cost(
        ForwardCostOptions(
            engine=EngineArgs.from_cli_args(args),
            context=args.context,
            ns=tuple(args.ns),
            repeats=args.repeats,
            warmup=args.warmup,
            json_path=args.json_path,
            moe_grouped=not args.moe_one_by_one,
        )
    )
    return 0


def cmd_replay_record(args: argparse.Namespace) -> int:
    from specdec.bench.replay import RecordOptions, record

    if args.max_tokens < 1 or (args.k is not None and args.k < 1):
        raise ValueError("--max-tokens and --k must be >= 1")
    opts = RecordOptions(
        model=args.model,
        methods=tuple(args.methods),
        prompts=tuple(args.prompts or ()),
        categories=tuple(args.categories) if args.categories else None,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        k=args.k,
        chat=args.chat,
        threads=args.threads,
    )
    record(opts).save(args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_replay_run(args: argparse.Namespace) -> int:
    from specdec.bench.replay import ReplayOptions, run_replay_cli

    run_replay_cli(
        ReplayOptions(
            trace=args.trace,
            model=args.model,
            methods=tuple(args.methods) if args.methods else None,
            categories=tuple(args.categories) if args.categories else None,
            max_tokens=args.max_tokens,
            model_scale=args.model_drafter_scale,
            engine=EngineArgs.from_cli_args(args).replace(model=args.model),
            ns=tuple(args.ns),
            repeats=args.repeats,
            bandwidth_gib=args.bandwidth_gib,
            json_path=args.json_path,
        )
    )
    return 0
