"""One target forward over N rows with the 8-bit activation kernels on VNNI or on AMX-INT8.

The same model, KV cache and inputs as ``specdec bench forward-cost``; the kernels are switched
at run time (``specdec.kernels.set_native_amx``, ``_C.set_amx_min_rows``) and the configurations
alternate call by call, so the load of a shared machine hits them alike:

* ``vnni``: AMX off (the kernels before session 10);
* ``amx``: AMX at its measured per-format thresholds (the default);
* ``amx1``: AMX for every call from one row (every format).

The outputs of all configurations are also checked to be equal bit for bit.

    .venv/bin/python benchmarks/amx_forward_ab.py --model smollm2-135m --threads 2
    .venv/bin/python benchmarks/amx_forward_ab.py \
        --model bench_out/synthetic/smollm2-1.7b-Q4_0.gguf --repeats 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from specdec import kernels as K
from specdec.config import EngineArgs
from specdec.llm import LLM
from specdec.model.llama import SeqBatch

CONFIGS = ("vnni", "amx", "amx1")


def _select(cfg: str) -> None:
    K.set_native_amx(cfg != "vnni")
    K._C.set_amx_min_rows(1 if cfg == "amx1" else 0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    import torch  # NOTE: after specdec, which sets torch's OpenMP threads to wait passively

    if not K.amx_available():
        raise SystemExit("AMX-INT8 is not available here (CPU, OS permission or build)")
    torch.set_num_threads(args.threads)
    ns = sorted({int(n) for n in args.ns.split(",")} | {1})
    engine = EngineArgs(model=args.model, max_model_len=args.context + max(ns) + 1, max_num_seqs=1)
    model = LLM.from_engine_args(engine).engine.model
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    kv = model.make_kv_cache(1, args.context + max(ns) + 1)
    times: dict[tuple[str, int], list[float]] = {(c, n): [] for c in CONFIGS for n in ns}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    load0 = os.getloadavg()[0]
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (args.context,), generator=gen)
        model.forward(prompt, torch.arange(args.context), SeqBatch([0], [0], [args.context]), kv)
        inputs = {n: torch.randint(0, vocab, (n,), generator=gen) for n in ns}
        pos = {n: torch.arange(args.context, args.context + n) for n in ns}

        def step(n: int) -> tuple[float, torch.Tensor]:
            start = time.perf_counter()
            hidden = model.forward(inputs[n], pos[n], SeqBatch([0], [args.context], [n]), kv)
            out = model.compute_logits(hidden)  # [n, vocab]
            float(out[-1, 0])
            return time.perf_counter() - start, out

        for rep in range(args.repeats + 2):
            for n in ns:
                for cfg in CONFIGS:
                    _select(cfg)
                    dt, out = step(n)
                    if rep >= 2:  # two warm-up rounds
                        times[cfg, n].append(dt)
                    logits.setdefault((cfg, n), out.clone())
    _select("amx")
    for n in ns:
        for cfg in CONFIGS:
            assert torch.equal(logits[cfg, n], logits["vnni", n]), (cfg, n)
    print(
        f"model {args.model}, threads {args.threads}, context {args.context}, "
        f"{args.repeats} repeats, load {load0:.1f} -> {os.getloadavg()[0]:.1f}; "
        "logits equal bit for bit across configurations"
    )
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print("| config | " + " | ".join(f"N={n} ms (ratio)" for n in ns) + " |")
    print("|---|" + "---|" * len(ns))
    for cfg in CONFIGS:
        cells = [f"{med[cfg, n]:.2f} ({med[cfg, n] / med[cfg, 1]:.2f})" for n in ns]
        print(f"| {cfg} | " + " | ".join(cells) + " |")
    for cfg in CONFIGS[1:]:
        print(
            f"{cfg} / vnni time: "
            + ", ".join(f"N={n} {med[cfg, n] / med['vnni', n]:.3f}" for n in ns)
        )


if __name__ == "__main__":
    main()
