"""Drafting with a model: a separate small model (``draft_model``) or the target's own first
layers (``layer_skip``, self-speculation sharing the target's weights).

The drafter keeps its own KV cache per request. Before drafting it rolls the cache back to the
longest prefix it shares with the request's tokens (rejected drafts fall away, no copy) and
catches up on whatever is new, then runs k autoregressive steps for all requests in one batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.model.llama import LlamaModel, SeqBatch
from specdec.sample.ops import argmax_rows, one_thread, processed_logits
from specdec.sample.random import Purpose, uniform
from specdec.sample.sampler import sample_row_and_probs
from specdec.spec_decode.base import DraftInput, DraftOutput, DraftRequest, Proposer


@dataclass
class _DraftState:
    slot: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV the drafter holds


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: LlamaModel,
        max_num_seqs: int,
        max_len: int,
        num_layers: int | None = None,
        sample_method: str = "greedy",
    ) -> None:
        self.model = model
        self.sample_method = sample_method  # greedy | probabilistic
        self.num_layers = num_layers
        self.kv = model.make_kv_cache(max_num_seqs, max_len, num_layers)
        self.max_len = max_len
        self.states: dict[str, _DraftState] = {}

    def measure_cost(self, context: int = 64, repeats: int = 5) -> tuple[float, float] | None:
        """A prefill of ``context`` tokens (the catch-up's price per token), then one-token
        steps with their logits and argmax (a draft's); the fastest of the repeats of each.

        NOTE: until timed, the controller priced drafts at nothing, and the default layer_skip
        (28 of SmolLM2's 30 layers: ~0.9 of a target step per draft, which never pays) drafted
        at the start of every engine: held-out chat ran at 0.92x plain (2-core AVX2 EPYC, 2026-11-27).
        """
        context = min(context, self.max_len - repeats - 1)
        if context < 1:
            return None
        device = self.model.device
        ids = torch.zeros(context + repeats, dtype=torch.long, device=device)
        slot = self.kv.allocate()
        try:
            prefill = step = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                self._timed_forward(ids[:context], 0, slot)
                prefill = min(prefill, time.perf_counter() - start)
            for i in range(repeats):
                start = time.perf_counter()
                self._timed_forward(ids[context + i : context + i + 1], context + i, slot)
                step = min(step, time.perf_counter() - start)
        finally:
            self.kv.free(slot)
        return 1000.0 * step, 1000.0 * prefill / context

    def _timed_forward(self, ids: torch.Tensor, start: int, slot: int) -> None:
        n = ids.shape[0]
        pos = torch.arange(start, start + n, device=self.model.device)
        hidden = self.model.forward(
            ids, pos, SeqBatch([slot], [start], [n]), self.kv, num_layers=self.num_layers
        )
        argmax_rows(self.model.compute_logits(hidden[-1:]))

    def remove_request(self, req_id: str, token_ids: list[int] | None = None) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.kv.free(state.slot)

    def propose(self, inp: DraftInput) -> DraftOutput:
        active = [
            r
            for r in inp.requests
            if r.max_num_drafts > 0 and len(r.token_ids) + r.max_num_drafts <= self.max_len
        ]
        drafts: dict[str, list[int]] = {r.req_id: [] for r in active}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in active}
        feed = {r.req_id: self._catch_up(r) for r in active}
        for _ in range(max((r.max_num_drafts for r in active), default=0)):
            live = [r for r in active if len(drafts[r.req_id]) < r.max_num_drafts]
            if not live:
                break
            logits = self._forward(live, [feed[r.req_id] for r in live])  # [len(live), V]
            draw_rows(logits, live, drafts, probs, self.sample_method)
            for r in live:
                feed[r.req_id] = [drafts[r.req_id][-1]]
        out_ids, out_probs = [], []
        for r in inp.requests:
            ids = drafts.get(r.req_id, [])
            out_ids.append(ids)
            qs = probs.get(r.req_id, [])
            out_probs.append(torch.cat(qs, dim=0) if qs and len(qs) == len(ids) else None)
        for r in active:
            # The last draft was never fed: the cache holds the tokens plus all drafts but the last.
            self.states[r.req_id].cached = list(r.token_ids) + drafts[r.req_id][:-1]
        return DraftOutput(out_ids, out_probs)

    def _catch_up(self, r: DraftRequest) -> list[int]:
        """Roll the draft cache back to the shared prefix; return the tokens still to feed."""
        state = self.states.get(r.req_id)
        if state is None:  # NOTE: slots are taken on first draft: only running requests draft.
            state = self.states[r.req_id] = _DraftState(self.kv.allocate())
        keep = _common_prefix(state.cached, r.token_ids)
        keep = min(keep, len(r.token_ids) - 1)  # always feed at least the last token
        state.cached = state.cached[:keep]
        return list(r.token_ids[keep:])

    def _forward(self, reqs: list[DraftRequest], feeds: list[list[int]]) -> torch.Tensor:
        slots, starts, counts, ids, pos = [], [], [], [], []
        for r, tokens in zip(reqs, feeds):
            state = self.states[r.req_id]
            start = len(state.cached)
            slots.append(state.slot)
            starts.append(start)
            counts.append(len(tokens))
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            state.cached.extend(tokens)
        device = self.model.device
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device),
            SeqBatch(slots, starts, counts),
            self.kv,
            num_layers=self.num_layers,
        )
        last_rows = torch.tensor(counts, device=device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last_rows])


def draw_rows(
    logits: torch.Tensor,  # [len(reqs), V]
    reqs: list[DraftRequest],
    drafts: dict[str, list[int]],
    probs: dict[str, list[torch.Tensor]],
    sample_method: str,
) -> None:
    """One more draft per request from its row of ``logits`` (and its q when sampled)."""
    for row, r in enumerate(reqs):
        position = r.next_position + len(drafts[r.req_id])
        token, q = draw_draft(logits[row : row + 1], r, position, drafts[r.req_id], sample_method)
        drafts[r.req_id].append(token)
        if q is not None:
            probs[r.req_id].append(q)


def draw_draft(
    logits: torch.Tensor,  # [1, V]
    r: DraftRequest,
    position: int,
    earlier: list[int],
    sample_method: str,
) -> tuple[int, torch.Tensor | None]:
    """The draft for output position ``position``, and q [1, V] when it was sampled from q
    (``probabilistic``: Leviathan/Chen acceptance); otherwise the drafter's argmax, a point mass
    that verification accepts iff the target samples it. ``earlier``: this step's drafts so far.

    NOTE: a third way was measured and dropped: drafting what the target's sampler would
    pick from q with the target's own uniform (a point mass, so still plain's text). On
    SmolLM2 it accepted slightly fewer drafts than the argmax (layer_skip T=0.7: 0.263 vs
    0.266; draft_model q4_0 T=1.0: 0.241 vs 0.278): inverse-CDF coupling is poor when p and
    q rank their top tokens differently.
    """
    sp = r.sampling
    if sp.is_greedy or sample_method == "greedy":
        return argmax_rows(logits)[0], None
    with one_thread(logits.device):
        mask = counts = None
        if sp.has_penalties:  # q sees the penalties the target applies at this position
            mask, counts = _penalty_inputs(r, earlier, logits.shape[-1], logits.device)
        z = processed_logits(logits, sp, mask, counts)[0]  # [V]
        token, q = sample_row_and_probs(z, sp, uniform(r.seed, position, Purpose.DRAFT))
        return token, q.unsqueeze(0)


def _penalty_inputs(
    r: DraftRequest, earlier: list[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt mask [V] bool, output counts [1, V]) after ``earlier`` drafts, as the target's
    verification row for that position sees them."""
    ids = torch.tensor(r.token_ids, dtype=torch.long, device=device)
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[ids[: r.num_prompt_tokens]] = True
    out = torch.cat(
        [ids[r.num_prompt_tokens :], torch.tensor(earlier, dtype=torch.long, device=device)]
    )
    counts = torch.bincount(out, minlength=vocab).to(torch.float32).unsqueeze(0)
    return mask, counts


def make(cfg, target, load_draft, max_num_seqs: int, max_len: int) -> Proposer:
    return DraftModelProposer(
        load_draft(cfg), max_num_seqs, max_len, sample_method=cfg.draft_sample_method
    )
