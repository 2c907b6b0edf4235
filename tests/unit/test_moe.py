"""The MoE layer's elementwise helpers give a row the same bits whatever the rows beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.model.moe import _sigmoid_rows, _silu_mul


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # NOTE: thread chunks that start mid-row are what breaks plain SiLU
    yield
    torch.set_num_threads(saved)


def test_silu_mul_is_row_invariant(two_threads) -> None:
    # 4,075 rows of 40: plain F.silu(gate) * up gives one row other bits (2 threads, AVX2)
    gate_up = torch.randn(4075, 80, generator=torch.Generator().manual_seed(2)) * 6
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    alone = torch.cat([F.silu(gate[i : i + 1]) * up[i : i + 1] for i in range(len(gate))])
    assert torch.equal(_silu_mul(gate, up), alone)


def test_sigmoid_rows_is_row_invariant() -> None:
    # a contiguous [T, 1] column: plain torch.sigmoid puts rows on vector or scalar lanes
    x = torch.randn(5001, 1, generator=torch.Generator().manual_seed(0)) * 6
    alone = torch.cat([_sigmoid_rows(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(_sigmoid_rows(x), alone)
    assert torch.allclose(alone, torch.sigmoid(x))
