"""Token provenance alignment and the per-request figures (issue 35)."""

from __future__ import annotations

from specdec.entrypoints.openai.stats import ProvenanceAligner, acceptance_histogram, timings
from specdec.outputs import RequestMetrics, TokenProvenance
from specdec.spec_decode.metrics import SpecDecodeStats


def test_aligner_cuts_text_at_token_ends():
    a = ProvenanceAligner()
    # "ab" from a target token, then "cd|e" where the engine's delta ends inside a token
    text, spans = a.feed("abcd", [TokenProvenance(2, False), TokenProvenance(5, True)])
    assert (text, spans) == ("ab", [[2, 0]])
    text, spans = a.feed("e", [])
    assert (text, spans) == ("cde", [[3, 1]])


def test_aligner_lists_tokens_without_text():
    a = ProvenanceAligner()
    # three byte tokens write nothing until the fourth completes the character
    prov = [TokenProvenance(0, True), TokenProvenance(0, True), TokenProvenance(1, False)]
    assert a.feed("\U0001f600", prov) == ("\U0001f600", [[0, 1], [0, 1], [1, 0]])


def test_acceptance_histogram_from_per_position_counts():
    s = SpecDecodeStats()
    for accepted in (0, 3, 1, 3, 2):
        s.observe(3, accepted)
    assert acceptance_histogram(s, 3) == [1, 1, 1, 2]


def test_timings_draft_fields_only_when_drafted():
    m = RequestMetrics(arrival_time=1.0, first_token_time=1.5, finished_time=3.5)
    t = timings(10, 4, 20, [m], SpecDecodeStats())
    assert t["prompt_n"] == 6 and t["cache_n"] == 4 and "draft_n" not in t
    assert t["predicted_ms"] == 2000.0 and t["predicted_per_second"] == 10.0
    s = SpecDecodeStats()
    s.observe(4, 3)
    t = timings(10, 0, 20, [m], s)
    assert (t["draft_n"], t["draft_n_accepted"]) == (4, 3)
