"""A GGUF file's weights rewritten in another float type (BF16, F16 or F32), metadata unchanged.

    .venv/bin/python benchmarks/retype_gguf.py SOURCE.gguf DEST.gguf --type BF16

Quantized matrices are dequantized (gguf's reference) and stored in the new type; 1-D tensors
(norms) stay F32.  Used to measure the 16-bit kernels on a real model: SmolLM2-135M in BF16 is
what a Hugging Face folder of it holds, give or take the rounding of its Q4_1 values.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

TYPES = {"BF16": QT.BF16, "F16": QT.F16, "F32": QT.F32}


def retype(source: Path, dest: Path, type_name: str) -> Path:
    qtype = TYPES[type_name]
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dest), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if data.ndim < 2 or qtype == QT.F32:
            w.add_tensor(t.name, data)
        elif qtype == QT.F16:
            w.add_tensor(t.name, data.astype(np.float16))
        else:
            w.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--type", choices=sorted(TYPES), default="BF16")
    args = ap.parse_args()
    print(f"wrote {retype(args.source, args.dest, args.type)}")


if __name__ == "__main__":
    main()
