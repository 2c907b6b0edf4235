"""Grammar-constrained decoding on llguidance: compile a request's constraint, follow its output,
give the token mask of each verification row, cut drafts the grammar rejects, and propose the
tokens the grammar forces.

Why llguidance (measured on the 2-core Xeon, 2026-11-24: `git show
5196d6d:BENCHMARKS.md`, structured output): its masks cost
~60 us per token for a nested JSON schema over SmolLM2's 49k vocabulary on this CPU, with no
grammar-compile step worth caching (~1 ms for a schema); it has a rollback, a prefix check of
draft tokens (``validate_tokens``) and the forced tokens we draft, and its wheel needs
nothing else (xgrammar's needs transformers and triton at run time).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import threading
import time
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdec.structured import compile_worker
from specdec.structured.compile_worker import one_line
from specdec.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from specdec.model.tokenizer import Tokenizer

MAX_FORCED_DRAFTS = 32  # grammar-forced drafts per step, at most
# llguidance's per-step limits (its defaults but for the Earley items of one mask: 50,000 let an
# ambiguous 22-byte grammar cost ~70 ms per token; past the limit the request fails alone)
LIMITS: dict[str, Any] = {"step_max_items": 20_000}
# NOTE: a JSON schema's mask costs ~0.06 ms a token on SmolLM2's 49k vocabulary; a grammar may
# spend this much engine time (masks, draft checks) before its request fails alone
MASK_BUDGET_S = 0.25
MASK_BUDGET_PER_TOKEN_S = 0.002
_CHECKERS: dict[tuple, compile_worker.GrammarChecker] = {}
_POOL: compile_worker.StackPool | None = None
_POOL_LOCK = threading.Lock()


def _compile_pool() -> compile_worker.StackPool:
    """The process's grammar threads (one pool for every engine, like the workers)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = compile_worker.StackPool(compile_worker.NUM_WORKERS, "grammar")
        return _POOL


@atexit.register
def _close_checkers() -> None:
    for checker in _CHECKERS.values():
        checker.close()


def limits() -> llguidance.LLParserLimits:
    """The parser limits every matcher gets (no parser state or grammar in its errors)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False, **LIMITS)


class GrammarError(ValueError):
    """The request's constraint does not compile; the message names the field (one line)."""

    def __init__(self, message: str) -> None:
        lines = [x.strip() for x in message.splitlines()]
        # NOTE: the library points at the error with a caret line under the source
        super().__init__("; ".join(x for x in lines if x and set(x) - set("^ ~")))


@dataclass
class TokenMask:
    """The tokens each verification row may take: row r follows the output plus drafts[:r]."""

    rows: list[bytes]  # per row, one bit per token id (little-endian within each byte)
    vocab_size: int

    def allows(self, row: int, token: int) -> bool:
        if token >= self.vocab_size:
            return False
        return bool(self.rows[row][token >> 3] >> (token & 7) & 1)

    def allowed(self, row: int, device: torch.device) -> torch.Tensor:  # [V] bool
        bits = np.unpackbits(np.frombuffer(self.rows[row], dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].view(np.bool_)).to(device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, V], R <= len(rows)
        """-inf where the grammar forbids the token."""
        out = logits.clone()
        for r in range(logits.shape[0]):
            out[r].masked_fill_(~self.allowed(r, logits.device), float("-inf"))
        return out


def constraint_spec(params: StructuredOutputsParams) -> dict[str, Any]:
    """The constraint as the grammar worker takes it (plain JSON)."""
    kind = params.kind
    return {
        "kind": kind,
        "value": getattr(params, kind),
        "disable_any_whitespace": params.disable_any_whitespace,
        "whitespace_pattern": params.whitespace_pattern,
        "disable_additional_properties": params.disable_additional_properties,
    }


# NOTE: slow constraints are large (a 0.9 MB enum schema: 0.64 s to compile, an 800-property
# schema 0.1 s; a one-property object schema under 5 ms; SmolLM2's tokenizer, 2-core Xeon)
SMALL_CONSTRAINT_CHARS = 8192


def constraint_chars(params: StructuredOutputsParams | dict[str, Any]) -> int:
    """The constraint's size in characters (its JSON text for a schema)."""
    params = StructuredOutputsParams.from_any(params)
    value = getattr(params, params.kind)
    if isinstance(value, str):
        return len(value)
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError):
        return SMALL_CONSTRAINT_CHARS + 1  # NOTE: not plain JSON: the worker refuses it anyway


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as llguidance's grammar, in this process (raises GrammarError naming the
    field). NOTE: unchecked constraints may crash the process; ``GrammarCompiler`` checks them
    in a worker first."""
    try:
        return compile_worker.grammar_text(constraint_spec(params))
    except (ValueError, RuntimeError, TypeError) as e:
        raise GrammarError(f"structured_outputs.{params.kind}: {one_line(e)}") from None


class GrammarCompiler:
    """One per engine: the tokenizer llguidance reads (built once, ~1 s) and compilation."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._llg: llguidance.LLTokenizer | None = None
        self._checker: compile_worker.GrammarChecker | None = None
        self._source: str | None = None  # the tokenizer's JSON until both users have it
        self._lock = threading.Lock()

    def _tokenizer_source(self) -> str:
        """(Under the lock.) The tokenizer's JSON, made once for llguidance and the checker.

        NOTE: a compact tokenizer (Gemma's) builds the library's tokenizer to write it (~2 s);
        it is dropped once both have theirs (``_drop_source``)."""
        if self._source is None:
            self._source = self._tokenizer.to_str()
        return self._source

    def _drop_source(self) -> None:
        if self._llg is not None and self._checker is not None:
            self._source = None

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg is None:
                import llguidance

                self._llg = llguidance.LLTokenizer(
                    self._tokenizer_source(),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos or None,
                )
                self._drop_source()
            return self._llg

    def start(self) -> None:
        """Build the tokenizer tables and start the grammar workers now (a server does, before
        it reports healthy), not at the first structured request, which every stream and
        /health would then wait for (the tables hold the GIL ~0.3 s)."""
        self.llg_tokenizer  # noqa: B018
        self.checker.start()
        _compile_pool()

    def submit(
        self, params: StructuredOutputsParams | dict[str, Any], lane: Hashable = None
    ) -> Future[Grammar]:
        """``compile`` on the compiler's own threads: stacks 4x the worker's check thread's,
        and a queue of its own (a request waiting for a grammar worker holds no other pool).
        ``lane``: the client's (compile_worker.StackPool: one client's slow grammars never hold
        every thread); its large constraints queue apart from its small ones, so a small one
        never waits behind a large one's compile."""
        if lane is not None:
            lane = (lane, "large" if constraint_chars(params) > SMALL_CONSTRAINT_CHARS else "small")
        return _compile_pool().submit(lambda: self._compile(params), lane)

    def compile(self, params: StructuredOutputsParams | dict[str, Any]) -> Grammar:
        """A fresh grammar state for one request (a copy of ``params.compiled`` when set). The
        constraint is checked in a worker process first (see compile_worker)."""
        return self.submit(params).result()

    def _compile(self, params: StructuredOutputsParams | dict[str, Any]) -> Grammar:
        import llguidance

        params = StructuredOutputsParams.from_any(params)
        if isinstance(params.compiled, Grammar):
            return params.compiled.fork()
        params.validate()
        where = f"structured_outputs.{params.kind}"
        try:
            text = self.checker.check(constraint_spec(params))
        except compile_worker.WorkerGone as e:
            raise GrammarError(f"{where}: {self._gone(e)}") from None
        except ValueError as e:
            raise GrammarError(f"{where}: {one_line(e)}") from None
        matcher = llguidance.LLMatcher(self.llg_tokenizer, text, log_level=0, limits=limits())
        if matcher.is_error():
            raise GrammarError(f"{where}: {one_line(matcher.get_error())}")
        return Grammar(matcher, self.llg_tokenizer, self.vocab_size, self._eos, params.kind)

    def _gone(self, e: compile_worker.WorkerGone) -> str:
        if e.timed_out:
            return f"the constraint takes longer than the {self.checker.deadline_s:g} s limit to compile"
        return (
            "the constraint is nested or chained too deeply to compile (the limit is what "
            f"{compile_worker.CHECK_STACK_BYTES >> 20} MiB of the grammar library's stack holds)"
        )

    @property
    def checker(self) -> compile_worker.GrammarChecker:
        """The worker processes that check constraints, shared by engines of one tokenizer."""
        with self._lock:
            if self._checker is None:
                source = self._tokenizer_source()
                digest = hashlib.sha256(source.encode()).hexdigest()
                key = (digest, self.vocab_size, tuple(self._eos))
                self._checker = _CHECKERS.get(key)
                if self._checker is None:
                    self._checker = compile_worker.GrammarChecker(
                        source, self.vocab_size, self._eos, LIMITS
                    )
                    _CHECKERS[key] = self._checker
                self._drop_source()
            return self._checker


class Grammar:
    """One request's grammar state; it follows the committed output token by token.

    Drafts are explored on the same matcher (consume, then roll back), never past an
    end-of-generation token. NOTE: llguidance 1.9.1 does not restore a matcher rolled back over
    a consumed end token: ``consume_token(eos); rollback(1)`` leaves a state in which the same
    output fails later (``ParserTooComplex``; one n-gram draft ending in EOS then broke the
    committed output). An end token finishes the request anyway, so nothing after it is needed.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        kind: str = "grammar",
    ) -> None:
        self._m = matcher
        self._tok = tokenizer
        self.vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)
        self._all_allowed = b"\xff" * ((vocab_size + 7) // 8)
        self.kind = kind  # the constraint's field: json, regex, grammar, ...
        # CPU time of the engine's thread in masks and draft checks, charged to this request.
        # NOTE: not wall time: on a busy machine (load 6 on 2 cores here) the thread waits for a
        # core inside these calls, and that wait is no cost of this request's grammar
        self.spent_s = 0.0
        self.num_accepted = 0

    def fork(self) -> Grammar:
        """An independent copy in the same state (its own budget)."""
        eos = tuple(self._eos)
        return Grammar(self._m.deep_copy(), self._tok, self.vocab_size, eos, self.kind)

    def failure(self) -> str | None:
        """Why the request cannot go on (one line naming the field and the limit), or None: the
        library gave up on the grammar (a per-step limit), or the grammar has cost more than
        its budget of engine time (``MASK_BUDGET_S`` + ``MASK_BUDGET_PER_TOKEN_S`` a token)."""
        where = f"structured_outputs.{self.kind}"
        if self._m.is_error():
            return f"{where}: the grammar library gave up on it ({one_line(self._m.get_error())})"
        budget = MASK_BUDGET_S + MASK_BUDGET_PER_TOKEN_S * self.num_accepted
        if self.spent_s > budget:
            return (
                f"{where}: the grammar costs more engine time than its budget of "
                f"{MASK_BUDGET_S:g} s + {MASK_BUDGET_PER_TOKEN_S * 1e3:g} ms a token"
            )
        return None

    def _until_end(self, draft_token_ids: list[int]) -> tuple[list[int], bool]:
        """The drafts up to the first end token (excluded), and whether one was there."""
        for i, tok in enumerate(draft_token_ids):
            if tok in self._eos:
                return draft_token_ids[:i], True
        return draft_token_ids, False

    # ---- the committed output ----------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """Follow one committed token; False when the grammar does not allow it."""
        self.num_accepted += 1
        return self._m.consume_token(token)

    @property
    def is_finished(self) -> bool:
        """Nothing more may follow (the output is complete)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    # ---- drafts --------------------------------------------------------------------------------
    def valid_prefix(self, draft_token_ids: list[int]) -> int:
        """How many of the drafts the grammar allows, in order (none after an end token)."""
        start = time.thread_time()
        try:
            return self._valid_prefix(draft_token_ids)
        finally:
            self.spent_s += time.thread_time() - start

    def _valid_prefix(self, draft_token_ids: list[int]) -> int:
        body, ends = self._until_end(draft_token_ids)
        n = self._m.validate_tokens(body) if body else 0
        if n < len(body) or not ends:
            return n
        return n + 1 if self._allows_after(body, draft_token_ids[n]) else n

    def _allows_after(self, draft_token_ids: list[int], token: int) -> bool:
        """Whether the mask after the (valid) drafts allows ``token``. NOTE: for end tokens,
        which ``validate_tokens`` does not count even where the mask allows them (llguidance
        1.9.1: 0 for an end after a complete JSON object), and which must not be consumed."""
        if draft_token_ids:
            self._m.consume_tokens(draft_token_ids)
        try:
            return TokenMask([self._m.compute_bitmask()], self.vocab_size).allows(0, token)
        finally:
            if draft_token_ids:
                self._m.rollback(len(draft_token_ids))

    def forced_after(self, draft_token_ids: list[int], limit: int) -> list[int]:
        """The tokens the grammar forces after the drafts (a schema's next key, a closing
        brace), at most ``limit``. NOTE: llguidance's fast-forward tokens, which leave out a
        last token that a longer token could extend: drafting every forced byte's token was
        measured right 97 of 254 times on JSON extraction, these 78 of 78."""
        if limit <= 0 or self._m.is_stopped() or self._until_end(draft_token_ids)[1]:
            return []
        start = time.thread_time()
        try:
            return self._forced_after(draft_token_ids, limit)
        finally:
            self.spent_s += time.thread_time() - start

    def _forced_after(self, draft_token_ids: list[int], limit: int) -> list[int]:
        if draft_token_ids and not self._m.consume_tokens(draft_token_ids):
            raise AssertionError(f"drafts outside the grammar: {self._m.get_error()}")
        try:
            return self._m.compute_ff_tokens()[:limit]
        finally:
            if draft_token_ids:
                self._m.rollback(len(draft_token_ids))

    def masks(self, draft_token_ids: list[int]) -> TokenMask:
        """The mask of each verification row: row r after the output plus drafts[:r]. The rows
        stop after the first draft the grammar forbids (those drafts are not to be verified).
        The row after an allowed end token is never committed (the output ends there): it
        allows every token, and the end token itself is not fed to the matcher."""
        n = self.valid_prefix(draft_token_ids)
        start = time.thread_time()
        try:
            return self._masks(draft_token_ids, n)
        finally:
            self.spent_s += time.thread_time() - start

    def _masks(self, draft_token_ids: list[int], n: int) -> TokenMask:
        ends = n > 0 and draft_token_ids[n - 1] in self._eos
        body = n - 1 if ends else n
        rows = [self._m.compute_bitmask()]
        for r in range(body):
            self._m.consume_token(draft_token_ids[r])
            rows.append(self._m.compute_bitmask())
        if body:
            self._m.rollback(body)
        if ends:
            rows.append(self._all_allowed)
        return TokenMask(rows, self.vocab_size)
