"""Load time, RSS after load and peak RSS of one model file, in this process (run each engine
in its own process, alternating):

    PYTHONPATH=. .venv/bin/python benchmarks/load_memory.py specdec FILE.gguf
    env -i PATH=$PATH HOME=$HOME .venv/bin/python benchmarks/load_memory.py llama.cpp FILE.gguf

specdec: ``LLM(file, max_model_len=512, max_num_seqs=1)``; llama.cpp (llama-cpp-python, the
anchors extra): ``Llama(file, n_ctx=512, n_threads=2)`` in its own default environment. For a
before/after, run the first line from each checkout (``PYTHONPATH`` picks the one imported).
``load_s`` is the whole (import + model); ``import_s`` and ``model_s`` its two parts. specdec's
weight cache (``SPECDEC_WEIGHT_CACHE``) applies as in any run: set it to ``off`` to time the
repacking load, or to a folder (run twice) to time a load that maps the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["specdec", "llama.cpp"])
    ap.add_argument("model")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.engine == "specdec":
        import specdec
        from specdec import LLM

        t1 = time.perf_counter()
        llm = LLM(args.model, max_model_len=512, max_num_seqs=1)
        where = os.path.dirname(os.path.dirname(specdec.__file__))
    else:
        import llama_cpp

        t1 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=args.model, n_ctx=512, n_threads=2, verbose=False)
        where = llama_cpp.__version__
    t2 = time.perf_counter()
    load, imports = t2 - t0, t1 - t0
    import psutil

    info = psutil.Process().memory_full_info()
    print(json.dumps({
        "engine": args.engine, "from": where, "file_gib": round(os.path.getsize(args.model) / 2**30, 2),
        "load_s": round(load, 1), "import_s": round(imports, 2), "model_s": round(t2 - t1, 2),
        "rss_gib": round(info.rss / 2**30, 2),
        "uss_gib": round(info.uss / 2**30, 2),
        "peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }))  # fmt: skip
    del llm


if __name__ == "__main__":
    main()
