"""Fixtures the offline drafter tests share."""

from __future__ import annotations

import pytest

from tests.fixtures.heads import LAYOUTS, write_eagle, write_eagle3, write_medusa, write_mtp_target


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """name -> (target folder, speculative_config)"""
    tmp = tmp_path_factory.mktemp("heads")
    out = {}
    for name, (method, layout) in LAYOUTS.items():
        cfg = {"method": method, "num_speculative_tokens": 3}
        target = str(tiny_llama)
        if method == "eagle":
            cfg["model"] = str(write_eagle(tmp / name, tiny_llama, layout))
        elif method == "eagle3":
            # a reduced draft vocabulary in one layout, the full one in the other
            vocab = 150 if layout == "safeailab" else 0
            cfg["model"] = str(write_eagle3(tmp / name, tiny_llama, layout, draft_vocab=vocab))
        elif method == "medusa":
            cfg["model"] = str(write_medusa(tmp / name, tiny_llama, layout))
        else:
            target = str(write_mtp_target(tmp / name, tiny_llama, layout))
        out[name] = (target, cfg)
    return out
