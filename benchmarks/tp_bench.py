"""Tensor parallelism on one host (issue 31): the all-reduce of one hidden row, decode tok/s at
TP 2 x 1 thread against TP 1 x 2 threads, and TP 2 against TP 1 greedy text over many prompts.

Run on a quiet machine (each section is one subcommand):

    .venv/bin/python benchmarks/tp_bench.py allreduce --hidden 576 2048 --iters 2000
    .venv/bin/python benchmarks/tp_bench.py decode --model smollm2-135m --tokens 128
    .venv/bin/python benchmarks/make_synthetic_gguf.py --shape smollm2-1.7b --types Q4_0 \\
        --out bench_out/synthetic
    .venv/bin/python benchmarks/tp_bench.py decode --model bench_out/synthetic/<file>.gguf
    .venv/bin/python benchmarks/tp_bench.py agree --model smollm2-135m --prompts 30 --tokens 128

``decode`` runs TP 1 with ``threads`` = 2 and TP 2 with each rank bound to one core (the usable
cores split evenly): the same cores, so the ratio is the price of the split (two all-reduces
per layer and the pipe to the worker) on one socket.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "List the planets of the solar system and one fact about each.",
    "def quicksort(xs):",
    "The history of the printing press",
    "Describe the water cycle in simple words.",
]


def _measure(pg: dist.ProcessGroup, shm: str, hidden: list[int], iters: int, rank: int) -> None:
    from specdec.worker.tp import ShmAllReduce

    torch.set_num_threads(1)
    ops = {
        "gloo": lambda t: pg.allreduce([t]).wait(),
        "shm": ShmAllReduce(shm, rank, 2, lambda: None),
    }
    for name, op in ops.items():
        for h in hidden:
            t = torch.randn(1, h)
            for _ in range(50):
                op(t)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                op(t)
                times.append(time.perf_counter() - start)
            if rank == 0:
                print(f"{name} all-reduce, 1 row x {h} float32, 2 ranks: median "
                      f"{statistics.median(times) * 1e6:.1f} us")  # fmt: skip


def allreduce(args: argparse.Namespace) -> None:
    """gloo over loopback, then the shared-memory all-reduce (worker/tp.py: ShmAllReduce)."""
    from specdec.worker.tp import make_shm_file

    timeout = timedelta(seconds=60)
    if args.rank is not None:  # the peer process
        store = dist.TCPStore("127.0.0.1", args.port, 2, False, timeout=timeout)
        pg = dist.ProcessGroupGloo(store, 1, 2, timeout)
        _measure(pg, args.shm, args.hidden, args.iters, 1)
        return
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    shm = make_shm_file(2)
    cmd = [sys.executable, __file__, "allreduce", "--port", str(store.port), "--rank", "1",
           "--shm", shm, "--iters", str(args.iters), "--hidden", *map(str, args.hidden)]  # fmt: skip
    peer = subprocess.Popen(cmd)
    try:
        _measure(dist.ProcessGroupGloo(store, 0, 2, timeout), shm, args.hidden, args.iters, 0)
    finally:
        peer.wait(120)
        os.unlink(shm)


def _decode_tps(model: str, tp: int, threads: int | None, tokens: int, act: str) -> float:
    from specdec import LLM, SamplingParams

    llm = LLM(model, max_model_len=512, tensor_parallel_size=tp, threads=threads,
              activation_dtype=act)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        out = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
        rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - start))
    llm.engine.shutdown()
    return statistics.median(rates)


def decode(args: argparse.Namespace) -> None:
    """TP 1 x 2 threads and TP 2 x 1 thread a rank, alternated ``rounds`` times; medians."""
    cores = len(os.sched_getaffinity(0))
    one, two = [], []
    for _ in range(args.rounds):
        one.append(_decode_tps(args.model, 1, 2, args.tokens, args.activation_dtype))
        two.append(_decode_tps(args.model, 2, None, args.tokens, args.activation_dtype))
    a, b = statistics.median(one), statistics.median(two)
    print(f"{args.model} ({args.activation_dtype} activations): decode TP 1 x 2 threads "
          f"{a:.1f} tok/s, TP 2 x 1 thread {b:.1f} tok/s, ratio {b / a:.2f} "
          f"({cores} usable cores; rounds {one} / {two})")  # fmt: skip


def _first_logits(llm, prompts: list[str]) -> list:
    """Each prompt's next-token logits (one forward of the whole prompt)."""
    from specdec.model.llama import SeqBatch

    m, out = llm.engine.model, []
    for p in prompts:
        ids = llm.get_tokenizer().encode(p)
        kv = m.make_kv_cache(1, len(ids) + 1)
        batch = SeqBatch([0], [0], [len(ids)])
        h = m.forward(torch.tensor(ids), torch.arange(len(ids)), batch, kv)
        out.append(m.compute_logits(h[-1:])[0])
    return out


def agree(args: argparse.Namespace) -> None:
    from specdec import LLM, SamplingParams

    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(args.prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens)
    texts, logits = {}, {}
    for tp in (1, 2):
        llm = LLM(args.model, max_model_len=512, tensor_parallel_size=tp,
                  activation_dtype=args.activation_dtype, quantization=args.quantization)  # fmt: skip
        texts[tp] = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
        logits[tp] = _first_logits(llm, prompts)
        llm.engine.shutdown()
    same = sum(a == b for a, b in zip(texts[1], texts[2]))
    diff = max((a - b).abs().max().item() for a, b in zip(logits[1], logits[2]))
    print(f"{args.model} ({args.quantization} weights, {args.activation_dtype} activations): "
          f"TP 2 greedy text equals TP 1 on "
          f"{same}/{len(prompts)} prompts x {args.tokens} tokens; next-token logits after each "
          f"prompt differ by at most {diff:.2e}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allreduce")
    a.add_argument("--hidden", type=int, nargs="+", default=[576, 2048])
    a.add_argument("--iters", type=int, default=2000)
    a.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    a.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a.add_argument("--shm", default="", help=argparse.SUPPRESS)
    d = sub.add_parser("decode")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--tokens", type=int, default=128)
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--activation-dtype", default="auto")
    g = sub.add_parser("agree")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--prompts", type=int, default=30)
    g.add_argument("--tokens", type=int, default=128)
    g.add_argument("--activation-dtype", default="auto")
    g.add_argument("--quantization", default="auto", help="auto: the file's; fp32: dequantized")
    args = ap.parse_args()
    {"allreduce": allreduce, "decode": decode, "agree": agree}[args.cmd](args)


if __name__ == "__main__":
    main()
