"""Fixtures the kernel tests share: ``native`` (the native ops on each instruction set) and
``isa`` (the native attention on each instruction set)."""

from __future__ import annotations

import pytest

from specdec import kernels as K
from specdec.kernels import _C
from tests.fixtures.attention import _isas as _attention_isas
from tests.fixtures.kernels import _isas, _require_native


@pytest.fixture(params=_isas())
def native(request):
    """The native ops on each instruction set the CPU and build have."""
    _require_native()
    K.set_native_isa(request.param)
    try:
        yield K.get_ops("native")
    finally:
        K.set_native_isa("auto")


@pytest.fixture(params=_attention_isas())
def isa(request):
    """The native attention on each instruction set the CPU and build have (restored after)."""
    before = _C.isa()
    _C.set_isa(request.param)
    yield request.param
    _C.set_isa(before)
