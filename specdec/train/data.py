"""Training data for drafter heads, by self-distillation: the target's own responses, its hidden
states and its next-token distributions.

``collect`` writes shards of records to a folder:

* ``shard-{i:04d}/tokens.npy`` int32 [N]: every sequence's prompt + response, back to back;
* ``starts.npy`` int64 [S + 1] and ``prompt_lens.npy`` int32 [S]: where sequences begin and how
  many of their tokens are prompt (the loss covers response positions);
* ``aux.npy`` float16 [N, 3 H]: the states entering the target's EAGLE-3 layers;
* ``final.npy`` float16 [N, H]: the final normed states (EAGLE, Medusa);
* ``topk_ids.npy`` int32 / ``topk_probs.npy`` float16 [N, K]: the target's next-token
  distribution at each position, its K likeliest tokens (soft labels).

Shards are memory-mapped when read (``TrainData``). Prompts come from a JSONL file of the user's,
or, by default, from the target itself: a chat model given only its template's opening of a user
turn writes one (the "Magpie" trick, Xu et al., 2024), deduplicated and filtered by length.
NOTE: never point this at a benchmark's prompts; heads are measured on prompts they never saw.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.model.llama import HIDDEN_FINAL, SeqBatch
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.eagle3 import default_aux_layers

SHARD_TOKENS = 200_000
TOP_K = 20
USER_MARK = "\x00USER\x00"


def magpie_prompts(
    llm, num: int, seed: int = 0, max_tokens: int = 96, seen: set[str] | None = None
) -> list[str]:
    """``num`` distinct user turns the target writes itself after its template's user opening
    (distinct from ``seen`` too, which collects them)."""
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": USER_MARK}], add_generation_prompt=False
    )
    opening = tok.encode(rendered[: rendered.index(USER_MARK)])
    seen = set() if seen is None else seen
    out: list[str] = []
    attempt = 0
    while len(out) < num and attempt < 12:
        want = num - len(out)
        params = [
            SamplingParams(
                temperature=1.0,
                top_p=0.95,
                max_tokens=max_tokens,
                seed=seed + attempt * 1_000_003 + i,
            )  # fmt: skip
            for i in range(want + want // 4 + 4)
        ]
        for o in llm.generate([list(opening)] * len(params), params, use_tqdm=False):
            text = o.outputs[0].text.strip()
            key = " ".join(text.lower().split())[:80]
            ok = o.outputs[0].finish_reason == "stop" and 12 <= len(text) <= 600
            if ok and key not in seen:
                seen.add(key)
                out.append(text)
        attempt += 1
    return out[:num]


def magpie_stream(llm, batch: int, seed: int = 0) -> Iterator[str]:
    """Distinct Magpie prompts, ``batch`` at a time (so a run cut short by a deadline spends
    its time on responses, not on prompts it will not answer); ends when a round finds none."""
    seen: set[str] = set()
    for r in itertools.count():
        got = magpie_prompts(llm, batch, seed=seed + r * 100_003, seen=seen)
        if not got:
            return
        yield from got


def read_prompts(path: str | Path) -> list[str]:
    """A JSONL file: each line a string, or an object with "prompt" or "turns"[0]."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if isinstance(row, str):
            out.append(row)
        elif "prompt" in row:
            out.append(row["prompt"])
        else:
            out.append(row["turns"][0])
    return out


@dataclass
class _Shard:
    tokens: list[np.ndarray]
    prompt_lens: list[int]
    aux: list[np.ndarray]
    final: list[np.ndarray]
    topk_ids: list[np.ndarray]
    topk_probs: list[np.ndarray]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def _empty_shard() -> _Shard:
    return _Shard([], [], [], [], [], [])


def _write(shard: _Shard, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lens = [len(t) for t in shard.tokens]
    np.save(folder / "tokens.npy", np.concatenate(shard.tokens).astype(np.int32))
    np.save(folder / "starts.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    np.save(folder / "prompt_lens.npy", np.array(shard.prompt_lens, dtype=np.int32))
    for name in ("aux", "final", "topk_ids", "topk_probs"):
        np.save(folder / f"{name}.npy", np.concatenate(getattr(shard, name)))


@torch.inference_mode()
def _target_states(llm, ids: list[int], chunk: int = 256) -> torch.Tensor:
    """[len(ids), 4 H] float32: EAGLE-3's three states and the final state, by a forward over
    ``ids`` in a slot of its own."""
    engine = llm.engine
    model, kv = engine.model, engine.kv
    capture = (*default_aux_layers(model.cfg.num_layers), HIDDEN_FINAL)
    slot = kv.allocate()
    parts = []
    try:
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            n = len(piece)
            _, states = model.forward_capture(
                torch.tensor(piece, device=model.device),
                torch.arange(start, start + n, device=model.device),
                SeqBatch([slot], [start], [n]), kv, capture,
            )  # fmt: skip
            parts.append(states)
    finally:
        kv.free(slot)
    return torch.cat(parts)


@torch.inference_mode()
def _records(model, states: torch.Tensor) -> dict[str, np.ndarray]:
    """The stored record of [N, 4 H] target states: aux, final and the top-k soft labels."""
    H = model.cfg.hidden_size
    final = states[:, 3 * H :]
    probs = torch.softmax(model.compute_logits(final), dim=-1)
    top = probs.topk(TOP_K, dim=-1)
    return {
        "aux": states[:, : 3 * H].to(torch.float16).cpu().numpy(),
        "final": final.to(torch.float16).cpu().numpy(),
        "topk_ids": top.indices.to(torch.int32).cpu().numpy(),
        "topk_probs": top.values.to(torch.float16).cpu().numpy(),
    }


def states_of(llm, ids: list[int], chunk: int = 256) -> dict[str, np.ndarray]:
    """The target over ``ids``: EAGLE-3's states, final states, top-k next-token probabilities."""
    return _records(llm.engine.model, _target_states(llm, ids, chunk))


class _GenerationStates:
    """The target states of every token a plain generation feeds, kept from its own forward
    passes: no second pass over the sequences (that pass was ~45% of collecting).

    The native kernels are batch-invariant and the KV cache is written the same way by every
    request, so a state captured during generation equals the one a separate pass computes,
    bit for bit (tests/e2e/train/test_train.py). A prompt prefix served from the prefix cache was not
    fed: :meth:`states` computes those positions with :func:`_target_states`.
    """

    def __init__(self, llm) -> None:
        self.llm = llm
        self.runner = llm.engine.runner
        model = llm.engine.model
        self.capture = (*default_aux_layers(model.cfg.num_layers), HIDDEN_FINAL)
        self.fed: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def __enter__(self) -> _GenerationStates:
        self._saved = (self.runner.hidden_layers, self.runner.execute_model)
        execute = self.runner.execute_model

        def execute_and_keep(sched):
            out = execute(sched)
            for s, h in zip(sched.scheduled, out.hidden_states, strict=True):
                if h is not None:
                    self.fed.setdefault(s.req_id, []).append((s.start_pos, h))
            return out

        self.runner.hidden_layers = self.capture
        self.runner.execute_model = execute_and_keep
        return self

    def __exit__(self, *exc) -> None:
        self.runner.hidden_layers, self.runner.execute_model = self._saved

    def states(self, req_id: str, ids: list[int]) -> torch.Tensor:
        """[n, 4 H] for the first n tokens of ``ids`` (the request's prompt + output) that were
        fed: all but the last output token, which generation samples and never feeds."""
        fed = self.fed.pop(req_id, [])
        n = max((start + len(h) for start, h in fed), default=0)
        first = min((start for start, _ in fed), default=n)
        out = torch.empty(n, len(self.capture) * self.llm.engine.model.cfg.hidden_size)
        covered = torch.zeros(n, dtype=torch.bool)
        for start, h in fed:  # in step order: a position fed again keeps its last state
            out[start : start + len(h)] = h
            covered[start : start + len(h)] = True
        if first > 0:
            out[:first] = _target_states(self.llm, ids[:first])
            covered[:first] = True
        if not bool(covered.all()):
            raise RuntimeError(f"request {req_id}: states missing for some fed positions")
        return out


def _batch_params(
    b0: int, n: int, sampled_fraction: float, max_tokens: int, seed: int
) -> list[SamplingParams]:
    """Sampling of prompts ``b0 .. b0 + n - 1``: greedy, or T 0.7 for ``sampled_fraction`` of
    them."""
    params = []
    for i in range(n):
        k = b0 + i  # sampled when the running share of sampled responses steps up
        sampled = math.floor((k + 1) * sampled_fraction) > math.floor(k * sampled_fraction)
        params.append(SamplingParams(temperature=0.7 if sampled else 0.0, top_p=0.95,
                                     max_tokens=max_tokens, seed=seed + b0 + i))  # fmt: skip
    return params


def _manifest(model, num_seqs: int, num_tokens: int, num_shards: int, max_tokens: int) -> dict:
    """What ``collect`` wrote, and the target's shape it was collected from."""
    return {
        "num_sequences": num_seqs,
        "num_tokens": num_tokens,
        "num_shards": num_shards,
        "hidden_size": model.cfg.hidden_size,
        "vocab_size": model.cfg.vocab_size,
        "num_layers": model.cfg.num_layers,
        "aux_layers": list(default_aux_layers(model.cfg.num_layers)),
        "top_k": TOP_K,
        "max_tokens": max_tokens,
    }


def collect(
    llm,
    prompts: Iterable[str],
    out: str | Path,
    max_tokens: int = 256,
    sampled_fraction: float = 0.5,
    seed: int = 0,
    batch: int = 32,
    progress: bool = True,
    deadline: float | None = None,
) -> dict:
    """Responses of the target to ``prompts`` (greedy, and sampled at T 0.7 for a fraction),
    with their states and soft labels, in shards under ``out`` (the prompts answered in
    ``prompts.jsonl``). Returns the manifest. ``prompts`` may be a stream (``magpie_stream``);
    ``deadline`` (a ``time.monotonic()`` value): no batch starts after it, what was collected
    is written."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = llm.get_tokenizer()
    shard, num_shards, num_tokens, num_seqs = _empty_shard(), 0, 0, 0
    total = len(prompts) if isinstance(prompts, Sized) else None
    bar = tqdm(total=total, desc="responses", disable=not progress, unit="prompt")
    stream, answered = iter(prompts), []
    for b0 in itertools.count(0, batch):
        if deadline is not None and time.monotonic() >= deadline:
            break
        chunk = list(itertools.islice(stream, batch))
        if not chunk:
            break
        answered += chunk
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
               for p in chunk]  # fmt: skip
        params = _batch_params(b0, len(chunk), sampled_fraction, max_tokens, seed)
        model = llm.engine.model
        kept = _GenerationStates(llm) if llm.engine.speculator is None else None
        if kept is not None:
            with kept:
                outputs = llm.generate(ids, params, use_tqdm=False)
        else:  # a speculating engine feeds drafts too: a second pass over each sequence
            outputs = llm.generate(ids, params, use_tqdm=False)
        for p_ids, o in zip(ids, outputs):
            seq = list(p_ids) + list(o.outputs[0].token_ids)
            if kept is not None:
                states = kept.states(o.request_id, seq)
                seq = seq[: len(states)]  # NOTE: the last sampled token was never fed: left out
            else:
                states = _target_states(llm, seq)
            st = _records(model, states)
            shard.tokens.append(np.array(seq, dtype=np.int32))
            shard.prompt_lens.append(len(p_ids))
            for name in ("aux", "final", "topk_ids", "topk_probs"):
                getattr(shard, name).append(st[name])
            num_tokens += len(seq)
            num_seqs += 1
            if shard.num_tokens >= SHARD_TOKENS:
                _write(shard, out / f"shard-{num_shards:04d}")
                shard, num_shards = _empty_shard(), num_shards + 1
        bar.update(len(chunk))
        bar.set_postfix(tokens=num_tokens)
    bar.close()
    if shard.tokens:
        _write(shard, out / f"shard-{num_shards:04d}")
        num_shards += 1
    manifest = _manifest(llm.engine.model, num_seqs, num_tokens, num_shards, max_tokens)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with open(out / "prompts.jsonl", "w") as f:  # what the responses answer, to audit
        f.writelines(json.dumps(p) + "\n" for p in answered)
    return manifest


class TrainData:
    """The shards of one or more ``collect`` folders (of the same target), memory-mapped;
    sequences by index."""

    def __init__(self, folders: str | Path | list[str | Path]) -> None:
        folders = [Path(f) for f in (folders if isinstance(folders, list) else [folders])]
        self.manifest: dict = {}
        self.shards = []
        self.index: list[tuple[int, int]] = []  # (shard, sequence in shard)
        self.last_folder_start = 0  # the first sequence of the last folder
        for folder in folders:
            self.last_folder_start = len(self.index)
            manifest = json.loads((folder / "manifest.json").read_text())
            same = ("hidden_size", "vocab_size", "num_layers", "aux_layers", "top_k")
            if self.manifest and any(manifest[k] != self.manifest[k] for k in same):
                raise ValueError(f"{folder} was collected from another target or layout")
            if not self.manifest:
                self.manifest = dict(manifest)
            else:
                for k in ("num_sequences", "num_tokens", "num_shards"):
                    self.manifest[k] += manifest[k]
            for i in range(manifest["num_shards"]):
                d = folder / f"shard-{i:04d}"
                arrays = {p.stem: np.load(p, mmap_mode="r") for p in d.glob("*.npy")}
                self.index += [(len(self.shards), j) for j in range(len(arrays["prompt_lens"]))]
                self.shards.append(arrays)

    def __len__(self) -> int:
        return len(self.index)

    def sequence(self, k: int) -> dict[str, np.ndarray]:
        i, j = self.index[k]
        a = self.shards[i]
        lo, hi = int(a["starts"][j]), int(a["starts"][j + 1])
        out = {
            name: a[name][lo:hi] for name in ("tokens", "aux", "final", "topk_ids", "topk_probs")
        }
        out["prompt_len"] = int(a["prompt_lens"][j])
        return out

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token is the target's top choice at a response position."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for k in range(len(self)):
            s = self.sequence(k)
            top = np.asarray(s["topk_ids"][s["prompt_len"] - 1 : -1, 0])
            counts += np.bincount(top, minlength=vocab_size)
        return counts


def split(n: int, val_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(n).tolist()
    num_val = max(1, math.ceil(n * val_fraction)) if n > 1 else 0
    return order[num_val:], order[:num_val]
