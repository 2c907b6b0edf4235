"""Edits a response makes to the text it copies, learnt as it goes, so that a copying drafter
drafts them too.

A code edit ("rename ``share`` to ``portion``", "single quotes instead of double") copies most of
its prompt with the same small change at every occurrence. A drafter that copies the prompt
(suffix decoding, prompt lookup) drafts the old text at each occurrence and loses the rest of its
draft there, then needs a few steps to find its place again. ``EditRules`` follows a response
along its prompt: while the response copies, a position in the prompt advances with it; where the
response leaves the prompt and later copies it again (three tokens in a row found a little
further on), the two spans between are a replacement, split into its smallest parts
(``difflib``), each a rule ``prompt tokens -> response tokens``. ``rewrite`` applies the rules to
a draft, so the next occurrence is drafted as the response will write it.

A rule is applied only while it has been seen more often than it was passed over (the response
copying its old tokens unchanged after it was learnt), so a change made once is not forced on the
rest of the text. Drafts are only proposals: whatever the rules get wrong costs a rejected draft
token, never a different output.
"""

from __future__ import annotations

import difflib
from array import array
from collections.abc import Iterator, Sequence

# Tokens in a row that put a response back on its prompt after it left it.
RESYNC = 3
# Farthest a response may rejoin its prompt past where it left (tokens), and longest replacement
# learnt (either side, tokens): rewriting a whole paragraph is not an edit that repeats.
WINDOW = 64
MAX_SPAN = 16
# Most rules kept per request (the first learnt stay).
MAX_RULES = 256
# How sure a guessed one-token change is (pending's estimate, for whoever weighs drafts).
GUESS_CONFIDENCE = 0.5


class EditRules:
    """One request's replacements, learnt from its response against its prompt."""

    def __init__(self, prompt: Sequence[int]) -> None:
        # NOTE: 4 bytes a token, searched with bytes.find: an index of the prompt's three-token
        # runs would cost ~100 bytes a token for every running request
        self.prompt = prompt if isinstance(prompt, array) else array("I", prompt)
        self._bytes = self.prompt.tobytes()
        self.output: list[int] = []
        self.copied = 0  # response tokens that continued the prompt where it was being copied
        self._pos: int | None = None  # the prompt position the response copies next (None: lost)
        self._left_out = 0  # where the response left the prompt: its output index...
        self._left_prompt: int | None = None  # ...and the prompt position it left at
        # rules by their first prompt token: (old, new) -> [times seen, times passed over]
        self._rules: dict[int, dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]] = {}
        self._num_rules = 0
        # the same rules' counts by their last old token (what _passed looks up per copied token)
        self._by_last: dict[int, list[tuple[tuple[int, ...], list[int]]]] = {}

    @property
    def num_rules(self) -> int:
        return self._num_rules

    def rules(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
        """Every rule as (old, new, seen, passed over)."""
        return [(o, n, c[0], c[1]) for d in self._rules.values() for (o, n), c in d.items()]

    def update(self, seq: Sequence[int], start: int = 0) -> None:
        """Follow the response's new tokens (``seq[start:]``: the whole response so far; an
        offset, so that a drafter passes its prompt + output without copying it every step)."""
        n = len(self.output)
        if len(seq) - start < n or (n and seq[start + n - 1] != self.output[-1]):
            self.__init__(self.prompt)  # NOTE: not an extension of what was seen: start over
        for i in range(start + len(self.output), len(seq)):
            self.output.append(seq[i])
            self._step()

    def _step(self) -> None:
        i = len(self.output) - 1
        t = self.output[i]
        if self._pos is not None:
            if self._pos < len(self.prompt) and self.prompt[self._pos] == t:
                self._pos += 1
                self.copied += 1
                self._passed(self._pos)
                return
            self._left_out, self._left_prompt, self._pos = i, self._pos, None
        if i + 1 < RESYNC:
            return
        gram = self.output[i + 1 - RESYNC : i + 1]
        lo = self._left_prompt
        if lo is None:  # never on the prompt yet: join it at the first occurrence
            first = next(self._find(gram, 0, len(self.prompt)), None)
            if first is not None:
                self._pos = first + RESYNC
            return
        # NOTE: the occurrence nearest where a change of the same length would rejoin: code repeats
        # its three-token runs, and the first one past the change is often not its own
        expect = lo + (i + 1 - RESYNC - self._left_out)
        near = list(self._find(gram, lo, lo + WINDOW + 1))
        if not near:
            return
        s = min(near, key=lambda s: (abs(s - expect), s))
        old = self.prompt[lo:s].tolist()
        new = self.output[self._left_out : i + 1 - RESYNC]
        if len(old) <= MAX_SPAN and len(new) <= MAX_SPAN:
            self._learn(old, new)
        self._pos = s + RESYNC

    def _find(self, gram: Sequence[int], lo: int, hi: int) -> Iterator[int]:
        """Prompt positions s in [lo, hi) where ``gram`` starts, in order."""
        pattern = array("I", gram).tobytes()
        at, end = 4 * lo, 4 * (hi - 1) + len(pattern)
        while True:
            k = self._bytes.find(pattern, at, end)
            if k < 0:
                return
            if k % 4 == 0:
                yield k // 4
            at = k + 1

    def _learn(self, old: list[int], new: list[int]) -> None:
        """The replacement old -> new as rules: the whole (less what both sides start and end
        with) and each smallest part, so that ``inv_freq -> inverse_frequencies`` is one rule
        while ``"a", "b" -> 'a', 'b'`` also teaches each quote's own."""
        a = 0
        while a < len(old) and a < len(new) and old[a] == new[a]:
            a += 1
        e = 0
        while e < min(len(old), len(new)) - a and old[-1 - e] == new[-1 - e]:
            e += 1
        keys = []
        if a < len(old) - e:  # NOTE: insertions have no old tokens to find in a draft
            keys.append((tuple(old[a : len(old) - e]), tuple(new[a : len(new) - e])))
        matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
        for op, a0, a1, b0, b1 in matcher.get_opcodes():
            if op == "replace":
                keys.append((tuple(old[a0:a1]), tuple(new[b0:b1])))
        for key in dict.fromkeys(keys):
            by_first = self._rules.setdefault(key[0][0], {})
            if key in by_first:
                by_first[key][0] += 1
            elif self._num_rules < MAX_RULES:
                counts = by_first[key] = [1, 0]
                self._by_last.setdefault(key[0][-1], []).append((key[0], counts))
                self._num_rules += 1

    def _passed(self, end: int) -> None:
        """The response copied the prompt up to ``end``: a rule whose old tokens end there was
        passed over."""
        for old, counts in self._by_last.get(self.prompt[end - 1], ()):
            n = len(old)
            if end >= n and tuple(self.prompt[end - n : end]) == old:
                counts[1] += 1

    def pending(self, limit: int, guess: bool = False) -> tuple[list[int], float] | None:
        """Where the response has left its prompt for a rule's new tokens (a draft cut at their
        first token leaves a copying drafter lost there): the rest of them, then the prompt after
        the rule's old tokens, rewritten, up to ``limit`` tokens, and how sure that is (the
        rule's seen / (seen + passed over + 1)). With ``guess``, and no rule that fits, the
        prompt after the one token the response left it at (a change of one token, the
        commonest edit, before its rule is learnt; GUESS_CONFIDENCE). None elsewhere."""
        lo = self._left_prompt
        if self._pos is not None or lo is None or lo >= len(self.prompt) or limit <= 0:
            return None
        done = tuple(self.output[self._left_out :])
        if len(done) > MAX_SPAN:
            return None
        best: tuple[tuple[int, ...], tuple[int, ...], float] | None = None
        for (old, new), (seen, passed) in self._rules.get(self.prompt[lo], {}).items():
            if (
                seen > passed
                and len(done) <= len(new)
                and done == new[: len(done)]
                and tuple(self.prompt[lo : lo + len(old)]) == old
                and (best is None or len(old) > len(best[0]))
            ):
                best = (old, new, seen / (seen + passed + 1))
        if best is None:
            # NOTE: only for a response that has mostly been copying its prompt: elsewhere (a
            # chat that quoted three tokens of its prompt) a guess is a wasted draft
            if not guess or not done or 2 * self.copied < len(self.output):
                return None
            best = ((self.prompt[lo],), done, GUESS_CONFIDENCE)
        old, new, sure = best
        after = self.prompt[lo + len(old) : lo + len(old) + limit + MAX_SPAN].tolist()
        return (list(new[len(done) :]) + self.rewrite(after, limit)[0])[:limit], sure

    def rewrite(self, draft: Sequence[int], limit: int) -> tuple[list[int], list[int]]:
        """The draft with the rules applied (longest old tokens first), cut to ``limit`` tokens,
        and for each of its tokens the index of the draft token it stands for."""
        out: list[int] = []
        src: list[int] = []
        j = 0
        while j < len(draft) and len(out) < limit:
            rule = None
            for (old, new), (seen, passed) in self._rules.get(draft[j], {}).items():
                if seen > passed and tuple(draft[j : j + len(old)]) == old:
                    if rule is None or len(old) > len(rule[0]):
                        rule = (old, new)
            if rule is None:
                out.append(draft[j])
                src.append(j)
                j += 1
                continue
            for t in rule[1]:
                out.append(t)
                src.append(j)
            j += len(rule[0])
        return out[:limit], src[:limit]
