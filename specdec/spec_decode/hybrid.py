"""Suffix decoding and a trained head in the same request (``"method": "hybrid"``), each step
taking the drafter whose drafts are expected to yield more accepted tokens (as Arctic Inference
pairs suffix decoding with its speculator).

Suffix decoding scores its own draft: the sum of its tokens' estimated probabilities, the
expected number accepted. The head's expected number is ``sum(a ** i for i in 1..k)``, with
``a`` the request's running rate of accepted head drafts (learnt from the tokens that arrive).
Suffix decoding drafts up to its own cap (``SUFFIX_CAP``, its default ``num_speculative_tokens``);
the head drafts at most ``num_speculative_tokens``. Drafts cost next to nothing (suffix trees, a
native head), so the controller only decides whether to draft (``free_drafts``). While suffix
decoding wins, the head is not run: the target's states it has not read wait here and it reads
them all in one step the next time it drafts (one step over n rows costs about one over one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdec.spec_decode.base import DraftInput, DraftOutput, DraftRequest, Proposer
from specdec.spec_decode.suffix import SuffixProposer

PRIOR_RATE = 0.5  # the head's acceptance rate before a request has measured it
RATE_WEIGHT = 0.2  # how much one verification moves it
SUFFIX_CAP = 32  # suffix decoding's default num_speculative_tokens
STASH_ROWS = 256  # past this many unread target states the head reads them (drafting one)


@dataclass
class _Pick:
    source: str  # "suffix" | "head"
    draft_token_ids: list[int]
    start: int  # the request's token count when proposed


class HybridProposer(Proposer):
    free_drafts = True

    def __init__(self, suffix: SuffixProposer, head: Proposer, head_k: int) -> None:
        self.suffix, self.head, self.head_k = suffix, head, head_k
        self.max_drafts = max(SUFFIX_CAP, head_k)
        self.hidden_layers = head.hidden_layers
        self.rate: dict[str, float] = {}
        self.last: dict[str, _Pick] = {}
        self.num_drafted = {"suffix": 0, "head": 0}  # drafts proposed, by source
        self.stash: dict[str, tuple[int, torch.Tensor]] = {}  # states the head has not read

    def add_request(self, req_id: str) -> None:
        self.suffix.add_request(req_id)
        self.head.add_request(req_id)

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        self.suffix.remove_request(req_id, token_ids)
        self.head.remove_request(req_id, token_ids)
        self.rate.pop(req_id, None)
        self.last.pop(req_id, None)
        self.stash.pop(req_id, None)

    def reset_cache(self) -> None:
        self.suffix.reset_cache()
        self.head.reset_cache()

    def _learn(self, r: DraftRequest) -> None:
        pick = self.last.pop(r.req_id, None)
        if pick is None or pick.source != "head" or not pick.draft_token_ids:
            return
        arrived = r.token_ids[pick.start :]
        m = 0
        while (
            m < len(pick.draft_token_ids)
            and m < len(arrived)
            and arrived[m] == pick.draft_token_ids[m]
        ):
            m += 1
        # NOTE: per draft position, as if each were accepted with the same chance a
        observed = m / (m + 1) if m < len(pick.draft_token_ids) else 1.0
        rate = self.rate.get(r.req_id, PRIOR_RATE)
        self.rate[r.req_id] = rate + RATE_WEIGHT * (observed - rate)

    def propose(self, inp: DraftInput) -> DraftOutput:
        for r in inp.requests:
            self._learn(r)
        s_out = self.suffix.propose(inp)
        head_reqs, use_suffix = [], []
        for r, drafts in zip(inp.requests, s_out.draft_token_ids):
            k = min(r.max_num_drafts, self.head_k)
            a = self.rate.get(r.req_id, PRIOR_RATE)
            head_expected = sum(a**i for i in range(1, k + 1))
            score = self.suffix.last_scores.get(r.req_id, 0.0) if drafts else 0.0
            suffix_wins = bool(drafts) and score >= head_expected
            use_suffix.append(suffix_wins)
            start, rows = self._unread(r)
            if suffix_wins and (rows is None or rows.shape[0] < STASH_ROWS):
                if rows is not None:
                    self.stash[r.req_id] = (start, rows)
                continue
            head_reqs.append(_with_cap(r, min(1, k) if suffix_wins else k, start, rows))
        h_out = self.head.propose(DraftInput(head_reqs)) if head_reqs else None
        head_drafts = {} if h_out is None else {
            d.req_id: (ids, h_out.draft_probs[i] if h_out.draft_probs else None)
            for i, (d, ids) in enumerate(zip(head_reqs, h_out.draft_token_ids))
        }  # fmt: skip
        ids, probs = [], []
        for i, r in enumerate(inp.requests):
            if use_suffix[i]:
                source, d, q = "suffix", s_out.draft_token_ids[i], None
            else:
                source, (d, q) = "head", head_drafts[r.req_id]
            self.last[r.req_id] = _Pick(source, list(d), len(r.token_ids))
            self.num_drafted[source] += len(d)
            ids.append(list(d))
            probs.append(q)
        return DraftOutput(ids, probs)

    def _unread(self, r: DraftRequest) -> tuple[int, torch.Tensor | None]:
        """The target states the head has not read: those kept here, then the request's own
        (contiguous; a gap drops what was kept, as the head would)."""
        start, rows = r.hidden_start, r.hidden_states
        kept = self.stash.pop(r.req_id, None)
        if kept is None:
            return start, rows
        k_start, k_rows = kept
        if rows is None or rows.shape[0] == 0:
            return k_start, k_rows
        if k_start + k_rows.shape[0] != start:
            return start, rows
        return k_start, torch.cat([k_rows, rows.to(k_rows.dtype)])


def _with_cap(r: DraftRequest, cap: int, start: int, rows: torch.Tensor | None) -> DraftRequest:
    d = DraftRequest(r.req_id, r.token_ids, cap, r.sampling, r.seed, r.num_prompt_tokens)
    d.hidden_states, d.hidden_start = rows, start
    return d


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    from specdec.spec_decode import eagle3, suffix

    # suffix decoding keeps its own cap; num_speculative_tokens bounds the head
    own = dataclasses.replace(
        cfg, num_speculative_tokens=max(SUFFIX_CAP, cfg.num_speculative_tokens)
    )
    return HybridProposer(
        suffix.make(own, target, load_draft, max_num_seqs, max_len),
        eagle3.make(cfg, target, load_draft, max_num_seqs, max_len),
        cfg.num_speculative_tokens,
    )
