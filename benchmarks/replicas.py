"""Replica benchmarks (issue 32): throughput, warm drafters, Ray start-up.

    # 16 clients, mixed prompts: 2 replicas x 1 thread against 1 replica x 2 threads
    python benchmarks/replicas.py throughput --model smollm2-135m --clients 16 --requests 64
    # 8 conversations x 5 turns, interleaved, suffix decoding: session routing against round robin
    python benchmarks/replicas.py agent --model smollm2-135m --conversations 8 --turns 5
    # a 2-replica Ray app: seconds from the command to its first answer
    python benchmarks/replicas.py startup --model smollm2-135m

Each run starts its servers (``specdec serve`` subprocesses), bounded in time and stopped by
PID, prints one JSON line per configuration, then a Markdown table. Needs a quiet machine for
figures worth keeping. A smoke run (about a minute each, mostly server start-up):

    python benchmarks/replicas.py throughput --clients 4 --requests 4 --max-tokens 8 --max-model-len 512
    python benchmarks/replicas.py agent --conversations 2 --turns 2 --max-tokens 8 --max-model-len 512
    python benchmarks/replicas.py startup --max-model-len 512
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPTS = Path(__file__).parents[1] / "specdec" / "bench" / "prompts" / "default.jsonl"
SUFFIX = json.dumps({"method": "suffix", "num_speculative_tokens": 8})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``specdec serve MODEL *flags`` on a free port, until ``stop`` (SIGTERM, then SIGKILL)."""

    def __init__(self, model: str, flags: list[str], timeout: float = 300.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specdec.cli", "serve", model,
               "--port", str(self.port), "--uvicorn-log-level", "warning", *flags]  # fmt: skip
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = self.started + timeout
        while not self._answers(model):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {' '.join(flags)}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - self.started

    def _answers(self, model: str) -> bool:
        try:
            body = {"model": model, "prompt": "hi", "max_tokens": 1}
            return (
                httpx.post(f"{self.url}/v1/completions", json=body, timeout=10).status_code == 200
            )
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    turns = [r["turns"][0] for r in rows]
    return [turns[i % len(turns)] for i in range(n)]


def _stream_one(url: str, model: str, prompt: str, max_tokens: int, out: list) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start, ttft, tokens = time.monotonic(), None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            out.append((None, 0))  # NOTE: a failed request: counted, kept out of the TTFTs
            return
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if (
                ttft is None
                and chunk.get("choices")
                and chunk["choices"][0]["delta"].get("content")
            ):
                ttft = time.monotonic() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    out.append((ttft if ttft is not None else 0.0, tokens))


def _load(url: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """``clients`` threads pulling prompts off one queue; output tok/s and TTFT percentiles."""
    queue, results, lock = list(prompts), [], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            _stream_one(url, model, prompt, max_tokens, results)

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    ttfts = sorted(r[0] for r in results if r[0] is not None) or [float("nan")]
    pick = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]  # noqa: E731
    return {
        "requests": len(results), "failed": sum(r[0] is None for r in results), "output_tok_s": round(sum(r[1] for r in results) / wall, 2),
        "ttft_p50_s": round(pick(0.5), 3), "ttft_p99_s": round(pick(0.99), 3), "wall_s": round(wall, 1),
    }  # fmt: skip


def throughput(args: argparse.Namespace) -> None:
    prompts = _prompts(args.requests)
    common = ["--max-model-len", str(args.max_model_len)]
    rows = []
    for name, flags in (
        ("2 replicas x 1 thread", ["--data-parallel-size", "2", "--threads", "1"]),
        ("1 replica x 2 threads", ["--threads", "2"]),
    ):
        srv = Server(args.model, common + flags)
        try:
            row = _load(srv.url, args.model, prompts, args.clients, args.max_tokens)
        finally:
            srv.stop()
        rows.append({"config": name, "clients": args.clients, **row})
        print(json.dumps(rows[-1]), flush=True)
    print(_table(rows))


def _conversation_turn(url: str, model: str, session: str, history: list, max_tokens: int, stats: dict, lock: threading.Lock) -> None:  # fmt: skip
    body = {"model": model, "messages": history, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=600)  # fmt: skip
    if resp.status_code != 200:
        with lock:
            stats["failed"] += 1
        history.append({"role": "assistant", "content": ""})
        return
    data = resp.json()
    history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    spec = data.get("spec_decode") or {}
    cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    with lock:
        homes = stats["homes"].setdefault(session, [])
        homes.append(resp.headers.get("x-specdec-replica"))
        stats["moves"] += len(homes) > 1 and homes[-1] != homes[-2]
        stats["cached"] += cached
        stats["prompt"] += data["usage"]["prompt_tokens"]
        stats["tokens"] += data["usage"]["completion_tokens"]
        stats["drafts"] += spec.get("num_drafts", 0)
        stats["accepted"] += spec.get("num_accepted_tokens", 0)


def agent(args: argparse.Namespace) -> None:
    """Each conversation continues for ``turns`` turns; all conversations' turns interleave."""
    seeds = _prompts(args.conversations)
    followups = ["Now do the same again, exactly as before.", "Repeat your answer, unchanged.",
                 "Say it once more, word for word.", "Again, please, the same way."]  # fmt: skip
    common = ["--max-model-len", str(args.max_model_len), "--speculative-config", SUFFIX,
              "--data-parallel-size", "2", "--threads", "1"]  # fmt: skip
    rows = []
    for policy in ("affinity", "round_robin"):
        srv = Server(args.model, common + ["--replica-routing", policy])
        stats: dict = {"tokens": 0, "drafts": 0, "accepted": 0, "failed": 0, "moves": 0,
                       "cached": 0, "prompt": 0, "homes": {}}  # fmt: skip
        lock = threading.Lock()
        histories = [[{"role": "user", "content": p}] for p in seeds]
        start = time.monotonic()
        try:
            for turn in range(args.turns):
                # NOTE: a new arrival order each turn (the same for both policies): in a fixed
                # order an even count of conversations would make round robin sticky by accident
                order = random.Random(turn).sample(range(len(histories)), len(histories))
                threads = [threading.Thread(target=_conversation_turn, args=(srv.url, args.model, f"conv-{i}", histories[i], args.max_tokens, stats, lock)) for i in order]  # fmt: skip
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                for h in histories:
                    h.append({"role": "user", "content": followups[turn % len(followups)]})
        finally:
            srv.stop()
        wall = time.monotonic() - start
        mal = 1 + stats["accepted"] / stats["drafts"] if stats["drafts"] else 1.0
        rows.append({"routing": policy, "mean_acceptance_length": round(mal, 3),
                     "output_tok_s": round(stats["tokens"] / wall, 2), "replica_moves": stats["moves"],
                     "prefix_cache_hit": round(stats["cached"] / max(stats["prompt"], 1), 3),
                     "failed": stats["failed"], "wall_s": round(wall, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(_table(rows))


def startup(args: argparse.Namespace) -> None:
    srv = Server(args.model, ["--ray", "--num-replicas", "2", "--max-model-len", str(args.max_model_len)], timeout=600)  # fmt: skip
    srv.stop()
    row = {"config": "ray, 2 replicas", "command_to_first_answer_s": round(srv.ready_s, 1)}
    print(json.dumps(row), flush=True)
    print(_table([row]))


def _table(rows: list[dict]) -> str:
    """The rows as a Markdown table (the columns of the first row)."""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("mode", choices=["throughput", "agent", "startup"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    {"throughput": throughput, "agent": agent, "startup": startup}[args.mode](args)


if __name__ == "__main__":
    main()
