"""The VNNI kernels' two walks of a product (kernels.h A8Walk: "groups" and "stationary"), side by
side in one process (not a test): one model, one KV cache at a fixed context, the walk switched
(``_C.set_a8_walk``) every few steps, the order reversed block by block, so a shared machine's
drifts hit both alike. First checks that both walks give the same logits bit for bit, then prints
each walk's step-time quantiles (forward + logits over N new rows) and the speed-up over the first.

    .venv/bin/python benchmarks/walk_ab.py --model smollm2-135m --context 200 --n 1 --kv int8
    .venv/bin/python benchmarks/walk_ab.py --model qwen3-1.7b-Q4_K_M.gguf --n 1 --blocks 12 --per 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM
from specdec import kernels as K
from specdec.model.llama import SeqBatch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--n", type=int, default=1, help="new rows a step")
    ap.add_argument("--kv", default="int8", help="kv_cache_dtype")
    ap.add_argument("--walks", nargs="+", default=["groups", "stationary"])
    ap.add_argument("--blocks", type=int, default=30, help="switches of the walk")
    ap.add_argument("--per", type=int, default=5, help="timed steps a block")
    args = ap.parse_args()
    if not K.native_available() or not K._C.a8_available():
        raise SystemExit("needs the native kernels and a CPU with AVX-512 VNNI")
    llm = LLM(
        args.model, max_model_len=args.context + args.n + 16, max_num_seqs=1,
        kv_cache_dtype=args.kv,
    )  # fmt: skip
    m = llm.engine.model
    kv = m.make_kv_cache(1, args.context + args.n + 8)
    gen = torch.Generator().manual_seed(0)
    vocab = m.cfg.vocab_size
    pos = torch.arange(args.context, args.context + args.n)
    batch = SeqBatch([0], [args.context], [args.n])

    def step(ids: torch.Tensor) -> torch.Tensor:
        return m.compute_logits(m.forward(ids, pos, batch, kv))

    try:
        with torch.inference_mode():
            prompt = torch.randint(0, vocab, (args.context,), generator=gen)
            m.forward(prompt, torch.arange(args.context), SeqBatch([0], [0], [args.context]), kv)
            from specdec.kv_cache.memory import settle_huge_pages

            settle_huge_pages()
            ids = torch.randint(0, vocab, (args.n,), generator=gen)
            outs = []
            for walk in args.walks:
                K._C.set_a8_walk(walk)
                outs.append(step(ids))
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            print(f"logits equal bit for bit across {', '.join(args.walks)}: {same}")
            times: dict[str, list[float]] = {w: [] for w in args.walks}
            for block in range(args.blocks):
                for walk in args.walks if block % 2 == 0 else args.walks[::-1]:
                    K._C.set_a8_walk(walk)
                    for i in range(args.per + 1):  # the first step after a switch is not timed
                        ids = torch.randint(0, vocab, (args.n,), generator=gen)
                        start = time.perf_counter()
                        float(step(ids)[-1, 0])
                        if i:
                            times[walk].append(time.perf_counter() - start)
    finally:
        K._C.set_a8_walk("auto")
    first = statistics.median(times[args.walks[0]])
    for walk, t in times.items():
        t.sort()
        med = statistics.median(t)
        print(
            f"{walk:12s} median {1e3 * med:8.3f} ms  p25 {1e3 * t[len(t) // 4]:8.3f}  "
            f"min {1e3 * t[0]:8.3f}  speed-up over {args.walks[0]}: {first / med:.3f}x"
        )


if __name__ == "__main__":
    main()
