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


def test_a_file_is_freed_without_a_collection() -> None:
    """No reference cycle: dropping the last reference unmaps the file and frees its metadata at
    once (a cycle through ``parts`` held both until the next full collection)."""
    import gc
    import weakref

    from specdec.model.gguf_file import read_gguf

    gc.disable()
    try:
        f = read_gguf(resolve_model_path("smollm2-135m"))
        assert f.parts == [f]
        gone = weakref.ref(f)
        del f
        assert gone() is None
    finally:
        gc.enable()


def test_not_a_gguf_file(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)


@pytest.fixture(scope="module")
def split_smollm2(tmp_path_factory):
    """The real SmolLM2 file split in three parts, as gguf-split writes them."""
    from tests.fixtures.gguf_split import write_split_gguf

    src = resolve_model_path("smollm2-135m")
    return src, write_split_gguf(src, tmp_path_factory.mktemp("split"), "smol", max_tensors=100)


def test_a_split_model_reads_as_the_whole_file(split_smollm2) -> None:
    from specdec.model.gguf_file import read_gguf, split_parts

    src, parts = split_smollm2
    assert [p.name for p in parts] == [f"smol-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split_parts(parts[1]) == parts and split_parts(src) == [src]
    whole, split = read_gguf(src), read_gguf(parts[0])
    assert len(split.parts) == 3 and split.metadata["split.count"] == 3
    for key, value in whole.metadata.items():
        assert split.metadata[key] == value, key
    assert [t.name for t in split.tensors] == [t.name for t in whole.tensors]
    for a, b in zip(split.tensors, whole.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data)


def test_a_split_model_with_a_part_missing_or_read_from_its_middle(split_smollm2, tmp_path) -> None:
    import shutil

    from specdec.model.gguf_file import read_gguf

    _, parts = split_smollm2
    with pytest.raises(ValueError, match="part 2 of a split model: load its first part"):
        read_gguf(parts[1])
    for p in parts[:2]:
        shutil.copy(p, tmp_path / p.name)
    with pytest.raises(ValueError, match="part 3 of 3 of this split model is missing"):
        read_gguf(tmp_path / parts[0].name)
    renamed = tmp_path / "other.gguf"
    shutil.copy(parts[0], renamed)
    with pytest.raises(ValueError, match="does not say where the others are"):
        read_gguf(renamed)


def test_a_split_model_generates_as_the_whole_file(split_smollm2, monkeypatch) -> None:
    from specdec import LLM, SamplingParams

    monkeypatch.setenv("SPECDEC_WEIGHT_CACHE", "off")
    src, parts = split_smollm2
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [
        LLM(str(path), max_model_len=128).generate(["The capital of France is"], sp, use_tqdm=False)
        for path in (src, parts[0])
    ]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
