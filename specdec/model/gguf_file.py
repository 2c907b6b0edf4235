"""GGUF files: metadata as plain Python values and tensors as views of a memory map.

A model split by llama.cpp's ``gguf-split`` (or gguf-py's writer) is read from its first part,
``name-00001-of-0000N.gguf``: the metadata is the first part's, the tensors every part's, in
order (``split.count`` parts, ``split.tensors.count`` tensors in all).

NOTE: `gguf.GGUFReader` builds a numpy view for every part of every field: reading a
tokenizer's 49k tokens and 48k merges took 7 s of a 21 s load of SmolLM2-1.7B (147k fields
parts, ~1M memmap slices). This reads the header with ``struct`` from one memory map (~0.1 s)
and keeps `gguf` for its constants and block sizes; big-endian files go to GGUFReader.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_TYPED = {QT.F32: np.float32, QT.F16: np.float16, QT.F64: np.float64, QT.I8: np.int8,
          QT.I16: np.int16, QT.I32: np.int32, QT.I64: np.int64}  # fmt: skip


@dataclass
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # dims in GGUF's order (fastest first), as GGUFReader gives them
    data: np.ndarray  # read-only view of the file: typed for float / int types, else bytes


class GGUFFile:
    """A GGUF file's metadata (``metadata``: key -> str, int, float, bool or list) and tensors
    (``tensors``, in file order), read like `gguf.GGUFReader` reads them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        # A split model's other parts (read_gguf), kept open. NOTE: not a list holding self too:
        # that cycle kept the file's map (its pages read so far) and the metadata (a vocabulary's
        # strings) until the next full collection, +84 MB after loading Gemma 3 270M once its
        # tokenizer no longer allocated enough to trigger one.
        self._others: list[GGUFFile] = []
        with open(self.path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = buf
        if buf[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        version = struct.unpack_from("<I", buf, 4)[0]
        if version & 0xFFFF == 0:  # a big-endian file: the library knows how
            self._from_reader()
            return
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported")
        num_tensors, num_kv = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(struct.unpack_from("<I", buf, self._next(4))[0])
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = struct.unpack_from("<I", buf, self._next(4))
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._next(8 * n_dims))
            raw_type, offset = struct.unpack_from("<IQ", buf, self._next(12))
            infos.append((name, dims, QT(raw_type), offset))
        align = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: general.alignment {align} is not a power of two")
        start = -(-self._pos // align) * align
        # NOTE: tensors are views of a numpy memmap (RawTensor.populate_pages / release_pages
        # advise the kernel on exactly those)
        whole = np.memmap(self.path, dtype=np.uint8, mode="r")
        seen: set[str] = set()
        for name, dims, qtype, offset in infos:
            if name in seen:
                raise ValueError(f"{self.path}: tensor {name} appears twice")
            seen.add(name)
            n_elems = int(np.prod(dims)) if dims else 1
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = n_elems * type_size // block
            begin = start + offset
            raw = whole[begin : begin + n_bytes]
            if raw.size != n_bytes:
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            np_dims = tuple(reversed(dims))
            if qtype in _TYPED:
                data = raw.view(_TYPED[qtype]).reshape(np_dims)
            else:
                data = raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), data))

    @property
    def parts(self) -> list[GGUFFile]:
        """The split model's parts, this one first (just this one for a whole file)."""
        return [self, *self._others]

    def _next(self, n: int) -> int:
        pos = self._pos
        self._pos += n
        return pos

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._next(8))
        return self._buf[self._next(n) : self._pos].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._buf, self._next(12))
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[etype])
            arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
            self._pos += dtype.itemsize * count
            return arr.tolist()
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, self._buf, self._next(struct.calcsize(fmt)))[0]

    def _from_reader(self) -> None:
        reader = gguf.GGUFReader(str(self.path))
        for key, field in reader.fields.items():
            if not key.startswith("GGUF."):
                self.metadata[key] = field.contents()
        self.tensors = [GGUFTensor(t.name, t.tensor_type, t.shape, t.data) for t in reader.tensors]


# llama.cpp's split naming (llama_split_path): PREFIX-00001-of-00003.gguf
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS = "split.count", "split.no", "split.tensors.count"


def split_parts(path: str | Path) -> list[Path]:
    """Every part of the split model whose part ``path`` is (its own name if not split)."""
    path = Path(path)
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m.group("count"))
    width = len(m.group("no"))
    return [
        path.with_name(f"{m.group('prefix')}-{i:0{width}d}-of-{m.group('count')}.gguf")
        for i in range(1, count + 1)
    ]


def read_gguf(path: str | Path) -> GGUFFile:
    """A GGUF file, or the whole of a split model from its first part."""
    first = GGUFFile(path)
    count = int(first.metadata.get(SPLIT_COUNT, 1) or 1)
    if count <= 1:
        return first
    if int(first.metadata.get(SPLIT_NO, 0)) != 0:
        raise ValueError(
            f"{first.path} is part {int(first.metadata[SPLIT_NO]) + 1} of a split model: load "
            "its first part (-00001-of-...)"
        )
    parts = split_parts(first.path)
    if len(parts) != count:
        raise ValueError(
            f"{first.path} is the first of {count} parts, but its name does not say where the "
            "others are (expected NAME-00001-of-0000N.gguf, as gguf-split writes them)"
        )
    names = {t.name for t in first.tensors}
    first._others = []
    for no, part_path in enumerate(parts[1:], start=1):
        if not part_path.is_file():
            raise ValueError(
                f"part {no + 1} of {count} of this split model is missing: {part_path}"
            )
        part = GGUFFile(part_path)
        if (
            int(part.metadata.get(SPLIT_NO, -1)) != no
            or int(part.metadata.get(SPLIT_COUNT, 0)) != count
        ):
            raise ValueError(f"{part_path} is not part {no + 1} of {count} of {first.path.name}")
        for t in part.tensors:
            if t.name in names:
                raise ValueError(f"{part_path}: tensor {t.name} appears twice")
            names.add(t.name)
        first.tensors.extend(part.tensors)
        first._others.append(part)
    want = first.metadata.get(SPLIT_TENSORS)
    if want is not None and int(want) != len(first.tensors):
        raise ValueError(
            f"{first.path.name}: the split model holds {len(first.tensors)} tensors, its first "
            f"part says {int(want)}"
        )
    return first


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every key/value field as a Python value (str, int, float, bool or list of them)."""
    return dict(reader.metadata)
