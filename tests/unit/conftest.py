"""Fixtures the kernel tests share."""

from __future__ import annotations

import pytest

from specdec import kernels as K

from .test_kernels import _isas, _require_native


@pytest.fixture(params=_isas())
def native(request):
    """The native ops on each instruction set the CPU and build have."""
    _require_native()
    K.set_native_isa(request.param)
    try:
        yield K.get_ops("native")
    finally:
        K.set_native_isa("auto")
