"""One request at a time through our engine or an anchor (transformers, llama.cpp).

Every runner turns prompt token ids into a ``TurnResult`` with wall-clock seconds from submitting
the request to its last token (prefill included) and the time to the first token. Anchors run in
a process of their own (``AnchorRunner`` and ``anchor_worker.py``), with the user's environment
minus what specdec sets for itself and their libraries' own thread defaults; they time
themselves there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from specdec.bench.configs import BenchConfig
from specdec.bench.dataset import BenchItem, PromptBuilder
from specdec.config import EngineArgs
from specdec.spec_decode.metrics import SpecDecodeStats


class AnchorUnavailable(RuntimeError):
    """An optional anchor cannot run here (package missing, model format unsupported)."""


@dataclass
class GenParams:
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TurnResult:
    num_prompt_tokens: int
    output_token_ids: list[int]
    seconds: float
    ttft_s: float | None
    finish_reason: str | None = None
    spec: SpecDecodeStats | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Runner(Protocol):
    def generate(self, prompt_ids: list[int], params: GenParams) -> TurnResult: ...

    def reset_caches(self) -> None:
        """Forget whatever earlier requests left behind (prefix cache, drafter memory)."""
        ...

    def close(self) -> None: ...


def run_item(
    runner: Runner, builder: PromptBuilder, item: BenchItem, params: GenParams, config: BenchConfig
) -> dict:
    """All turns of one item, each reply fed back; one per-prompt record (see results.json)."""
    replies: list[str] = []
    turns: list[TurnResult] = []
    error = None
    try:
        for _ in item.turns:
            result = runner.generate(builder.prompt_ids(item, replies), params)
            turns.append(result)
            replies.append(builder.reply_text(result.output_token_ids))
    except ValueError as e:  # e.g. the prompt (with history) exceeds max_model_len
        error = str(e)
    return make_record(item, config, turns, error)


def make_record(
    item: BenchItem, config: BenchConfig, turns: list[TurnResult], error: str | None = None
) -> dict:
    spec = None
    if not config.is_plain and config.backend == "specdec":
        spec = SpecDecodeStats()
        for t in turns:
            if t.spec is not None:
                spec.merge(t.spec)
    return {
        "id": item.id,
        "category": item.category,
        "config": config.label,
        "backend": config.backend,
        "num_turns": len(item.turns),
        "prompt_tokens": sum(t.num_prompt_tokens for t in turns),
        "cached_prompt_tokens": sum(t.num_cached_tokens for t in turns),
        "output_tokens": sum(len(t.output_token_ids) for t in turns),
        "seconds": sum(t.seconds for t in turns),
        "ttft_s": turns[0].ttft_s if turns else None,
        "turns": [
            {
                "prompt_tokens": t.num_prompt_tokens,
                "cached_prompt_tokens": t.num_cached_tokens,
                "output_tokens": len(t.output_token_ids),
                "seconds": t.seconds,
                "ttft_s": t.ttft_s,
                "finish_reason": t.finish_reason,
                "output_token_ids": list(t.output_token_ids),
            }
            for t in turns
        ],
        "spec_decode": _spec_dict(spec) if spec is not None else None,
        "identical_to_plain": None,
        "first_mismatch": None,
        "error": error,
    }


def _spec_dict(spec: SpecDecodeStats) -> dict:
    return {
        **spec.as_dict(),
        "acceptance_rate_per_pos": [round(x, 4) for x in spec.acceptance_rate_per_pos()],
    }


# ---- our engine ---------------------------------------------------------------------------------
class SpecdecRunner:
    def __init__(self, config: BenchConfig, engine: EngineArgs) -> None:
        from specdec.llm import LLM

        # NOTE: batch size 1; one running slot (plus prefix cache slots)
        self.llm = LLM.from_engine_args(
            engine.replace(speculative_config=config.speculative_config(), max_num_seqs=1)
        )

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def generate(self, prompt_ids: list[int], params: GenParams) -> TurnResult:
        from specdec.sampling_params import SamplingParams

        sp = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            seed=None if params.greedy else params.seed,
            ignore_eos=params.ignore_eos,
        )
        engine = self.llm.engine
        start = time.perf_counter()
        req_id = engine.add_request(prompt_ids, sp)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == req_id and out.finished:
                    final = out
        seconds = time.perf_counter() - start
        if final is None:
            raise RuntimeError(f"request {req_id} did not finish")
        ttft = final.metrics.time_to_first_token if final.metrics is not None else None
        completion = final.outputs[0]
        return TurnResult(
            len(prompt_ids),
            list(completion.token_ids),
            seconds,
            ttft,
            completion.finish_reason,
            final.spec_decode_stats,
            final.num_cached_tokens,
        )

    def reset_caches(self) -> None:
        """The prefix cache and everything the drafter learnt (suffix trees, draft-model KV,
        the adaptive controller's state)."""
        engine = self.llm.engine
        engine.reset_prefix_cache()
        engine.reset_drafter_cache()

    def close(self) -> None:
        self.llm = None  # type: ignore[assignment]


# ---- anchors (transformers, llama.cpp), each in a process of its own ------------------------------
ANCHOR_WORKER = Path(__file__).with_name("anchor_worker.py")
ANCHOR_MODULES = {  # backend -> (module, how to install it)
    "hf": ("transformers", "pip install transformers accelerate"),
    "llama_cpp": ("llama_cpp", "pip install llama-cpp-python"),
}
# NOTE: what specdec sets in its own environment (specdec/__init__.py; scripts/test.sh exports it
# too): passive OpenMP waiting suits our kernels but makes llama.cpp's per-op thread barriers
# sleep (45 instead of ~170 tok/s). Anchors run with the library defaults, so it goes, whoever set it.
SPECDEC_ENV_VARS = ("OMP_WAIT_POLICY",)
CLOSE_TIMEOUT_S = 30.0


def anchor_environment() -> tuple[dict[str, str], dict[str, str]]:
    """The user's environment without what specdec sets for itself, and what was taken out."""
    env = dict(os.environ)
    removed = {k: env.pop(k) for k in SPECDEC_ENV_VARS if k in env}
    return env, removed


class AnchorRunner:
    """A ``Runner`` whose anchor lives in ``anchor_worker.py``, started as a script in a child
    process with ``anchor_environment()``; requests and replies are JSON lines over its pipes.

    ``info`` is what the child reported at load (its environment as it saw it before the
    library loaded, the library versions, the exact settings) plus what was removed from ours.
    """

    def __init__(
        self,
        config: BenchConfig,
        model_path: Path,
        eog_token_ids: set[int],
        n_ctx: int,
        seed: int,
        prefix_reuse: bool = True,
    ) -> None:
        module, install = ANCHOR_MODULES[config.backend]
        if importlib.util.find_spec(module) is None:  # NOTE: looks, does not import
            raise AnchorUnavailable(f"{module} is not installed ({install})")
        if config.backend == "llama_cpp" and model_path.suffix != ".gguf":
            raise AnchorUnavailable(f"llama.cpp needs a GGUF file, not {model_path}")
        options = dict(config.options)
        if "assistant_model" in options:
            from specdec.model.registry import resolve_model_path

            options["assistant_model"] = str(resolve_model_path(str(options["assistant_model"])))
        env, removed = anchor_environment()
        self.label = config.label
        self.proc: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, str(ANCHOR_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
        )
        try:
            reply = self._call({
                "op": "load", "backend": config.backend, "method": config.method,
                "options": options, "model_path": str(model_path),
                "eog_token_ids": sorted(eog_token_ids), "n_ctx": n_ctx, "seed": seed,
                "prefix_reuse": prefix_reuse,
            })  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.info: dict[str, Any] = reply["info"]
        self.info["environment"]["removed_from_ours"] = removed

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise RuntimeError(f"{self.label}: the anchor process is closed")
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = proc.wait(timeout=CLOSE_TIMEOUT_S)
            self.proc = None
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise RuntimeError(f"{self.label}: the anchor process {how} (its stderr is above)")
        reply = json.loads(line)
        if reply["ok"]:
            return reply
        message = f"{reply['error_type']}: {reply['error']}"
        if reply["unavailable"]:
            raise AnchorUnavailable(reply["error"])
        if reply["error_type"] == "ValueError":  # e.g. the prompt does not fit the context
            raise ValueError(message)
        raise RuntimeError(f"{self.label}: {message}")

    def generate(self, prompt_ids: list[int], params: GenParams) -> TurnResult:
        reply = self._call({
            "op": "generate", "prompt_ids": prompt_ids, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "seed": params.seed, "ignore_eos": params.ignore_eos,
        })  # fmt: skip
        return TurnResult(
            len(prompt_ids),
            list(reply["output_token_ids"]),
            reply["seconds"],
            reply["ttft_s"],
            reply["finish_reason"],
        )

    def reset_caches(self) -> None:
        self._call({"op": "reset"})

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                proc.stdin.close()
            proc.wait(timeout=CLOSE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
