"""16-bit weights against llama.cpp: load time, RSS, prefill and plain decode, each run in a process
of its own, engines alternating (issue 18, items 6-7).

    .venv/bin/python benchmarks/half_weights.py /tmp/bf16_synth/smollm2-1.7b-F16.gguf \\
        /tmp/bf16_synth/smollm2-1.7b-BF16.gguf --rounds 2 --before-repo /tmp/base

Per file and round: ours (this checkout), "ours-bf16x2" (the same with ``activation_dtype=
"bf16x2"``: AMX-BF16 tiles), "before" (``--before-repo``: another checkout of specdec
with its own built extension, e.g. the commit before the 16-bit kernels) and llama.cpp
(llama-cpp-python: 2 threads, n_batch 512, flash attention, in the user's environment without
the OMP_WAIT_POLICY specdec sets for itself).  Each child loads the file, then prefills a
``--prompt-tokens`` prompt of seeded random ids and decodes ``--decode-tokens`` greedy tokens
(EOS ignored); it reports load seconds, RSS after load, peak RSS (VmHWM: file-backed pages
included, so llama.cpp's mmap counts), prefill seconds (time to the first token) and decode
tokens/s (the tokens after the first).  This file imports nothing from specdec in the parent or
the llama.cpp child.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1e6  # GB
    return out


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def child_specdec(
    path: str, prompt: list[int], decode: int, threads: int, activation_dtype: str = "auto"
) -> dict:
    import specdec  # noqa: I001 (first: it sets its OpenMP environment before torch loads)
    import torch
    from specdec.engine.loading import describe_model

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = specdec.LLM(
        model=path, max_model_len=1024, enable_prefix_caching=False,
        activation_dtype=activation_dtype,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    after_load = _status()
    params = specdec.SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m = out.metrics
    ttft = m.first_token_time - m.arrival_time
    dec_s = m.finished_time - m.first_token_time
    return {
        "load_s": load_s,
        "rss_after_load_gb": after_load["VmRSS"],
        "prefill_s": ttft,
        "decode_tok_s": decode / dec_s,
        "tokens": list(out.outputs[0].token_ids),
        "weights": describe_model(llm.engine.model),
    }


def child_llama_cpp(path: str, prompt: list[int], decode: int, threads: int) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
        flash_attn=True, logits_all=False, verbose=False,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    after_load = _status()
    tokens: list[int] = []
    start = time.perf_counter()
    first = None
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if first is None:
            first = time.perf_counter()
        tokens.append(int(tok))
        if len(tokens) > decode:
            break
    end = time.perf_counter()
    return {
        "load_s": load_s,
        "rss_after_load_gb": after_load["VmRSS"],
        "prefill_s": first - start,
        "decode_tok_s": decode / (end - first),
        "tokens": tokens,
        "weights": "llama.cpp " + llama_cpp.__version__,
    }


def run_child(engine: str, path: str, args: argparse.Namespace, repo: Path | None) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)  # llama.cpp: its own default; specdec sets its own
    cwd = None
    if repo is not None:
        env["PYTHONPATH"] = str(repo)
        cwd = str(repo)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, path]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]
    cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before-repo", type=Path, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["ours", "before", "llama.cpp"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "FILE"))
    args = ap.parse_args()
    prompt = _prompt(args.prompt_tokens, 0)
    if args.child:
        engine, path = args.child
        if engine == "llama.cpp":
            res = child_llama_cpp(path, prompt, args.decode_tokens, args.threads)
        else:  # "specdec" or "specdec-<activation dtype>"
            act = engine.partition("-")[2] or "auto"
            res = child_specdec(path, prompt, args.decode_tokens, args.threads, act)
        res["peak_rss_gb"] = _status()["VmHWM"]
        print(json.dumps(res))
        return
    here = Path(__file__).resolve().parents[1]
    repos = {"ours": here, "ours-bf16x2": here, "before": args.before_repo, "llama.cpp": None}
    engines = [e for e in args.engines if e != "before" or args.before_repo is not None]
    results = []
    for rnd in range(args.rounds):
        for path in args.files:
            for engine in engines:
                load = os.getloadavg()[0]
                child = {"llama.cpp": "llama.cpp", "ours-bf16x2": "specdec-bf16x2"}.get(
                    engine, "specdec"
                )
                res = run_child(child, path, args, repos[engine])
                res.update(round=rnd, file=Path(path).name, engine=engine, loadavg=load)
                results.append(res)
                short = {k: v for k, v in res.items() if k != "tokens"}
                print(json.dumps(short), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    size = {p: Path(p).stat().st_size / 1e9 for p in args.files}
    print("\n| file | engine | load s | RSS after load GB | peak RSS GB (x file) | prefill s | "
          "decode tok/s |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for r in results:
        if "error" in r:
            print(f"| {r['file']} | {r['engine']} | error |")
            continue
        f = next(p for p in args.files if Path(p).name == r["file"])
        print(
            f"| {r['file']} | {r['engine']} | {r['load_s']:.1f} | {r['rss_after_load_gb']:.2f} | "
            f"{r['peak_rss_gb']:.2f} ({r['peak_rss_gb'] / size[f]:.2f}x) | {r['prefill_s']:.2f} | "
            f"{r['decode_tok_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
