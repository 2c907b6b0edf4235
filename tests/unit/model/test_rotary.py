"""Rotary tables (specdec/model/layers.py Rotary): on the CPU they cover the positions read so
far, grown on demand, and every row is bit for bit the row of a table built whole."""

from __future__ import annotations

import torch

from specdec.model.layers import Rotary, rope_inv_freq


def test_tables_grow_with_the_positions_read_and_match_whole_tables() -> None:
    for head_dim, theta in ((64, 10000.0), (128, 1e6), (256, 10000.0)):
        inv = rope_inv_freq(head_dim, theta, None, None)
        whole_cos, whole_sin = Rotary(inv, 5000, torch.float32, "cpu")._tables(5000)
        rot = Rotary(inv, 5000, torch.float32, "cpu")
        assert rot._cos.shape == (Rotary.FIRST_ROWS, head_dim)  # not max_len rows up front
        for positions in ([0, 1, 2], [17], [1023], [1024, 1025], [3000], [4999]):
            pos = torch.tensor(positions)
            cos, sin = rot.at(pos)
            assert torch.equal(cos, whole_cos[pos]) and torch.equal(sin, whole_sin[pos])
            assert max(positions) < rot._cos.shape[0] <= 5000
        assert rot._cos.shape[0] == 5000  # never past max_len
        fresh = Rotary(inv, 5000, torch.float32, "cpu")
        cos, _ = fresh.at(torch.tensor([3]), end=2500)  # the caller's end covers the table
        assert fresh._cos.shape[0] >= 2500 and torch.equal(cos, whole_cos[[3]])
        x = torch.randn(3, 2, head_dim)
        pos = torch.tensor([5, 2047, 4000])
        half = head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        want = x * whole_cos[pos].unsqueeze(1) + rotated * whole_sin[pos].unsqueeze(1)
        assert torch.equal(rot(x, pos), want)


def test_whole_tables_through_cos_and_sin() -> None:
    # What takes the tables whole (an EAGLE-3 head's native step) gets every position.
    rot = Rotary(rope_inv_freq(64, 10000.0, None, None), 3000, torch.float32, "cpu")
    assert rot.cos.shape == rot.sin.shape == (3000, 64)
    assert torch.equal(rot.cos, rot._tables(3000)[0])
