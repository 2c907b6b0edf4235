"""Importing specdec: the OpenMP wait policy it depends on."""

from __future__ import annotations

import os
import subprocess
import sys


def _stderr(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return proc.stderr


def test_torch_imported_first_warns_about_openmp_spinning() -> None:
    assert "OMP_WAIT_POLICY=PASSIVE" in _stderr("import torch; import specdec")
    # specdec first sets the policy before torch loads its OpenMP runtime: nothing to say
    code = "import specdec, os, torch; assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE'"
    assert "OMP_WAIT_POLICY" not in _stderr(code)
