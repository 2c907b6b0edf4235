"""Suffix decoding and a trained head in the same request (``"method": "hybrid"``), each step
taking the drafter whose drafts are expected to yield more accepted tokens (as Arctic Inference
pairs suffix decoding with its speculator).

Suffix decoding scores its own draft: the sum of its tokens' estimated probabilities, the
expected number accepted. The head's expected number is ``sum(a ** i for i in 1..k)``, with
``a`` the request's running rate of accepted head drafts (learnt from the tokens that arrive).
The head is fed the target's states every step, whichever drafter wins; when suffix decoding
wins it drafts a single token, so it stays in step at little cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.spec_decode.base import DraftInput, DraftOutput, DraftRequest, Proposer
from specdec.spec_decode.suffix import SuffixProposer

PRIOR_RATE = 0.5  # the head's acceptance rate before a request has measured it
RATE_WEIGHT = 0.2  # how much one verification moves it


@dataclass
class _Pick:
    source: str  # "suffix" | "head"
    draft_token_ids: list[int]
    start: int  # the request's token count when proposed


class HybridProposer(Proposer):
    def __init__(self, suffix: SuffixProposer, head: Proposer) -> None:
        self.suffix, self.head = suffix, head
        self.hidden_layers = head.hidden_layers
        self.rate: dict[str, float] = {}
        self.last: dict[str, _Pick] = {}
        self.num_drafted = {"suffix": 0, "head": 0}  # drafts proposed, by source

    def add_request(self, req_id: str) -> None:
        self.suffix.add_request(req_id)
        self.head.add_request(req_id)

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        self.suffix.remove_request(req_id, token_ids)
        self.head.remove_request(req_id, token_ids)
        self.rate.pop(req_id, None)
        self.last.pop(req_id, None)

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
            a = self.rate.get(r.req_id, PRIOR_RATE)
            head_expected = sum(a**i for i in range(1, r.max_num_drafts + 1))
            score = self.suffix.last_scores.get(r.req_id, 0.0) if drafts else 0.0
            suffix_wins = bool(drafts) and score >= head_expected
            use_suffix.append(suffix_wins)
            cap = min(1, r.max_num_drafts) if suffix_wins else r.max_num_drafts
            head_reqs.append(_with_cap(r, cap))
        h_out = self.head.propose(DraftInput(head_reqs))
        ids, probs = [], []
        for i, r in enumerate(inp.requests):
            if use_suffix[i]:
                source, d, q = "suffix", s_out.draft_token_ids[i], None
            else:
                source, d = "head", h_out.draft_token_ids[i]
                q = h_out.draft_probs[i] if h_out.draft_probs else None
            self.last[r.req_id] = _Pick(source, list(d), len(r.token_ids))
            self.num_drafted[source] += len(d)
            ids.append(list(d))
            probs.append(q)
        return DraftOutput(ids, probs)


def _with_cap(r: DraftRequest, cap: int) -> DraftRequest:
    d = DraftRequest(r.req_id, r.token_ids, cap, r.sampling, r.seed, r.num_prompt_tokens)
    d.hidden_states, d.hidden_start = r.hidden_states, r.hidden_start
    return d


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    from specdec.spec_decode import eagle3, suffix

    return HybridProposer(
        suffix.make(cfg, target, load_draft, max_num_seqs, max_len),
        eagle3.make(cfg, target, load_draft, max_num_seqs, max_len),
    )
