"""benchmarks/moe_trace.py's bounds: what a cost curve allows on a recorded trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def mt():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_trace.py"
    spec = importlib.util.spec_from_file_location("moe_trace", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_hindsight_and_whole_proposals(mt) -> None:
    curve = [10.0, 12.0, 14.0]  # a forward over 1, 2, 3 rows
    # two drafts at position 0, both right: either way one 3-row step, then one 1-row step
    right = mt.Trace([1], [(0, 2, 2)])
    assert mt.bounds([right], curve, 8, 4) == {"hindsight": 40 / 24, "whole": 40 / 24}
    # two drafts, none right: hindsight drafts nothing; whole pays the 3-row step for 1 token
    wrong = mt.Trace([1], [(0, 2, 0)])
    assert mt.bounds([wrong], curve, 8, 2) == {"hindsight": 1.0, "whole": 20 / 24}
    # the cap cuts what is verified whole; where drafting loses, hindsight does not draft
    assert mt.bounds([right], curve, 1, 4)["whole"] == 40 / (12 + 10 + 10)  # its step ends at 2
    assert mt.bounds([right], [10.0, 30.0, 40.0], 8, 4)["hindsight"] == 1.0
