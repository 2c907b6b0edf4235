"""``specdec bench latency`` and ``specdec bench forward-cost``."""

from __future__ import annotations

import argparse

from specdec.bench.dataset import DEFAULT_CODE_PREFIX
from specdec.bench.forward_cost import DEFAULT_NS
from specdec.entrypoints.cli import add_prefix_caching_arg
from specdec.model.registry import DEFAULT_MODEL

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

example:
  specdec bench latency --model smollm2-135m \\
      --dataset ../shared/bench/data/stdlib_edit.jsonl --dataset ../shared/bench/data/mt_bench.jsonl \\
      --num-prompts 5 --max-tokens 256 --configs plain ngram:k=5 ngram:k=5,max=4 hf:plain
"""


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _int_csv(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in _csv(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{text}'")
    return values


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", "-m", default=DEFAULT_MODEL, help="alias, .gguf file or Hugging Face folder"
    )
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "torch"])
    p.add_argument(
        "--quantization", default="auto", choices=["auto", "fp32", "q8_0", "q4_0", "q4_1"]
    )
    p.add_argument("--activation-dtype", default="auto", choices=["auto", "float32", "int8"])
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto, float32, float16 or bfloat16 (as specdec serve)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="our engine's torch threads (default: torch's choice); anchors keep their own",
    )


def _dataset_args(p: argparse.ArgumentParser) -> None:
    """--dataset / --categories / --num-prompts, shared by the latency and serve benchmarks."""
    p.add_argument("--dataset", action="append", required=True, metavar="FILE.jsonl",
                   help="prompt set (lines {id, category, turns}); repeatable")  # fmt: skip
    p.add_argument(
        "--categories", type=_csv, default=None, help="comma-separated categories to keep"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each category")


def _latency_parser(sub) -> None:
    p = sub.add_parser(
        "latency",
        help="tokens/s, speedup, acceptance and exactness per configuration and category",
        epilog=LATENCY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_args(p)
    _dataset_args(p)
    p.add_argument("--configs", nargs="+", default=["plain", "ngram:k=5"], metavar="CONFIG",
                   help="configurations to compare (syntax below; default: plain ngram:k=5)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (exactness is checked)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="sampling seed per request when temperature > 0"
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="use the chat template (default: when the model has one)")  # fmt: skip
    p.add_argument("--code-prefix", default=DEFAULT_CODE_PREFIX,
                   help="with --chat, put this before code_completion prompts (HumanEval), as EAGLE "
                        "does; '' for none (default: %(default)r)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None)
    add_prefix_caching_arg(p)
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
    _model_args(p)
    p.add_argument("--context", type=int, default=200, help="tokens already in the KV cache")
    p.add_argument(
        "--ns", type=_int_csv, default=DEFAULT_NS, help="comma-separated N (default: %(default)s)"
    )
    p.add_argument("--repeats", type=int, default=10, help="timed runs per N (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per N before the timed ones")
    p.add_argument(
        "--json", dest="json_path", default=None, help="also write the results to this JSON file"
    )
    p.set_defaults(func=cmd_forward_cost)


def add_bench_parser(subparsers) -> None:
    """Register ``bench`` and its subcommands on the main ``specdec`` parser."""
    from specdec.bench.serve import add_serve_parser

    p = subparsers.add_parser("bench", help="benchmarks: latency, forward-cost, serve")
    sub = p.add_subparsers(dest="bench_command", required=True)
    _latency_parser(sub)
    _forward_cost_parser(sub)
    add_serve_parser(sub)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def cmd_latency(args: argparse.Namespace) -> int:
    from specdec.bench.latency import LatencyOptions, run_latency

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    _set_threads(args.threads)
    opts = LatencyOptions(
        model=args.model,
        datasets=args.dataset,
        configs=args.configs,
        categories=args.categories,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        chat=args.chat,
        code_prefix=args.code_prefix,
        kernels=args.kernels,
        quantization=args.quantization,
        activation_dtype=args.activation_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
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
    _set_threads(args.threads)
    run_forward_cost(
        ForwardCostOptions(
            model=args.model,
            kernels=args.kernels,
            quantization=args.quantization,
            activation_dtype=args.activation_dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            context=args.context,
            ns=tuple(args.ns),
            repeats=args.repeats,
            warmup=args.warmup,
            json_path=args.json_path,
        )
    )
    return 0
