"""``specdec serve smollm2-135m --ray --num-replicas 2`` on a local Ray (started once here).

The openai client against the ingress: greedy outputs equal a single server's; the same checks
before routing; a shared prefix and a session stick to one replica (SpecdecRequestRouter); an
engine replica killed by its PID under streamed load ends its streams with an error event and
[DONE] (non-streamed: 503 + Retry-After), new requests are answered, Ray brings the replica back;
SIGTERM leaves no Ray or engine process.
"""

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.fixtures.replicas import MODEL, PREFIX, PROMPTS
from tests.fixtures.server import process_tree, serve

pytest.importorskip("ray.serve")


def _engine_pids(root: int) -> list[int]:
    return [p.pid for p in psutil.Process(root).children(recursive=True) if "SpecdecEngine" in " ".join(p.cmdline())]  # fmt: skip


@pytest.fixture(scope="module")
def ray_app():
    """The Ray app, answering on both replicas; the driver's tree killed by PID afterwards
    (``watch_tree`` notes a restarted replica)."""
    with serve(
        MODEL, "--ray", "--num-replicas", "2", "--max-model-len", "1024", "--shutdown-timeout",
        "2", env={"RAY_USAGE_STATS_ENABLED": "0"}, timeout=240, ready=_ready, grace=0,
    ) as srv:  # fmt: skip
        url = srv.url
        # NOTE: the ingress learns of the second replica a little after the app is ready
        seen: set[str] = set()
        for i in range(400):
            seen.add(_complete(url, "hi", f"w{i}", max_tokens=1).headers["x-specdec-replica"])
            if len(seen) == 2:
                break
            time.sleep(0.2)
        assert len(seen) == 2, "the ingress never routed to both replicas"
        srv.watch_tree()
        yield srv


def _ready(url: str) -> bool:
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _complete(url: str, prompt: str, session: str | None = None, **kw) -> httpx.Response:
    headers = {"x-session-id": session} if session else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0} | kw
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def test_greedy_equals_single_server(ray_app, single):  # noqa: F811
    url = ray_app.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    one = openai.OpenAI(base_url=f"{single.url}/v1", api_key="x", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        b = one.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert a.choices[0].text == b.choices[0].text
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[-1], max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == b.choices[0].text
    resp = _complete(url, "x", max_tokens=-1)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_prefix_and_session_affinity(ray_app):
    url = ray_app.url
    served = {_complete(url, PREFIX + f"Question {i}?").headers["x-specdec-replica"] for i in range(4)}  # fmt: skip
    assert len(served) == 1
    for session in ("alice", "bob"):
        served = {_complete(url, f"turn {t}", session).headers["x-specdec-replica"] for t in range(3)}  # fmt: skip
        assert len(served) == 1


def test_responses_stay_with_their_tenant(ray_app):
    """/v1/responses through the ingress: a follow-up, GET and DELETE find the stored response
    (every call on the caller's replica); another client's GET of it is a 404."""
    url = ray_app.url
    mine, theirs = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    body = {"model": MODEL, "input": "My name is Ada.", "max_output_tokens": 4, "temperature": 0}
    first = httpx.post(f"{url}/v1/responses", json=body, headers=mine, timeout=120)
    assert first.status_code == 200, first.text[:300]
    rid, home = first.json()["id"], first.headers["x-specdec-replica"]
    body = {**body, "input": "What is my name?", "previous_response_id": rid}
    later = httpx.post(f"{url}/v1/responses", json=body, headers=mine, timeout=120)
    assert later.status_code == 200 and later.headers["x-specdec-replica"] == home
    assert later.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]
    with httpx.stream(
        "POST", f"{url}/v1/responses", json={**body, "stream": True}, headers=mine, timeout=120
    ) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and r.headers["x-specdec-replica"] == home
    assert json.loads(lines[-1][6:])["type"] in ("response.completed", "response.incomplete")
    got = httpx.get(f"{url}/v1/responses/{rid}", headers=mine, timeout=60)
    assert got.status_code == 200 and got.headers["x-specdec-replica"] == home
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=theirs, timeout=60).status_code == 404
    assert httpx.delete(f"{url}/v1/responses/{rid}", headers=mine, timeout=60).status_code == 200
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=mine, timeout=60).status_code == 404


def test_ingress_metrics_merge_every_replica(ray_app):
    """GET /metrics on the ingress: each replica's engine series with its replica label (the
    id x-specdec-replica names), one TYPE per family, the dashboard's series for both."""
    url = ray_app.url
    homes = {_complete(url, "hi", f"m{i}", max_tokens=2).headers["x-specdec-replica"] for i in range(16)}  # fmt: skip
    assert len(homes) == 2
    resp = httpx.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert text.count("# TYPE vllm:time_to_first_token_seconds histogram") == 1
    dashboard = json.loads((Path(__file__).parents[3] / "docs/grafana/specdec_dashboard.json").read_text())  # fmt: skip
    names = {n for p in dashboard["panels"] for t in p["targets"] for n in re.findall(r"(vllm:[a-z0-9_]+)", t["expr"])}  # fmt: skip
    names -= {n for n in names if n.startswith("vllm:spec_decode")}  # NOTE: speculation is off
    for replica in homes:
        for name in names:
            assert re.search(rf'^{name}{{replica="{replica}"', text, re.M), (name, replica)
        assert f'specdec:replica_up{{replica="{replica}"}} 1' in text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples and all('replica="' in line for line in samples)


def _stream(url: str, prompt: str, out: list, session: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"x-session-id": session}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as resp:  # fmt: skip
        out.append(resp.headers.get("x-specdec-replica"))
        out.extend(line[6:] for line in resp.iter_lines() if line.startswith("data: "))


def test_replica_killed_under_streamed_load(ray_app):
    proc, url = ray_app.proc, ray_app.url
    before = _engine_pids(proc.pid)
    assert len(before) == 2
    homes: dict[str, str] = {}  # a session per replica, so that the load is on both
    for i in range(16):
        homes.setdefault(_complete(url, "hi", f"k{i}", max_tokens=1).headers["x-specdec-replica"], f"k{i}")  # fmt: skip
    assert len(homes) == 2
    sessions = [*homes.values(), *homes.values()]
    streams = [[] for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(url, f"Story {i}: once upon a time", s, sessions[i])) for i, s in enumerate(streams)]  # fmt: skip
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(len(s) > 2 for s in streams) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len({s[0] for s in streams}) == 2  # the load is on both replicas
    os.kill(before[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert all(s[-1] == "[DONE]" for s in streams)
    broken = {s[0] for s in streams if "error" in json.loads(s[-2])}
    assert len(broken) == 1  # the killed replica's streams, and only those
    for s in streams:
        if s[0] in broken:
            assert json.loads(s[-2])["error"]["type"] == "service_unavailable"
    assert _complete(url, "Hello").status_code == 200
    deadline = time.monotonic() + 120
    while len(_engine_pids(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    after = _engine_pids(proc.pid)
    assert len(after) == 2 and before[0] not in after
    ray_app.watch_tree()


def test_sigterm_leaves_no_process(ray_app):
    proc = ray_app.proc
    tree = process_tree(proc.pid)
    ray_app.watch_tree()
    proc.send_signal(signal.SIGTERM)
    proc.wait(90)
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in tree if psutil.pid_exists(p)]
    assert not left, [psutil.Process(p).name() for p in left if psutil.pid_exists(p)]
