"""One anchor (transformers or llama.cpp) in a process of its own, answering JSON lines.

Started by ``specdec.bench.runners.AnchorRunner`` as a script file path
(``python .../specdec/bench/anchor_worker.py``), never as ``python -m
specdec.bench.anchor_worker``: that is a package import, which runs ``specdec/__init__.py`` and
so sets OMP_WAIT_POLICY=PASSIVE before the anchor's OpenMP runtime starts (llama.cpp's thread
barriers then sleep: SmolLM2-135M Q4_1 decodes at 45 instead of ~170 tok/s). This file imports
nothing from specdec, and the parent strips OMP_WAIT_POLICY from the environment it passes.

Protocol: one JSON object per line on stdin, one reply per line on the original stdout.
- ``{"op": "load", "backend", "method", "options", "model_path", "eog_token_ids", "n_ctx",
  "seed"}`` -> ``{"ok": true, "info": {"environment", "library", "settings"}}``
- ``{"op": "generate", "prompt_ids", "max_tokens", "temperature", "seed", "ignore_eos"}`` ->
  ``{"ok": true, "output_token_ids", "seconds", "ttft_s", "finish_reason"}``, timed here around
  the anchor's own call (the pipe is not charged to it)
- ``{"op": "reset"}`` -> ``{"ok": true}``: forget earlier requests (llama.cpp's reused prefix)
- ``{"op": "close"}`` or end of input: exit.
A failure replies ``{"ok": false, "error_type", "error", "unavailable"}``. Whatever the libraries
print goes to stderr: file descriptor 1 is pointed there before they load.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple, TextIO

ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GGML_", "LLAMA_", "TORCH_")


class Unavailable(RuntimeError):
    """The anchor's package is missing or cannot load this model here."""


def environment_facts() -> dict[str, Any]:
    """What this process runs with, taken before any anchor library loads."""
    return {
        "python": sys.executable,
        "python_version": platform.python_version(),
        "pid": os.getpid(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # None: unset, the library default
    }


class Generate(NamedTuple):
    """A ``generate`` request's fields, as every anchor takes them."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    ignore_eos: bool

    @classmethod
    def from_request(cls, req: dict[str, Any]) -> Generate:
        return cls(*(req[name] for name in cls._fields))


# ---- transformers -------------------------------------------------------------------------------
class _FirstTokenTimer:
    """A transformers streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2:  # the first put is the prompt
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def _require(what: str, *modules: str, install: str) -> list[Any]:
    """``modules`` imported, in order, or ``Unavailable`` naming ``what`` and what to install."""
    try:
        return [importlib.import_module(name) for name in modules]
    except ImportError as e:
        raise Unavailable(f"{what} cannot be imported ({e}; pip install {install})") from e


class HFAnchor:
    """``AutoModelForCausalLM.generate`` in float32, torch's default threads."""

    def __init__(self, req: dict[str, Any]) -> None:
        torch, transformers = _require(
            "transformers", "torch", "transformers", install="transformers accelerate"
        )
        self.torch = torch
        self.model = self._load(transformers, Path(req["model_path"]))
        self.kwargs = dict(req["options"])
        if "assistant_model" in self.kwargs:  # a path the parent resolved
            self.kwargs["assistant_model"] = self._load(
                transformers, Path(self.kwargs["assistant_model"])
            )
        self.eog = sorted(req["eog_token_ids"])
        self.library = {"transformers": transformers.__version__, "torch": torch.__version__}
        self.settings = {
            "dtype": "float32",
            "torch_threads": torch.get_num_threads(),
            "generate_kwargs": dict(req["options"]),
        }

    def _load(self, transformers, path: Path):
        auto = transformers.AutoModelForCausalLM
        dtype = self.torch.float32
        if path.is_file():
            model = auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            model = auto.from_pretrained(str(path), dtype=dtype)
        return model.eval()

    def reset(self) -> None:
        pass  # NOTE: generate keeps nothing between calls

    def generate(self, gen: Generate) -> dict[str, Any]:
        prompt_ids, max_tokens, temperature, seed, ignore_eos = gen
        torch = self.torch
        kwargs: dict[str, Any] = dict(self.kwargs)
        if temperature == 0.0:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            torch.manual_seed(seed)
            kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        if ignore_eos:
            kwargs["min_new_tokens"] = max_tokens
        timer = _FirstTokenTimer()
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                eos_token_id=self.eog or None,
                pad_token_id=self.eog[0] if self.eog else None,
                streamer=timer,
                **kwargs,
            )
        seconds = time.perf_counter() - start
        new = out[0, len(prompt_ids) :].tolist()
        ttft = None if timer.first_token_time is None else timer.first_token_time - start
        finish = "stop" if new and new[-1] in self.eog and not ignore_eos else "length"
        return _turn(new, seconds, ttft, finish)


# ---- llama.cpp ------------------------------------------------------------------------------------
LLAMA_N_BATCH = 512


def llama_settings(req: dict[str, Any], num_cores: int) -> dict[str, Any]:
    """The keyword arguments given to ``llama_cpp.Llama`` (the draft described, not built)."""
    draft = None
    if req["method"] == "prompt_lookup":
        draft = {"class": "LlamaPromptLookupDecoding", **req["options"]}
    return {
        "n_ctx": req["n_ctx"],
        "n_batch": LLAMA_N_BATCH,
        "n_threads": num_cores,
        "n_threads_batch": num_cores,
        "flash_attn": True,
        # NOTE: plain computes logits for the last prompt row only (logits_all=True would run
        # the output layer over every prompt row: TTFT 1.7 s instead of ~0.3 s on 700 tokens).
        # A prompt-lookup draft needs them all: with logits_all=False it crashes past 512
        # tokens of context, and llama-cpp-python forces True with a draft model anyway.
        "logits_all": draft is not None,
        "draft_model": draft,
        "seed": req["seed"],
        "verbose": False,
    }


class LlamaCppAnchor:
    """``llama_cpp.Llama.generate``: its own threads (one per usable core), flash attention."""

    def __init__(self, req: dict[str, Any]) -> None:
        (llama_cpp,) = _require("llama-cpp-python", "llama_cpp", install="llama-cpp-python")
        path = Path(req["model_path"])
        if path.suffix != ".gguf":
            raise Unavailable(f"llama.cpp needs a GGUF file, not {path}")
        self.settings = llama_settings(req, len(os.sched_getaffinity(0)))
        kwargs = dict(self.settings)
        if kwargs["draft_model"] is not None:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kwargs["draft_model"] = LlamaPromptLookupDecoding(**req["options"])
        self.llm = llama_cpp.Llama(model_path=str(path), **kwargs)
        # NOTE: llama-cpp-python's default: a request reuses the KV of the longest prefix it
        # shares with the previous request (one cached sequence; ours keeps several). Off when
        # the benchmark turns prefix caching off for our engine too.
        self.prefix_reuse = bool(req.get("prefix_reuse", True))
        self.settings["prefix_reuse"] = self.prefix_reuse
        self.n_ctx = req["n_ctx"]
        self.eog = set(req["eog_token_ids"]) | {self.llm.token_eos()}
        self.library = {"llama_cpp_python": llama_cpp.__version__}

    def reset(self) -> None:
        self.llm.reset()

    def generate(self, gen: Generate) -> dict[str, Any]:
        prompt_ids, max_tokens, temperature, _, ignore_eos = gen  # NOTE: the seed is the load's
        if len(prompt_ids) >= self.n_ctx:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit n_ctx {self.n_ctx}")
        if not self.prefix_reuse:
            self.llm.reset()
        room = min(max_tokens, self.n_ctx - len(prompt_ids))
        tokens: list[int] = []
        first = None
        finish = "length"
        start = time.perf_counter()
        gen = self.llm.generate(
            prompt_ids, top_k=1 if temperature == 0.0 else 0, top_p=1.0, min_p=0.0,
            temp=temperature, repeat_penalty=1.0, reset=True,
        )  # fmt: skip
        for tok in gen:
            if first is None:
                first = time.perf_counter()
            tokens.append(int(tok))
            if not ignore_eos and tok in self.eog:
                finish = "stop"
                break
            if len(tokens) >= room:
                break
        seconds = time.perf_counter() - start
        return _turn(tokens, seconds, None if first is None else first - start, finish)


def _turn(tokens: list[int], seconds: float, ttft: float | None, finish: str) -> dict[str, Any]:
    return {"output_token_ids": tokens, "seconds": seconds, "ttft_s": ttft, "finish_reason": finish}


# ---- the loop -------------------------------------------------------------------------------------
def load(req: dict[str, Any]) -> tuple[HFAnchor | LlamaCppAnchor, dict[str, Any]]:
    facts = environment_facts()
    anchor = HFAnchor(req) if req["backend"] == "hf" else LlamaCppAnchor(req)
    facts["specdec_imported"] = "specdec" in sys.modules
    return anchor, {"environment": facts, "library": anchor.library, "settings": anchor.settings}


def serve(requests: TextIO, replies: TextIO) -> None:
    anchor = None
    for line in requests:
        req = json.loads(line)
        op = req.get("op")
        if op == "close":
            break
        try:
            if op == "load":
                anchor, info = load(req)
                reply: dict[str, Any] = {"ok": True, "info": info}
            elif op == "reset" and anchor is not None:
                anchor.reset()
                reply = {"ok": True}
            elif op == "generate" and anchor is not None:
                reply = {"ok": True, **anchor.generate(Generate.from_request(req))}
            else:
                raise RuntimeError(f"unexpected request {op!r}")
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            reply = {
                "ok": False,
                "error_type": type(e).__name__,
                "error": str(e),
                "unavailable": isinstance(e, Unavailable),
            }
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> None:
    # NOTE: a script's own folder leads sys.path; drop it so that no sibling module (configs.py,
    # dataset.py, report.py...) can shadow a top-level module the libraries import.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    # NOTE: the replies keep the original stdout; fd 1 (C printf and Python print alike) then
    # points at stderr, so nothing a library prints can corrupt the protocol.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
