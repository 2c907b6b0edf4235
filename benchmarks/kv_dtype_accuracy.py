"""What a KV cache format costs in accuracy: each document read in one prefill with every
``--kv-cache-dtype``, the next-token log-likelihood per position against the float32 cache's.

Reported per format and document: the mean negative log-likelihood of the document's own next
tokens (its perplexity), the share of positions whose top choice equals the float32 cache's, and
the mean KL divergence from the float32 cache's next-token distribution. Documents: files given
with ``--files`` (default: this repository's README.md and engine/scheduler.py, prose and code),
cut to ``--tokens`` tokens. ``int8-float`` is the 8-bit cache read with float products on a CPU
that would take integer ones (AVX-512 VNNI + VBMI), to set the two side by side; ``int8-raw`` is
the 8-bit cache without its key transform (keys stored as they are: docs/kv-cache.md).

    python benchmarks/kv_dtype_accuracy.py --model smollm2-135m --tokens 2000
    python benchmarks/kv_dtype_accuracy.py --dtypes float32 float16 int8-float int8
    python benchmarks/kv_dtype_accuracy.py --dtypes float32 int8-raw int8 --activation-dtype float32
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.engine.loading import load_model
from specdec.model.llama import SeqBatch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = [ROOT / "README.md", ROOT / "specdec" / "engine" / "scheduler.py"]


def log_probs(
    model_name: str, kv_dtype: str, docs: list[list[int]], max_len: int, activation_dtype: str
) -> list:
    from specdec.kernels import _C

    # "int8-float": the 8-bit cache with float products (where the CPU would take integer ones)
    integer = _C.int8_attention()
    _C.set_int8_attention(integer and kv_dtype != "int8-float")
    raw = kv_dtype == "int8-raw"
    kv_dtype = "int8" if kv_dtype in ("int8-float", "int8-raw") else kv_dtype
    model, _ = load_model(
        model_name,
        torch.device("cpu"),
        torch.float32,
        "auto",
        "auto",
        max_len,
        activation_dtype,
        kv_dtype,
    )
    if raw:
        model.set_key_transform(None, None)
    out = []
    with torch.inference_mode():
        for ids in docs:
            kv = model.make_kv_cache(1, max_len)
            h = model.forward(
                torch.tensor(ids), torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv
            )
            out.append(F.log_softmax(model.compute_logits(h).float(), dim=-1))  # [T, V]
    _C.set_int8_attention(integer)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--files", nargs="+", type=Path, default=DEFAULT_FILES)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "int8"])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--score-from",
        type=int,
        default=0,
        help="score positions from this one on (llama-perplexity scores a chunk's second half)",
    )
    ap.add_argument(
        "--activation-dtype",
        default="auto",
        help="float32: no rounding of the linears' inputs, whose flips otherwise set a floor of "
        "~4e-3 under any format's KL on SmolLM2",
    )
    args = ap.parse_args()
    _, tok = load_model(args.model, torch.device("cpu"), torch.float32, "auto", "auto", 64)
    docs = [tok.encode(f.read_text())[: args.tokens] for f in args.files]
    max_len = max(len(d) for d in docs) + 16
    lp = {d: log_probs(args.model, d, docs, max_len, args.activation_dtype) for d in args.dtypes}
    ref = lp[args.dtypes[0]]
    rows = []
    print(f"| format | document | tokens | NLL (ppl) | top-1 = {args.dtypes[0]}'s | mean KL |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for f, ids, got, want in zip(args.files, docs, lp[dtype], ref):
            a = args.score_from
            target = torch.tensor(ids[a + 1 :])
            nll = -got[a:-1].gather(1, target[:, None]).mean().item()
            got, want = got[a:], want[a:]
            same = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            kl = (want.exp() * (want - got)).sum(-1).mean().item()
            rows.append(
                {
                    "dtype": dtype,
                    "file": f.name,
                    "tokens": len(ids),
                    "nll": nll,
                    "top1": same,
                    "kl": kl,
                }  # fmt: skip
            )
            print(
                f"| {dtype} | {f.name} | {len(ids)} | {nll:.4f} ({math.exp(nll):.2f}) | "
                f"{100 * same:.2f}% | {kl:.2e} |"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
