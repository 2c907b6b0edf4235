"""Tenants (``cache_salt``) share no drafter memory (issue 30): the membership probe. A tenant
repeating another tenant's prompt gets exactly the drafts, and so the acceptance figures, of a
fresh engine that never saw it; the same tenant, or unsalted requests among themselves, do get
the help of suffix decoding's global tree."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from tests.fixtures.server import _client, _start, _wait_idle

# NOTE: a fixed k: the adaptive controller prices drafts with timings measured on this machine,
# which would make a fresh run's figures differ from run to run.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False}
PROMPTS = {
    "tiny": "Once upon a time there was a small village in the mountains where",
    "smollm2-135m": "Write a short story about a robot who learns to paint.",
}


def _probe(llm: LLM, prompt: str, salt: str | None, max_tokens: int) -> tuple[dict, list[int]]:
    p = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([p], sp)[0]
    return out.spec_decode_stats.as_dict(), out.outputs[0].token_ids


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_membership_probe_sees_nothing_across_salts(tiny_llama, model: str) -> None:
    path = str(tiny_llama) if model == "tiny" else model
    prompt, n = PROMPTS[model], 64 if model == "tiny" else 96
    kw = {"speculative_config": SUFFIX, "max_model_len": 512, "max_num_seqs": 4}
    fresh, want = _probe(LLM(path, **kw), prompt, "b", n)
    llm = LLM(path, **kw)
    runs = {}
    for name, salt in (("a", "a"), ("b", "b"), ("a again", "a"), ("none", None), ("none again", None)):  # fmt: skip
        runs[name], ids = _probe(llm, prompt, salt, n)
        assert ids == want
    assert runs["a"] == fresh and runs["none"] == fresh
    assert runs["b"] == fresh  # another tenant: as if nobody had received this completion
    for repeat in ("a again", "none again"):  # the same tenant, and unsalted requests, share
        assert runs[repeat]["num_accepted_tokens"] > fresh["num_accepted_tokens"] + n // 4
        assert runs[repeat]["num_drafts"] < fresh["num_drafts"]


@pytest.fixture(scope="module")
def suffix_server(tiny_llama):
    srv = _start(str(tiny_llama), spec=SUFFIX)
    yield srv
    srv.stop()


def _complete(srv, salt: str | None, prompt: str = PROMPTS["tiny"]) -> tuple[dict, str]:
    extra = {"ignore_eos": True} | ({} if salt is None else {"cache_salt": salt})
    out = _client(srv).completions.create(
        model="tiny", prompt=prompt, max_tokens=48, temperature=0.0, extra_body=extra
    )
    return out.model_extra["spec_decode"], out.choices[0].text


def test_server_spec_decode_stats_show_nothing_across_salts(suffix_server) -> None:
    a, text = _complete(suffix_server, "tenant-a")
    b, b_text = _complete(suffix_server, "tenant-b")
    again, again_text = _complete(suffix_server, "tenant-a")
    assert b == a and b_text == text  # b's figures are those of a prompt nobody sent before
    assert again_text == text and again["num_accepted_tokens"] > a["num_accepted_tokens"] + 12
    _wait_idle(suffix_server)
