"""specdec bench replay's trace: round trips through JSON, windows, and what a cost curve
allows on it (``bounds``)."""

from __future__ import annotations

from specdec.bench.replay import DrafterTrace, Trace, TraceFile, bounds


def test_trace_file_round_trips(tmp_path) -> None:
    t = Trace([5, 6], [(0, 3, 2), (3, 0, 0)], [7, 8, 9, 10], "r0", "code_edit", [0.5, 0.0],
              [True, False])  # fmt: skip
    tf = TraceFile("smollm2-135m", 4, 9.5, {"eagle3": DrafterTrace("eagle3", 5, False, False, [t])})
    path = tmp_path / "trace.json"
    tf.save(path)
    back = TraceFile.load(path)
    assert back == tf
    assert back.drafters["eagle3"].model_drafter
    back.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()


def test_windows_cover_each_position_a_step_reaches() -> None:
    # two drafts right of three at 0, then nothing proposed at 3
    t = Trace([1], [(0, 3, 2), (3, 0, 0)])
    assert t.window_steps() == {0: (2, 3, 0), 1: (1, 2, 0), 2: (0, 1, 0), 3: (0, 0, 1)}
    assert t.windows()[1] == (1, 2)


def test_hindsight_and_whole_proposals() -> None:
    curve = [10.0, 12.0, 14.0]  # a forward over 1, 2, 3 rows
    # two drafts at position 0, both right: either way one 3-row step, then one 1-row step
    right = Trace([1], [(0, 2, 2)])
    assert bounds([right], curve, 8, 4) == {"hindsight": 40 / 24, "whole": 40 / 24}
    # two drafts, none right: hindsight drafts nothing; whole pays the 3-row step for 1 token
    wrong = Trace([1], [(0, 2, 0)])
    assert bounds([wrong], curve, 8, 2) == {"hindsight": 1.0, "whole": 20 / 24}
    # the cap cuts what is verified whole; where drafting loses, hindsight does not draft
    assert bounds([right], curve, 1, 4)["whole"] == 40 / (12 + 10 + 10)  # its step ends at 2
    assert bounds([right], [10.0, 30.0, 40.0], 8, 4)["hindsight"] == 1.0


def test_a_hybrid_head_step_is_priced_at_the_replay_files_costs() -> None:
    """hybrid prices its head at the target's costs: a recorded head step is taken where the
    head is cheap beside a forward and dropped where it is dear; its rates learn from what the
    verification accepted; suffix decoding's steps are never re-priced."""
    from specdec.bench.replay import ReplayDrafter
    from specdec.spec_decode.controller import CostModel

    # step 0: the head drafted 3 (1 right, 2 ms); step 1: suffix decoding drafted 4 (all right)
    t = Trace([1, 2], [(0, 3, 1), (2, 4, 4)], [5, 6, 7, 8, 9, 10, 11], "r", "chat",
              [2.0, 0.1], [True, False])  # fmt: skip
    trace = DrafterTrace("hybrid", 5, True, True, [t])
    curve = CostModel([100.0, 102.0, 104.0, 106.0, 108.0])
    cheap = ReplayDrafter(trace, 100, model_scale=1.0)  # 0.67 ms a draft beside 100 ms steps
    cheap.cost_model = curve
    dear = ReplayDrafter(trace, 100, model_scale=100.0)  # 67 ms a draft
    dear.cost_model = curve
    assert cheap._head_drafts(t, 0, 3) > 0
    assert dear._head_drafts(t, 0, 3) == 0
    for d in (cheap, dear):
        d.plan(t, [5, 6, 7, 8, 9, 10, 11])
    before = list(cheap.head_rates)
    cheap.note_verified([1, 2], 0, 3, 0)  # the head's first draft rejected
    assert cheap.head_rates[0] < before[0] and cheap.head_rates[1:] == before[1:]
    cheap.note_verified([1, 2], 2, 4, 4)  # a suffix step teaches the head nothing
    assert cheap.head_rates[0] < before[0] and cheap.head_rates[1:] == before[1:]
    # without a model drafter inside (suffix decoding alone) nothing is re-priced
    suffix = ReplayDrafter(
        DrafterTrace("suffix", 5, True, True, [Trace([1], [(0, 2, 2)])]), 100, 1.0
    )
    assert suffix.head_rates is None
