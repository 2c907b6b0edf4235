"""``specdec bench latency`` and ``specdec bench forward-cost``; ``serve`` and ``multiturn`` register
their own parsers."""

from __future__ import annotations

import argparse

from specdec.bench.args import (
    FORWARD_COST_ENGINE_ARGS,
    LATENCY_ENGINE_ARGS,
    add_dataset_args,
    int_csv,
)
from specdec.bench.dataset import DEFAULT_CODE_PREFIX, DEFAULT_DATASET
from specdec.bench.forward_cost import DEFAULT_NS
from specdec.bench.multiturn import add_multiturn_parser
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
    p = sub.add_parser(
        "latency",
        help="tokens/s, speedup, acceptance and exactness per configuration and category",
        epilog=LATENCY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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


def add_bench_parser(subparsers) -> None:
    """Register ``bench`` and its subcommands on the main ``specdec`` parser."""
    p = subparsers.add_parser("bench", help="benchmarks: latency, forward-cost, serve, multiturn")
    sub = p.add_subparsers(dest="bench_command", required=True)
    _latency_parser(sub)
    _forward_cost_parser(sub)
    add_serve_parser(sub)
    add_multiturn_parser(sub)


def cmd_latency(args: argparse.Namespace) -> int:
    from specdec.bench.latency import LatencyOptions, run_latency

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    opts = LatencyOptions(
        engine=EngineArgs.from_cli_args(args),
        datasets=args.dataset or [str(DEFAULT_DATASET)],
        configs=args.configs,
        categories=args.categories,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        chat=args.chat,
        code_prefix=args.code_prefix,
        output_dir=args.output_dir,
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
