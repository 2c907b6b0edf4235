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
