"""Grammar checks in a process of their own, so that no constraint a client sends can crash or
stall the server.

llguidance (1.9.1) recurses along rule chains while it validates a grammar: a JSON schema whose
``$ref`` chain is a few thousand definitions long, or a Lark chain of 3,000 rules, overflows the
stack of the thread that compiles it and the process dies with SIGSEGV (no Python exception). And
some constraints are merely slow (an 80 KB GBNF chain: ~20 s in ``gbnf_to_lark``). So every
constraint is first turned into llguidance's grammar text, validated and given a first mask here,
in a worker process, on a thread whose stack is deliberately small (``CHECK_STACK_BYTES``),
within a deadline. Only a grammar that passed is compiled in the engine's process, where every
thread that touches it has a 4x larger stack (``PARENT_STACK_BYTES``). A worker that dies
or overruns is replaced; the request gets a one-line error naming its field and the limit.

The file runs as a script (``python compile_worker.py``): it imports llguidance and the standard
library only, never specdec or torch, so a worker starts in ~0.3 s. The parent's side is
``GrammarChecker``.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

CHECK_STACK_BYTES = 4 << 20  # the worker's check thread: 4 MiB
# NOTE: the engine's threads that build or drive a matcher (compile, engine loop) get 4x the
# check's stack. Measured (llguidance 1.9.1, SmolLM2's tokenizer, compile + first mask): the
# deepest chain that passes grows linearly with the stack: 1 MiB holds a $ref chain of ~290 and
# a Lark chain of ~310 rules, 8 MiB ~2,400 and ~2,600; so what passed here cannot overflow there.
# 4 MiB holds the chains the structure checks let through (Lark ~1,250 > MAX_RULE_DEPTH), so
# the worker's crash is left to the shapes they do not follow ($anchor links, ...).
PARENT_STACK_BYTES = 16 << 20
_T = TypeVar("_T")
_STACK_LOCK = threading.Lock()
DEFAULT_DEADLINE_S = 5.0  # per constraint, compile and first mask
START_TIMEOUT_S = 60.0
NUM_WORKERS = 2
WORKER_NICENESS = 10  # the workers' CPU priority below the engine's (os.nice)
# NOTE: a nested JSON schema's first mask takes ~1-10 ms on a 49k vocabulary
FIRST_MASK_LIMIT_S = 0.25


# ---- the constraint as llguidance's grammar text (runs in the worker) -----------------------
def grammar_text(spec: dict[str, Any]) -> str:
    """``spec``: {"kind": json | json_object | regex | choice | grammar, "value": ..., options}."""
    import llguidance

    kind, value = spec["kind"], spec.get("value")
    check_structure(kind, value)
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        options: dict[str, Any] = {}
        if spec.get("disable_any_whitespace"):
            options["whitespace_flexible"] = False
        if spec.get("whitespace_pattern") is not None:
            options["whitespace_pattern"] = spec["whitespace_pattern"]
        if spec.get("disable_additional_properties") and isinstance(schema, dict):
            schema = _closed_objects(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        alternatives = "|".join(re.escape(c) for c in value)
        return llguidance.LLMatcher.grammar_from_regex(f"(?:{alternatives})")
    text = value
    if "::=" in text:  # GBNF, as llama.cpp and vLLM's xgrammar take it
        from llguidance.gbnf_to_lark import gbnf_to_lark

        text = gbnf_to_lark(text)
    return llguidance.LLMatcher.grammar_from_lark(text)


def map_objects(value: Any, fix: Callable[[dict], dict]) -> Any:
    """JSON ``value`` with ``fix`` applied to every object in it, the innermost first (``fix``
    gets a fresh copy whose members are already done)."""
    if isinstance(value, list):
        return [map_objects(v, fix) for v in value]
    if not isinstance(value, dict):
        return value
    return fix({k: map_objects(v, fix) for k, v in value.items()})


def _closed_objects(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever an object schema leaves it out."""

    def close(out: dict) -> dict:
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    return map_objects(schema, close)


# ---- structure checks (before the library sees the constraint) --------------------------------
# NOTE: chains the library would walk (and gbnf_to_lark: ~0.3 s for 1,000 GBNF rules, ~20 s for
# 6,000) are refused here at ~0.3 ms per KB; the worker's crash or deadline catches the rest
# (chains between what its stack holds and these limits, $anchor links, ...).
MAX_RULE_DEPTH = 1000  # Lark / GBNF rules nested through references
MAX_SCHEMA_DEPTH = 1000  # JSON-schema objects nested, following local $ref pointers
# strings, regexes and character classes (their content is no rule name), then comments
_LITERAL = re.compile(
    r'"(?:[^"\\\n]|\\.)*"i?|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*|\[(?:[^\]\\\n]|\\.)*\]'
)
_COMMENT = re.compile(r"//[^\n]*|#[^\n]*")
_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(?:::=|:(?!:))", re.M)
_NAME = re.compile(r"[A-Za-z_][\w-]*")
_JSON_DIRECTIVE = re.compile(r"%json\s*(?=\{)")


def check_structure(kind: str, value: Any) -> None:
    """Refuse rule chains of a grammar and $ref chains of a schema (given as JSON, or in a
    grammar's ``%json {...}``, as tool calls are) deeper than the limits (ValueError)."""
    schemas = [value] if kind == "json" else []
    if kind == "grammar" and isinstance(value, str):
        depth = rule_depth(value)
        if depth > MAX_RULE_DEPTH:
            raise ValueError(f"rules nest {depth} deep; the limit is {MAX_RULE_DEPTH}")
        schemas = list(_embedded_schemas(value))
    for schema in schemas:
        depth = schema_depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"the schema nests {depth} objects deep, following $ref; the limit is "
                f"{MAX_SCHEMA_DEPTH}"
            )


def rule_depth(grammar: str) -> int:
    """How deep the rules of a Lark or GBNF grammar nest through references: the depth of a
    depth-first walk from each rule in order (what a recursive walk of the library reaches)."""
    text = _COMMENT.sub(" ", _LITERAL.sub(" ", grammar))
    heads = list(_RULE.finditer(text))
    refs: dict[str, list[str]] = {}
    for head, nxt in zip(heads, heads[1:] + [None]):
        body = text[head.end() : nxt.start() if nxt else len(text)]
        refs.setdefault(head.group(1), []).extend(_NAME.findall(body))
    seen: set[str] = set()

    def children(name: str) -> Iterator[str]:
        for ref in refs[name]:
            if ref in refs and ref not in seen:
                seen.add(ref)
                yield ref

    deepest = 0
    for name in refs:  # NOTE: every rule, reachable or not: the library checks them all
        if name not in seen:
            seen.add(name)
            deepest = max(deepest, _walk_depth(name, children, lambda _: 1))
    return deepest


def schema_depth(schema: Any) -> int:
    """How deep a JSON schema's objects nest, following local ``#/...`` pointers (each target
    once, as a depth-first walk from the root)."""
    seen: set[int] = set()

    def children(node: Any) -> Iterator[Any]:
        for value in node.values() if isinstance(node, dict) else node:
            if isinstance(value, (dict, list)):
                yield value
        ref = node.get("$ref") if isinstance(node, dict) else None
        target = _pointer(schema, ref) if isinstance(ref, str) else None
        if target is not None and id(target) not in seen:
            seen.add(id(target))
            yield target

    if not isinstance(schema, (dict, list)):
        return 0
    return _walk_depth(schema, children, lambda node: int(isinstance(node, dict)))


def _pointer(schema: Any, ref: str) -> Any:
    """The subschema a local ``#/...`` pointer names, or None."""
    if not ref.startswith("#"):
        return None
    node = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None


def _walk_depth(root: Any, children: Callable[[Any], Iterator[Any]], weight: Callable) -> int:
    """The deepest point of a depth-first walk from ``root`` (``children`` yields each node
    once; ``weight``: what a node adds to the depth). Iterative: it never recurses itself."""
    deepest = weight(root)
    stack = [(children(root), deepest)]
    while stack:
        it, depth = stack[-1]
        node = next(it, None)
        if node is None:
            stack.pop()
            continue
        below = depth + weight(node)
        deepest = max(deepest, below)
        stack.append((children(node), below))
    return deepest


def _embedded_schemas(grammar: str) -> Iterator[Any]:
    """The schemas of a Lark grammar's ``%json {...}`` (those that parse)."""
    decoder = json.JSONDecoder()
    for m in _JSON_DIRECTIVE.finditer(grammar):
        try:
            yield decoder.raw_decode(grammar, m.end())[0]
        except (ValueError, RecursionError):
            continue  # the library's error to give


def one_line(message: str, limit: int = 200) -> str:
    """The library's message as one short line: its first line and ``error:`` lines, never the
    grammar or its state (verbose messages carry a ``<state>`` / ``<grammar>`` dump after the
    first line)."""
    lines = [x.strip() for x in str(message).splitlines()]
    # NOTE: a regex error's reason is on an "error:" line under the source it echoes
    reasons = [x for x in lines[1:] if x.startswith("error:")]
    first = "; ".join([next((x for x in lines if x), "invalid"), *reasons])
    # NOTE: the library quotes the offending source ('invalid regex "<the whole regex>"')
    first = _QUOTED.sub(_cut_quote, first)
    first = _LONG_WORD.sub(lambda m: m.group()[:MAX_QUOTED_CHARS] + "...", first)
    return first if len(first) <= limit else first[: limit - 3] + "..."


MAX_QUOTED_CHARS = 24  # of the client's text quoted in an error
_LONG_WORD = re.compile(r"\S{" + str(2 * MAX_QUOTED_CHARS) + ",}")
# NOTE: every quoted run, short ones too: matched from its opening quote to its closing one (or
# the end), the next is searched after it, never from a closing quote (which took the text after
# a short quote, the error's reason, for a long quote)
_QUOTED = re.compile(r"([\"'])([^\"']*)(?:\1|$)")


def _cut_quote(m: re.Match[str]) -> str:
    if len(m.group(2)) <= MAX_QUOTED_CHARS:
        return m.group(0)
    return m.group(1) + m.group(2)[:MAX_QUOTED_CHARS] + "..."


def _check(tokenizer: Any, spec: dict[str, Any], limits: Any) -> dict[str, Any]:
    import llguidance

    try:
        text = grammar_text(spec)
    except (ValueError, RuntimeError, TypeError, RecursionError) as e:
        return {"error": one_line(e)}
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    if is_error:
        return {"error": one_line(messages[0] if messages else "invalid grammar")}
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
    if matcher.is_error():
        return {"error": one_line(matcher.get_error())}
    start = time.perf_counter()
    first = _first_allowed(matcher.compute_bitmask())
    took = time.perf_counter() - start
    # NOTE: a regex over the lexer's limits (a{1000000}) gives a mask and no error; it fails
    # when a token is fed: one is, to a copy (on any machine, however fast its first mask)
    probe = matcher.deep_copy()
    if first is not None:
        probe.consume_token(first)
    for m in (matcher, probe):
        if m.is_error():
            return {"error": one_line(m.get_error())}
    if took > FIRST_MASK_LIMIT_S:
        # NOTE: the engine's thread would pay this at the request's first step (a lazily
        # expanded regex such as a{1000000}: ~1 s)
        return {
            "error": f"its first token mask took {took * 1e3:.0f} ms; the limit is "
            f"{FIRST_MASK_LIMIT_S * 1e3:.0f} ms"
        }
    return {"ok": text}


def _first_allowed(mask: bytes) -> int | None:
    """The smallest token id a mask allows, or None."""
    for i, byte in enumerate(mask):
        if byte:
            return i * 8 + (byte & -byte).bit_length() - 1
    return None


def _serve() -> None:
    """The worker: one init line (the tokenizer), then one JSON line per job, answered in
    order. Jobs run on one thread with a small stack (a crash there is this process's alone)."""
    import llguidance

    # NOTE: a slow constraint burns a core here for up to its deadline; the engine's process
    # comes first for the CPU (on 2 cores, two 80 KB GBNF grammars slowed a stream 2.3x)
    os.nice(WORKER_NICENESS)
    init = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(
        init["tokenizer_json"], n_vocab=init["n_vocab"], eos_token=init["eos"] or None
    )
    limits = llguidance.LLParserLimits(verbose_errors=False, **init.get("limits", {}))
    jobs: list[dict[str, Any]] = []
    ready = threading.Event()
    done = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        while True:
            ready.wait()
            ready.clear()
            try:
                result["r"] = _check(tokenizer, jobs.pop(), limits)
            except Exception as e:  # noqa: BLE001 - reported to the parent as the job's error
                result["r"] = {"error": one_line(f"{type(e).__name__}: {e}")}
            done.set()

    start_thread(run, "grammar-check", CHECK_STACK_BYTES)
    _write({"ready": True})
    for line in sys.stdin:
        jobs.append(json.loads(line))
        ready.set()
        done.wait()
        done.clear()
        _write(result.pop("r"))


def start_thread(target: Any, name: str, stack_bytes: int = PARENT_STACK_BYTES) -> threading.Thread:
    """Start a daemon thread whose stack is ``stack_bytes``, whatever the process default."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    with _STACK_LOCK:  # NOTE: the size applies to threads started while it is set
        previous = threading.stack_size(stack_bytes)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread


class StackPool:
    """A few threads with large stacks (``PARENT_STACK_BYTES``) and their own queue: the engine's
    process builds matchers there, and requests waiting for a grammar worker wait here, never on
    a pool that other requests need.

    Jobs wait in lanes (one a client: ``submit``'s ``lane``), taken in turn, and a lane runs at
    most ``num_threads - 1`` jobs at once: however many slow grammars one client sends, a thread
    is left for the others' (jobs without a lane, offline ones, may take every thread)."""

    def __init__(self, num_threads: int, name: str) -> None:
        # NOTE: imported here, not at the top: the worker script imports only the standard
        # library and llguidance
        from specdec.lanes import LaneCaps

        self._cond = threading.Condition()
        self._lanes: dict[Hashable, deque[tuple[Future, Callable[[], Any]]]] = {}
        self._turns: deque[Hashable] = deque()  # lanes with jobs waiting, in turn order
        self._caps = LaneCaps(num_threads)
        self._closing = False
        self._threads = [start_thread(self._run, f"{name}-{i}") for i in range(num_threads)]

    def submit(self, fn: Callable[[], _T], lane: Hashable = None) -> Future[_T]:
        future: Future[_T] = Future()
        with self._cond:
            if lane not in self._lanes:
                self._lanes[lane] = deque()
                self._turns.append(lane)
            self._lanes[lane].append((future, fn))
            self._cond.notify()
        return future

    def _next(self) -> tuple[Hashable, tuple[Future, Callable[[], Any]]] | None:
        """The first lane in turn below its cap: its oldest job (the lane goes to the back)."""
        for lane in self._turns:
            if self._caps.may_start(lane):
                jobs = self._lanes[lane]
                job = jobs.popleft()
                self._turns.remove(lane)
                if jobs:
                    self._turns.append(lane)
                else:
                    del self._lanes[lane]
                self._caps.started(lane)
                return lane, job
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while (picked := self._next()) is None:
                    if self._closing:
                        return
                    self._cond.wait()
            lane, (future, fn) = picked
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                        future.set_exception(e)
            finally:
                with self._cond:
                    self._caps.finished(lane)
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()


def _write(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# ---- the parent's side --------------------------------------------------------------------------
class WorkerGone(RuntimeError):
    """The worker died (a crash while checking) or overran its deadline; it was replaced."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _Worker:
    def __init__(self, init_line: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1 << 16,
        )  # fmt: skip
        self.proc.stdin.write(init_line)
        self.proc.stdin.flush()
        reply = self._read(START_TIMEOUT_S)
        if reply is None or not reply.get("ready"):
            self.close()
            raise RuntimeError("the grammar worker did not start")

    def _read(self, timeout: float) -> dict[str, Any] | None:
        out = self.proc.stdout
        ready, _, _ = select.select([out], [], [], max(0.0, timeout))
        if not ready:
            return None
        line = out.readline()
        return json.loads(line) if line else None

    def run(self, spec: dict[str, Any], deadline_s: float) -> dict[str, Any]:
        try:
            self.proc.stdin.write(json.dumps(spec) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerGone("the grammar worker had stopped", False) from None
        start = time.monotonic()
        reply = self._read(deadline_s)
        if reply is None:
            timed_out = self.proc.poll() is None and time.monotonic() - start >= deadline_s
            self.close()
            raise WorkerGone("the grammar worker stopped", timed_out)
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class GrammarChecker:
    """A few worker processes checking constraints (``check``), each job within a deadline.
    Workers start with ``start`` (or on first use) and are replaced when they die or overrun."""

    def __init__(
        self,
        tokenizer_json: str,
        n_vocab: int,
        eos_token_ids: list[int],
        limits: dict[str, Any] | None = None,
        num_workers: int = NUM_WORKERS,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        init = {"tokenizer_json": tokenizer_json, "n_vocab": n_vocab, "eos": eos_token_ids}
        self._init_line = json.dumps(init | {"limits": limits or {}}) + "\n"
        self.deadline_s = deadline_s
        self._idle: list[_Worker | None] = [None] * num_workers
        self._free = threading.Semaphore(num_workers)
        self._lock = threading.Lock()
        self._closed = False
        self.num_restarts = 0

    def start(self) -> None:
        """Start every worker now (each builds its tokenizer, ~0.5 s), not at the first job."""
        for _ in range(len(self._idle)):
            self._replace()

    def _replace(self) -> None:
        """Fill an empty worker slot (after a start, a crash or an overrun)."""
        try:
            worker = _Worker(self._init_line)
        except (RuntimeError, OSError):
            return  # NOTE: the next job starts one itself (and reports it if that fails too)
        with self._lock:
            if None in self._idle and not self._closed:
                self._idle[self._idle.index(None)] = worker
                return
        worker.close()

    def check(self, spec: dict[str, Any]) -> str:
        """The constraint's grammar text once a worker validated it. Raises ValueError (the
        library's one-line message) for an invalid constraint, WorkerGone for one that crashed
        or overran a worker (its replacement starts at once, in the background)."""
        with self._free:
            with self._lock:
                worker = self._idle.pop()
            try:
                worker = self._live(worker)
                reply = worker.run(spec, self.deadline_s)
            except WorkerGone:
                worker = None
                self.num_restarts += 1
                raise
            finally:
                with self._lock:
                    self._idle.append(worker)
                if worker is None:
                    start_thread(self._replace, "grammar-worker-start", 1 << 20)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["ok"]

    def _live(self, worker: _Worker | None) -> _Worker:
        """``worker``, or a new one where it never started or died while idle."""
        if worker is not None and worker.proc.poll() is None:
            return worker
        if worker is not None:
            worker.close()
        return _Worker(self._init_line)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for worker in self._idle:
                if worker is not None:
                    worker.close()
            self._idle = [None] * len(self._idle)


if __name__ == "__main__":
    _serve()
