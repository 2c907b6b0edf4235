"""llama.cpp's OpenAI-compatible server as a ``bench serve`` anchor (``llama_cpp:plain``).

``python -m llama_cpp.server`` (llama-cpp-python's, installed with ``pip install
'llama-cpp-python[server]'``) runs in its own process with ``anchor_environment()`` (our
environment without OMP_WAIT_POLICY), one thread per usable core, flash attention, n_batch 512
and logits for the last prompt row only, like ``bench latency``'s llama.cpp anchor. The same
streaming clients measure it as our server.

It streams no usage, so the clients count tokens themselves (``ReplyTokenCounter``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specdec.bench.runners import AnchorUnavailable, anchor_environment

SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GGML_", "LLAMA_", "TORCH_")
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
# NOTE: what a plain greedy request needs beyond temperature 0: the server's repeat_penalty
# defaults to 1.1, which changes the greedy tokens.
LLAMA_CPP_REQUEST_EXTRAS = {"repeat_penalty": 1.0}


def server_settings(n_ctx: int, seed: int, num_cores: int) -> dict[str, Any]:
    """The server's flags (``--name value``), every one given explicitly."""
    return {
        "n_ctx": n_ctx,
        "n_batch": 512,
        "n_threads": num_cores,
        "n_threads_batch": num_cores,
        "flash_attn": True,
        # NOTE: the server's own defaults differ from the library's: logits_all=True (the
        # output layer over every prompt row) and interrupt_requests=True (a new request
        # cancels the one streaming, which would cut every reply short at concurrency > 1).
        "logits_all": False,
        "interrupt_requests": False,
        "seed": seed,
        "verbose": False,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flag(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class LlamaCppServer:
    """One ``llama_cpp.server`` process on a free 127.0.0.1 port; ``info`` as ``AnchorRunner``'s
    (the environment read back from /proc/<pid>/environ)."""

    def __init__(self, model_path: Path, n_ctx: int, seed: int, log_path: Path) -> None:
        missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            raise AnchorUnavailable(
                f"llama-cpp-python's server is not installed (missing {', '.join(missing)}: "
                "pip install 'llama-cpp-python[server]')"
            )
        if model_path.suffix != ".gguf":
            raise AnchorUnavailable(f"llama.cpp needs a GGUF file, not {model_path}")
        env, removed = anchor_environment()
        self.settings = server_settings(n_ctx, seed, len(os.sched_getaffinity(0)))
        port = _free_port()
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path),
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        for name, value in self.settings.items():
            argv += [f"--{name}", _flag(value)]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with open(log_path, "w", encoding="utf-8") as log:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.info: dict[str, Any] = {
            "environment": {**self._environment(), "removed_from_ours": removed},
            "library": {"llama_cpp_python": importlib.metadata.version("llama_cpp_python")},
            "settings": {**self.settings, "server": "llama_cpp.server"},
        }

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
                raise RuntimeError(
                    f"llama_cpp.server exited with code {self.proc.returncode}:\n{tail}"
                )
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama_cpp.server did not answer within {READY_TIMEOUT_S:.0f} s")

    def _environment(self) -> dict[str, Any]:
        assert self.proc is not None
        raw = Path(f"/proc/{self.proc.pid}/environ").read_bytes()
        env = dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)
        return {
            "python": sys.executable,
            "pid": self.proc.pid,
            "cpu_cores_usable": len(os.sched_getaffinity(0)),
            "env": {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)},
            "omp_wait_policy": env.get("OMP_WAIT_POLICY"),
            "specdec_imported": False,  # python -m llama_cpp.server imports nothing of ours
        }

    def reset_caches(self) -> None:
        pass  # NOTE: the server keeps only the KV of its last request, which it reuses by prefix

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ReplyTokenCounter:
    """Usage for a server that streams none, as vLLM's serving benchmark counts it for such
    backends: prompt tokens = the chat template applied here with the model's own tokenizer;
    output tokens = the reply re-encoded, plus the end-of-generation token when it stopped on one
    (our server counts that one too). A re-encoding can differ from the sampled tokens by a token
    now and then."""

    def __init__(self, model_path: Path) -> None:
        from specdec.model.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_gguf_file(model_path)

    def usage(self, messages: list[dict], text: str, finish_reason: str | None) -> dict[str, int]:
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=True)
        output = len(self.tokenizer.encode(text, add_special_tokens=False))
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": output + (finish_reason == "stop"),
        }
