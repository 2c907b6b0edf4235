"""What one costly request does to another's per-token latency (issue 30, item 4), against a live
server (``specdec serve smollm2-135m ...`` on ``--url``).

A victim streams a chat completion (temperature 0, ``--victim-tokens`` tokens) alone ("idle"),
then beside each attacker: ``bad_words`` (256 phrases of about ``--word-tokens`` tokens),
``prompt_logprobs`` (20 on a ~3,800-token prompt), ``plain_prompt`` (a prompt as long, without
prompt_logprobs: what any long prompt costs), ``regex_stop`` (regex-looking stop strings: stop
strings are plain text) and ``guided_regex`` (a lazily failing structured-output regex). Per
case: the victim's mean and p90 gap between streamed tokens, the longest gap, and the
attacker's status and wall time. Attackers carry a fresh ``cache_salt`` (no prefix-cache hits).

    .venv/bin/python benchmarks/request_budgets.py --url http://127.0.0.1:8011 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import uuid

import httpx

VICTIM = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def _victim(url: str, max_tokens: int, out: dict) -> None:
    body = {"messages": VICTIM, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    stamps = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                stamps.append(time.perf_counter())
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    out["victim"] = {
        "tokens": len(stamps),
        "mean_ms": round(1e3 * statistics.mean(gaps), 1),
        "p90_ms": round(1e3 * gaps[int(0.9 * len(gaps))], 1),
        "max_ms": round(1e3 * gaps[-1], 1),
    }


def _words(n: int, num_tokens: int) -> list[str]:
    """``n`` distinct phrases of about ``num_tokens`` tokens (common words, one token each)."""
    rng = random.Random(0)
    common = ("the of and to in is was for on that with as at by from his her they this had "
              "house water light keeper story night ship sea storm lamp tower").split()  # fmt: skip
    return [" ".join(rng.choice(common) for _ in range(num_tokens)) for _ in range(n)]


def _attacks(word_tokens: int) -> dict[str, dict]:
    long_prompt = " ".join(f"item {i} is {i * 7 % 13} apples;" for i in range(380))
    base = {"temperature": 0, "max_tokens": 64, "ignore_eos": True}
    return {
        "bad_words": {**base, "messages": VICTIM, "bad_words": _words(256, word_tokens)},
        "prompt_logprobs": {**base, "prompt": long_prompt, "prompt_logprobs": 20},
        "plain_prompt": {**base, "prompt": long_prompt},
        "regex_stop": {**base, "messages": VICTIM, "stop": ["a{1000000}", "(a|b)*c" * 500]},
        "guided_regex": {**base, "messages": VICTIM, "guided_regex": "a{1000000}"},
    }


def _attack(url: str, body: dict, out: dict) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    t = time.perf_counter()
    body = {**body, "cache_salt": uuid.uuid4().hex}
    r = httpx.post(f"{url}{path}", json=body, timeout=600)
    out["attacker"] = {"status": r.status_code, "wall_s": round(time.perf_counter() - t, 2)}
    if r.status_code != 200:
        out["attacker"]["error"] = r.text[:200]


def run_case(url: str, name: str, body: dict | None, victim_tokens: int, delay: float) -> dict:
    out: dict = {"case": name}
    threads = [threading.Thread(target=_victim, args=(url, victim_tokens, out))]
    threads[0].start()
    if body is not None:
        time.sleep(delay)  # the victim is streaming when the attacker arrives
        threads.append(threading.Thread(target=_attack, args=(url, body, out)))
        threads[1].start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8011")
    ap.add_argument("--victim-tokens", type=int, default=200)
    ap.add_argument("--word-tokens", type=int, default=120)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--delay", type=float, default=0.5)
    ap.add_argument("--cases", default="idle,bad_words,prompt_logprobs,plain_prompt,guided_regex")
    args = ap.parse_args()
    attacks = {"idle": None, **_attacks(args.word_tokens)}
    run_case(args.url, "warm-up", None, 16, 0)
    for _ in range(args.repeat):
        for name in args.cases.split(","):
            print(json.dumps(run_case(args.url, name, attacks[name], args.victim_tokens,
                                      args.delay)), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
