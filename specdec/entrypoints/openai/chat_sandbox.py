"""Chat templates sent with a request, rendered in a worker process with bounded time and memory.

A template a client sends is code. In the server process ``{{ (9**(9**7)) % 7 }}`` is one C call
that holds the GIL for seconds, so no thread timeout can stop it, and every stream, ``/health`` and
signal handling wait for it. So the server refuses such templates unless it was started with
``--trust-request-chat-template`` (vLLM's flag), and even then renders them here:

- jinja's immutable sandbox, with guards that refuse ``**``, ``*``, ``+`` and ``%`` whose result
  would be huge (an immediate, clear error for the usual bombs) and ranges over 10,000 items;
- in a separate process, with a memory limit (RLIMIT_AS) and the interpreter's recursion limit
  (a recursive macro ends in a RecursionError, not a crash);
- with a wall-clock limit: a render that overruns (nested loops, exponential macros) gets its
  worker killed, and the next render starts a new one.

The model's own template is the operator's: it renders in the server process, on a worker
thread (``Tokenizer.apply_chat_template``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# NOTE: the model's template environment is built from these in specdec/model/tokenizer.py; the
# worker builds the same one on the guarded class.
from specdec.lanes import LaneCaps
from specdec.model.tokenizer import chat_template_environment

MAX_INT_BITS = 4096  # integers a template may compute
MAX_SEQUENCE = 1 << 20  # characters or items a template may build with * or +
MAX_RANGE = 10_000
MAX_RENDERED_CHARS = 4 << 20
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_BYTES = 1 << 30  # address space: ~160 MiB is the interpreter and jinja
_START_TIMEOUT_S = 60.0
_WIDE_FORMAT = re.compile(r"%[-#0 +]*(\*|\d{4,}|\.\*|\.\d{4,}|\d*\.\d{4,})")


class TemplateRenderError(ValueError):
    """A request's chat template failed, overran its limits or was refused."""


# ---- the worker process ----------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would exceed the integer or sequence limits."""
    if operator == "**" and _is_int(left) and _is_int(right):
        if right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS:
            raise SecurityError(f"integer power too large (limit {MAX_INT_BITS} bits)")
    elif operator == "*":
        if _is_int(left) and _is_int(right):
            if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise SecurityError(f"integer product too large (limit {MAX_INT_BITS} bits)")
            return
        seq, n = (left, right) if _is_int(right) else (right, left)
        if isinstance(seq, (str, list, tuple)) and _is_int(n) and len(seq) * n > MAX_SEQUENCE:
            raise SecurityError(f"repetition too large (limit {MAX_SEQUENCE} items)")
    elif operator == "+" and isinstance(left, (str, list, tuple)):
        if isinstance(right, (str, list, tuple)) and len(left) + len(right) > MAX_SEQUENCE:
            raise SecurityError(f"concatenation too large (limit {MAX_SEQUENCE} items)")
    elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
        raise SecurityError("string formatting with a width or precision over 999 is refused")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, plus size guards on the operators that can blow up."""

    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return chat_template_environment(GuardedEnvironment).from_string(source)


def render_guarded(source: str, variables: dict[str, Any]) -> str:
    """Render ``source`` in the guarded sandbox (in this process: the caller bounds time and memory)."""
    parts: list[str] = []
    size = 0
    for chunk in _compile(source).generate(**variables):
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            raise SecurityError(f"rendered prompt too long (limit {MAX_RENDERED_CHARS} characters)")
        parts.append(chunk)
    return "".join(parts)


def _render_job(line: bytes) -> dict[str, str]:
    try:
        job = json.loads(line)
        return {"text": render_guarded(job["template"], job["variables"])}
    except RecursionError:
        return {"error": "chat template recursion is too deep"}
    except MemoryError:
        return {"error": "chat template used too much memory"}
    except Exception as e:  # noqa: BLE001 - every failure of a client's template is the client's
        return {"error": f"chat template error: {type(e).__name__}: {str(e)[:500]}"}


def _worker_main(memory_bytes: int) -> None:
    """Read one JSON job per line on stdin, answer one JSON line on stdout; exit at EOF."""
    # NOTE: a terminal's Ctrl-C and systemd's SIGTERM reach the whole process group; the server
    # decides when its worker stops (it closes our stdin, or kills us after an overrun).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    jinja2.sandbox.MAX_RANGE = MAX_RANGE  # this process renders nothing else
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        out.write(json.dumps(_render_job(line), ensure_ascii=True).encode() + b"\n")
        out.flush()


# ---- the server side ---------------------------------------------------------------------------


class TemplateWorker:
    """Renders request templates in one worker process, one at a time, each within ``timeout_s``."""

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.num_killed = 0  # workers killed for overrunning (for tests and logs)
        self._proc: asyncio.subprocess.Process | None = None
        self._ready = False
        self._lock: asyncio.Lock | None = None

    async def start(self) -> None:
        """Start the worker now rather than at the first render."""
        if self._proc is None or self._proc.returncode is not None:
            root = str(Path(__file__).resolve().parents[3])  # the folder holding `specdec`
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
            }
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, str(self.memory_bytes),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL, env=env, limit=16 * MAX_RENDERED_CHARS,
            )  # fmt: skip
            self._ready = False

    async def render(self, source: str, variables: dict[str, Any]) -> str:
        """The rendered template, or TemplateRenderError (an error, an overrun, a dead worker)."""
        job = json.dumps({"template": source, "variables": variables}, ensure_ascii=True)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await self.start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            try:
                if not self._ready:
                    ready = await self._read_line(proc, _START_TIMEOUT_S, "start")
                    self._ready = b"ready" in ready
                proc.stdin.write(job.encode() + b"\n")
                await proc.stdin.drain()
                answer = json.loads(await self._read_line(proc, self.timeout_s, "render"))
            except (asyncio.CancelledError, ConnectionError):
                # NOTE: the client went away mid-render (or the worker did): the worker's late
                # answer would be read as the next render's, so it goes.
                self._kill()
                raise
        if "error" in answer:
            raise TemplateRenderError(answer["error"])
        return answer["text"]

    async def _read_line(
        self, proc: asyncio.subprocess.Process, timeout: float, what: str
    ) -> bytes:
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
        except (TimeoutError, ValueError) as e:  # ValueError: a line over the reader's limit
            await self.close()
            self.num_killed += 1
            if isinstance(e, ValueError):
                raise TemplateRenderError("chat template output too long") from None
            raise TemplateRenderError(
                f"chat template took longer than {timeout:g} s to {what}; refused"
            ) from None
        if not line:
            await self.close()
            raise TemplateRenderError("chat template worker died while rendering (memory limit?)")
        return line

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    async def close(self) -> None:
        """Stop the worker (the next render starts a new one)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


class TemplateSandbox:
    """Renders request templates on ``num_workers`` worker processes (TemplateWorker), each
    render within ``timeout_s``. Renders wait in order, but a client (``render``'s ``lane``)
    holds at most all workers but one: another client's template never waits behind its slow
    ones (renders without a lane may take every worker)."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        num_workers: int = 2,
    ) -> None:
        self.timeout_s = timeout_s
        self._workers = [TemplateWorker(timeout_s, memory_bytes) for _ in range(num_workers)]
        self._free = list(self._workers)
        self._waiting: list[tuple[Any, asyncio.Future[TemplateWorker]]] = []
        self._caps = LaneCaps(num_workers)

    @property
    def num_killed(self) -> int:
        """Workers killed for overrunning (for tests and logs)."""
        return sum(w.num_killed for w in self._workers)

    async def start(self) -> None:
        """Start the workers now rather than at the first renders."""
        for w in self._workers:
            await w.start()

    async def render(self, source: str, variables: dict[str, Any], lane: Any = None) -> str:
        """As TemplateWorker.render, on the first free worker ``lane`` may take."""
        fut: asyncio.Future[TemplateWorker] = asyncio.get_running_loop().create_future()
        self._waiting.append((lane, fut))
        self._dispatch()
        try:
            worker = await fut
        except asyncio.CancelledError:
            if fut in [f for _, f in self._waiting]:
                self._waiting = [(ln, f) for ln, f in self._waiting if f is not fut]
            elif fut.done() and not fut.cancelled():
                self._release(fut.result(), lane)
            raise
        try:
            return await worker.render(source, variables)
        finally:
            self._release(worker, lane)

    def _dispatch(self) -> None:
        """Hand free workers to the oldest waiting renders whose lane is below its cap."""
        i = 0
        while self._free and i < len(self._waiting):
            lane, fut = self._waiting[i]
            if fut.done():  # cancelled while waiting
                del self._waiting[i]
            elif self._caps.may_start(lane):
                del self._waiting[i]
                self._caps.started(lane)
                fut.set_result(self._free.pop())
            else:
                i += 1

    def _release(self, worker: TemplateWorker, lane: Any) -> None:
        self._caps.finished(lane)
        self._free.append(worker)
        self._dispatch()

    async def close(self) -> None:
        """Stop the workers (the next renders start new ones)."""
        for w in self._workers:
            await w.close()


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MEMORY_BYTES)
