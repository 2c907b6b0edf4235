"""The ``specdec`` command: generate (and, as they land, serve and bench)."""

from __future__ import annotations

import argparse
import random
import sys
import time

from specdec.config import ConfigError, SpeculativeConfig
from specdec.model.arch import UnsupportedModelError
from specdec.model.registry import DEFAULT_MODEL, ModelNotFoundError

# A code edit from ../shared/bench/data/stdlib_edit.jsonl (CPython's Lib/colorsys.py, PSF License):
# the answer copies most of the prompt, which is where prompt lookup shines.
DEFAULT_PROMPT = "Here is a Python function `hsv_to_rgb` from the Python standard library file `Lib/colorsys.py`.\n\n```python\ndef hsv_to_rgb(h, s, v):\n    if s == 0.0:\n        return v, v, v\n    i = int(h*6.0) # XXX assume int() truncates!\n    f = (h*6.0) - i\n    p = v*(1.0 - s)\n    q = v*(1.0 - s*f)\n    t = v*(1.0 - s*(1.0-f))\n    i = i%6\n    if i == 0:\n        return v, t, p\n    if i == 1:\n        return q, v, p\n    if i == 2:\n        return p, v, t\n    if i == 3:\n        return p, q, v\n    if i == 4:\n        return t, p, v\n    if i == 5:\n        return v, p, q\n```\n\nRename this function from `hsv_to_rgb` to `hsvToRgb`. Do not change anything else. Reply with only the complete updated function in a single ```python code block, with no explanation."


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", "-m", default=DEFAULT_MODEL, help="alias, .gguf file or Hugging Face folder"
    )
    p.add_argument("--speculative-config", default=None, help="JSON, vLLM's keys")
    p.add_argument("--model-draft", "-md", default=None, help="draft model (llama.cpp style)")
    p.add_argument(
        "--draft", type=int, default=None, help="drafts per step with -md (llama.cpp style)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "torch"])
    p.add_argument(
        "--quantization", default="auto", choices=["auto", "fp32", "q8_0", "q4_0", "q4_1"]
    )
    p.add_argument(
        "--activation-dtype",
        default="auto",
        choices=["auto", "float32", "int8"],
        help="int8: llama.cpp-style 8-bit activations for quantized weights (fast on AVX-512 "
        "VNNI); float32: exact float activations (matches transformers); auto: int8 where fast",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="KV pool budget: bytes, or a fraction (<= 1) of available RAM",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's name for --kv-cache-memory as a fraction (accepted on any device)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache element type: float16 (half the memory; llama.cpp's default f16), float32 "
        "(transformers' arithmetic), bfloat16 (torch kernels only); auto: float16 on the native "
        "CPU kernels, else the model's dtype",
    )
    add_prefix_caching_arg(p)


def add_prefix_caching_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of earlier requests' shared prompt prefixes (default: on)",
    )


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.speculative_config and args.model_draft:
        raise ConfigError("use either --speculative-config or -md/--model-draft, not both")
    if args.model_draft:
        d = {"method": "draft_model", "model": args.model_draft}
        if args.draft is not None:
            d["num_speculative_tokens"] = args.draft
        return SpeculativeConfig.from_dict(d)
    if args.draft is not None:
        raise ConfigError("--draft needs -md/--model-draft")
    return SpeculativeConfig.from_any(args.speculative_config)


def build_llm(args: argparse.Namespace, spec: SpeculativeConfig | None):
    from specdec.llm import LLM

    return LLM(
        args.model,
        speculative_config=spec,
        dtype=args.dtype,
        device=args.device,
        kernels=args.kernels,
        quantization=args.quantization,
        activation_dtype=args.activation_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        kv_cache_memory=args.kv_cache_memory or args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    add_engine_args(p)
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--compare-plain", action="store_true", help="also run plain decoding; print the speedup"
    )
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.set_defaults(func=cmd_generate)


def _run_one(llm, prompt_ids: list[int], sp, stream: bool) -> tuple[object, float]:
    engine = llm.engine
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


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.sampling_params import SamplingParams
    from specdec.spec_decode.metrics import SpecDecodeStats

    spec = speculative_from_args(args)
    sp = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.compare_plain and spec is not None and sp.seed is None and not sp.is_greedy:
        # NOTE: both runs need one seed to be comparable; a seeded sampled run is a pure
        # function of (seed, prompt, sampling parameters), with or without speculation.
        sp.seed = random.Random(args.seed).getrandbits(63)
        print(f"--- sampling seed {sp.seed} (set --sampling-seed to choose it)")
    llm = build_llm(args, spec)
    tok = llm.get_tokenizer()
    if args.chat:
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
    else:
        prompt_ids = tok.encode(args.prompt)
    _run_one(
        llm, prompt_ids[:8], SamplingParams(max_tokens=4, temperature=0.0), stream=False
    )  # warm-up
    if llm.engine.speculator is not None:
        llm.engine.speculator.stats = SpecDecodeStats()
    plain = None
    # NOTE: each timed run starts with an empty prefix cache, so neither reuses the other's prompt.
    if args.compare_plain and spec is not None:
        llm.engine.speculator.enabled = False
        llm.engine.reset_prefix_cache()
        plain, plain_time = _run_one(llm, prompt_ids, sp, stream=False)
        llm.engine.speculator.enabled = True
    llm.engine.reset_prefix_cache()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specdec", description="speculative decoding inference engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    try:
        from specdec.entrypoints.openai.api_server import add_serve_parser
    except ImportError:
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
    try:
        from specdec.bench.cli import add_bench_parser
    except ImportError:
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)
    args = parser.parse_args(argv)
    return run_command(args.func, args)


def run_command(func, args: argparse.Namespace) -> int:
    """Run a subcommand; a user error becomes one line on stderr and exit code 2."""
    try:
        return int(func(args) or 0)
    except (ConfigError, ModelNotFoundError, UnsupportedModelError, ValueError) as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
