"""specdec bench replay end to end: drafts recorded on the real default model, replayed on a tiny
random-weight GGUF with the adaptive controller live."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.bench.replay import (
    RecordOptions,
    ReplayOptions,
    TraceFile,
    record,
    run_replay,
)

# hand-written for this test (no benchmark set): one that copies, one that does not
PROMPTS = [
    {"id": "copy", "category": "code_edit", "turns": [
        "Rename `n` to `count` and change nothing else:\n\ndef twice(n):\n    return n + n\n"]},
    {"id": "chat", "category": "chat", "turns": ["Name a good name for a grey cat."]},
]  # fmt: skip
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("replay")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    opts = RecordOptions(
        methods=("suffix", "ngram"), prompts=(str(prompts),), max_tokens=MAX_TOKENS
    )
    path = folder / "trace.json"
    record(opts).save(path)
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, mk) -> Path:
    folder = tmp_path_factory.mktemp("replay_gguf")
    return mk.write_gguf(folder / "tiny-Q4_0.gguf", mk.SHAPES["tiny"], "Q4_0", seed=1)


def _options(trace: Path, model: Path, **kw) -> ReplayOptions:
    return ReplayOptions(str(trace), str(model), ns=(1, 2), repeats=1, bandwidth_gib=0, **kw)


def test_recorded_trace_round_trips(trace_path: Path) -> None:
    tf = TraceFile.load(trace_path)
    assert set(tf.drafters) == {"suffix", "ngram"} and tf.step_ms > 0
    again = trace_path.with_name("again.json")
    tf.save(again)
    assert TraceFile.load(again) == tf
    for d in tf.drafters.values():
        assert [t.req_id for t in d.requests] == ["copy", "chat"]
        for t in d.requests:
            assert len(t.output_token_ids) == MAX_TOKENS
            assert len(t.draft_ms) == len(t.model_drafted) == len(t.steps)
            # every step's drafts are within the cap, accepted within the drafts, and the steps
            # follow each other: the next starts after the accepted ones and the bonus token
            for (p0, drafts, accepted), nxt in zip(t.steps, t.steps[1:]):
                assert 0 <= accepted <= drafts <= d.k
                assert nxt[0] == p0 + accepted + 1
    # the copying prompt has drafts accepted: a trace that records nothing would pass the rest
    copy = tf.drafters["suffix"].requests[0]
    assert sum(a for _, _, a in copy.steps) > 0


def test_replay_follows_the_recording(trace_path: Path, tiny_gguf: Path) -> None:
    result = run_replay(_options(trace_path, tiny_gguf))
    for name in ("suffix", "ngram"):
        v = result["verified"][name]
        assert v["num_drafted"] > 0
        # never beyond the k the controller allowed, nor beyond what the recording had right,
        # and exactly min(recorded right, drafts verified): the file's own tokens were proposed
        assert (v["over_k"], v["over_recorded"], v["mismatched"]) == (0, 0, 0)
    cells = {(r["drafter"], r["category"]) for r in result["rows"]}
    assert cells == {(d, c) for d in ("plain", "suffix", "ngram") for c in ("code_edit", "chat")}
    for r in result["rows"]:
        assert r["tokens"] == MAX_TOKENS - 1 and r["tok_s"] > 0  # one request, decode only


def test_zero_acceptance_stops_drafting(trace_path: Path, tiny_gguf: Path) -> None:
    """Drafts proposed at every position, never right: the controller must stop drafting
    (k = 0), so that the replay does no more work than plain beyond a few early rows."""
    tf = TraceFile.load(trace_path)
    ngram = tf.drafters["ngram"]
    tf.drafters = {"ngram": ngram}
    tf.max_tokens = 64
    for t in ngram.requests:
        t.steps = [(p, ngram.k, 0) for p in range(tf.max_tokens)]
        t.draft_ms, t.model_drafted = [0.01] * tf.max_tokens, [False] * tf.max_tokens
    path = trace_path.with_name("zero.json")
    tf.save(path)
    result = run_replay(_options(path, tiny_gguf))
    v = result["verified"]["ngram"]
    assert v["over_recorded"] == 0 and v["mismatched"] == 0
    steps = v["steps"]  # (position, k, drafts, accepted, recorded right)
    assert all(s[3] == 0 for s in steps)
    # after the first few steps of each request the controller chose k = 0 (no drafts verified)
    late = [s for s in steps if s[0] >= 16]
    assert late and sum(1 for s in late if s[2]) <= len(late) // 8
    # the table says the same: nothing accepted, and at most a few rows verified a request, far
    # below drafting k at every token (how fast that ran is the benchmark's to say)
    for r in (r for r in result["rows"] if r["drafter"] == "ngram"):
        assert r["drafts_accepted"] == 0
        assert r["drafts_verified"] <= r["tokens"] * ngram.k // 4, r


def test_a_trace_with_unknown_tokens_is_refused(trace_path: Path, tiny_gguf: Path) -> None:
    tf = TraceFile.load(trace_path)
    for d in tf.drafters.values():
        for t in d.requests:
            t.prompt_token_ids = [*t.prompt_token_ids, 10**7]
    path = trace_path.with_name("bad.json")
    tf.save(path)
    with pytest.raises(ValueError, match="vocabulary"):
        run_replay(_options(path, tiny_gguf))
