"""Our GGUF header reader against `gguf.GGUFReader`: the same metadata values and types, the
same tensors (names, types, shapes, bytes), on a file with every value type and on the real
SmolLM2 file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specdec.model.gguf_file import GGUFFile
from specdec.model.registry import resolve_model_path


def _same_as_library(path) -> None:
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(meta)
    for key, value in meta.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data) and not a.data.flags.writeable


def test_every_value_type_and_tensor_layout(tmp_path) -> None:
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("a.u8", 7)
    w.add_int8("a.i8", -7)
    w.add_uint16("a.u16", 60000)
    w.add_int16("a.i16", -30000)
    w.add_uint32("a.u32", 4_000_000_000)
    w.add_int32("a.i32", -2_000_000_000)
    w.add_float32("a.f32", 0.1)
    w.add_uint64("a.u64", 2**63)
    w.add_int64("a.i64", -(2**62))
    w.add_float64("a.f64", 1e-300)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo ✓")
    w.add_array("a.strs", ["x", "", "ÿ" * 3])
    w.add_array("a.ints", [1, -2, 3])
    w.add_array("a.floats", [0.5, -1.25])
    w.add_array("a.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    q8 = gguf.quantize(
        rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_library(path)


def test_real_smollm2_file() -> None:
    _same_as_library(resolve_model_path("smollm2-135m"))


def test_not_a_gguf_file(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)
