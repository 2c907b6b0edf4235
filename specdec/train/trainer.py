"""``specdec train eagle3|eagle|medusa``: fit a head to a target's own outputs (``data.collect``)
and write it in the layout the drafters (and vLLM) load.

AdamW with a linear warm-up and a cosine schedule, gradient clipping, a validation split scored
by simulated acceptance (how often each drafting step's argmax is the target's, and the tokens a
3-draft chain would then accept), checkpoints every ``ckpt_every`` steps and ``--resume``.
Runs on CUDA when asked and present.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from specdec.train.data import TrainData, split
from specdec.train.heads import ChainHead, MedusaHeads

STEP_WEIGHT = 0.8  # EAGLE-3: step j's loss weighs 0.8 ** j


@dataclass
class TrainConfig:
    method: str = "eagle3"  # eagle3 | eagle | medusa
    epochs: float = 1.0
    lr: float = 3e-4
    batch: int = 8  # sequences per optimizer step
    ttt_steps: int = 3  # drafting steps unrolled (eagle3, eagle)
    medusa_heads: int = 3
    draft_vocab: int = 8192  # eagle3: the most frequent target tokens
    max_len: int = 512  # tokens per sequence kept
    val_fraction: float = 0.05
    eval_every: int = 100
    ckpt_every: int = 200
    warmup: float = 0.02
    seed: int = 0
    device: str = "auto"
    init: str = ""  # eagle3: an exported head to start from (its weights and draft vocabulary)
    time_limit: float = 0.0  # seconds (0: none): the schedule decays over whichever ends first


class _Target:
    """What training needs of the target: embeddings, LM head, shapes (float32, on device)."""

    def __init__(self, llm, device: torch.device) -> None:
        model = llm.engine.model
        cfg = model.cfg
        self.cfg = cfg
        with torch.no_grad():
            self.embed = model.embed(torch.arange(cfg.vocab_size, device=model.device))
            self.embed = self.embed.float().to(device).clone()
            self.lm_head = model.lm_head.weight.dequantize().float().to(device).clone()
        self.source = str(model.source_path)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _soft_ce(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against sparse soft labels: ids/probs [T, K] (ids -1: outside the head's
    vocabulary, dropped; the rest renormalized). Returns [T] (0 where no mass is left)."""
    keep = ids >= 0
    p = probs * keep
    mass = p.sum(-1, keepdim=True)
    p = p / mass.clamp_min(1e-9)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids.clamp_min(0))
    return -(p * logp).sum(-1) * (mass.squeeze(-1) > 0)


class Trainer:
    def __init__(
        self, llm, data_dir: str | Path | list, out_dir: str | Path, cfg: TrainConfig
    ) -> None:
        self.cfg = cfg
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = _device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.data = TrainData(data_dir)
        self.target = _Target(llm, self.device)
        tc = self.target.cfg
        if self.data.manifest["hidden_size"] != tc.hidden_size:
            raise ValueError(
                f"the data was collected from a target of hidden size "
                f"{self.data.manifest['hidden_size']}, this target's is {tc.hidden_size}"
            )
        # validation from the last folder only: a head given to --init has seen the earlier ones
        first = self.data.last_folder_start
        train_ids, val_ids = split(len(self.data) - first, cfg.val_fraction, cfg.seed)
        self.train_ids = list(range(first)) + [first + i for i in train_ids]
        self.val_ids = [first + i for i in val_ids]
        self.to_draft = None  # target id -> draft id (eagle3), -1 outside
        init = _read_head(cfg.init) if cfg.init else None
        if init is not None and cfg.method != "eagle3":
            raise ValueError("--init starts EAGLE-3 heads only")
        if cfg.method == "eagle3":
            counts = self.data.token_counts(tc.vocab_size)
            used = np.sort(np.argsort(-counts, kind="stable")[: cfg.draft_vocab])
            if init is not None:  # the head's own vocabulary, so its lm_head rows keep meaning
                d2t = init.pop("d2t").long()
                used = (torch.arange(len(d2t)) + d2t).numpy()
            self.used = torch.tensor(used, dtype=torch.long)
            self.to_draft = torch.full((tc.vocab_size,), -1, dtype=torch.long)
            self.to_draft[self.used] = torch.arange(len(used))
            self.to_draft = self.to_draft.to(self.device)
            cover = counts[used].sum() / max(1, counts.sum())
            self.vocab_coverage = float(cover)
            cfg.draft_vocab = len(used)
        if cfg.method == "medusa":
            self.model = MedusaHeads(tc.hidden_size, cfg.medusa_heads, self.target.lm_head)
        else:
            self.model = ChainHead(
                cfg.method, tc.hidden_size, tc.intermediate_size, tc.num_heads, tc.num_kv_heads,
                tc.head_dim, tc.rms_norm_eps, tc.rope_theta, cfg.draft_vocab,
            )  # fmt: skip
        if init is not None:
            self.model.load_state_dict(_chain_state(init, self.model), strict=True)
        self.model.to(self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.total_steps = max(1, math.ceil(cfg.epochs * len(self.train_ids) / cfg.batch))
        self.step = 0
        self.log: list[dict] = []

    # ---- one sequence ------------------------------------------------------------------------
    def _tensors(self, k: int) -> dict[str, torch.Tensor]:
        s = self.data.sequence(k)
        L = min(len(s["tokens"]), self.cfg.max_len)
        dev = self.device

        def t(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.array(s[name][:L])).to(device=dev, dtype=dtype)

        return {
            "tokens": t("tokens", torch.long), "aux": t("aux", torch.float32),
            "final": t("final", torch.float32), "ids": t("topk_ids", torch.long),
            "probs": t("topk_probs", torch.float32), "prompt_len": s["prompt_len"],
        }  # fmt: skip

    def _losses(self, k: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The weighted loss of one sequence, and per step (agreeing, counted) positions."""
        d = self._tensors(k)
        first = max(0, d["prompt_len"] - 2)  # the first position predicting a response token
        if self.cfg.method == "medusa":
            return self._medusa_losses(d, first)
        T = d["tokens"].shape[0] - 1
        emb = self.target.embed[d["tokens"][1:]]  # token t + 1 at position t
        feat = d["aux"][:T] if self.cfg.method == "eagle3" else d["final"][:T]
        ids, probs = d["ids"][1:], d["probs"][1:]  # the target's distribution of token t + 2
        top = ids[:, 0]
        if self.to_draft is not None:
            ids = self.to_draft[ids]
        lm_head = None if self.cfg.method == "eagle3" else self.target.lm_head
        steps = self.model.forward_ttt(emb, feat, self.cfg.ttt_steps, lm_head)
        total, weight, stats = 0.0, 0.0, []
        for j, logits in enumerate(steps):
            lo = max(first, j)
            if lo >= T:
                stats.append((0, 0))
                continue
            ce = _soft_ce(logits[lo:], ids[lo:], probs[lo:])
            total = total + STEP_WEIGHT**j * ce.mean()
            weight += STEP_WEIGHT**j
            guess = logits[lo:].argmax(-1)
            if self.to_draft is not None:
                guess = self.used.to(guess.device)[guess]
            stats.append((int((guess == top[lo:]).sum()), T - lo))
        return total / max(weight, 1e-9), stats

    def _medusa_losses(self, d: dict, first: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        L = d["tokens"].shape[0]
        outs = self.model(d["final"])
        total, weight, stats = 0.0, 0.0, []
        for i, logits in enumerate(outs):  # head i at t predicts token t + 2 + i
            lo, hi = first, L - 1 - i  # label row t + 1 + i must exist
            if lo >= hi:
                stats.append((0, 0))
                continue
            ids, probs = d["ids"][lo + 1 + i : hi + 1 + i], d["probs"][lo + 1 + i : hi + 1 + i]
            ce = _soft_ce(logits[lo:hi], ids, probs)
            total = total + STEP_WEIGHT**i * ce.mean()
            weight += STEP_WEIGHT**i
            stats.append((int((logits[lo:hi].argmax(-1) == ids[:, 0]).sum()), hi - lo))
        return total / max(weight, 1e-9), stats

    # ---- the loop ------------------------------------------------------------------------------
    def _lr(self, elapsed: float = 0.0) -> float:
        warm = max(1, int(self.cfg.warmup * self.total_steps))
        if self.step < warm:
            return self.cfg.lr * (self.step + 1) / warm
        progress = (self.step - warm) / max(1, self.total_steps - warm)
        if self.cfg.time_limit > 0:
            progress = max(progress, elapsed / self.cfg.time_limit)
        return self.cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def _done(self, elapsed: float) -> bool:
        over_time = self.cfg.time_limit > 0 and elapsed >= self.cfg.time_limit
        return self.step >= self.total_steps or over_time

    def evaluate(self) -> dict:
        """Per step, how often its argmax is the target's; the tokens a chain then accepts."""
        self.model.eval()
        agree, count = None, None
        with torch.no_grad():
            for k in self.val_ids:
                _, stats = self._losses(k)
                a = np.array([s[0] for s in stats], dtype=np.float64)
                c = np.array([s[1] for s in stats], dtype=np.float64)
                agree = a if agree is None else agree + a
                count = c if count is None else count + c
        self.model.train()
        rates = (agree / np.maximum(count, 1)).tolist() if agree is not None else []
        return {"val_top1": [round(r, 4) for r in rates],
                "val_accepted": round(float(sum(np.cumprod(rates))), 4)}  # fmt: skip

    def fit(self, progress: bool = True) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed + self.step)
        order: list[int] = []
        start = time.monotonic()
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {cfg.method}",
                   disable=not progress)  # fmt: skip
        last_eval: dict = {}
        while not self._done(time.monotonic() - start):
            if len(order) < cfg.batch:
                order += rng.permutation(self.train_ids).tolist()
            batch, order = order[: cfg.batch], order[cfg.batch :]
            lr = self._lr(time.monotonic() - start)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.zero_grad(set_to_none=True)
            loss_sum, top_ok, top_n = 0.0, 0, 0
            for k in batch:
                loss, stats = self._losses(k)
                (loss / len(batch)).backward()
                loss_sum += float(loss.detach())
                top_ok, top_n = top_ok + stats[0][0], top_n + stats[0][1]
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
            self.opt.step()
            self.step += 1
            row = {"step": self.step, "loss": round(loss_sum / len(batch), 4),
                   "top1": round(top_ok / max(1, top_n), 4), "lr": lr,
                   "elapsed_s": round(time.monotonic() - start, 1)}  # fmt: skip
            last = self._done(time.monotonic() - start)
            if self.step % cfg.eval_every == 0 or last:
                last_eval = self.evaluate()
                row.update(last_eval)
            self.log.append(row)
            with open(self.out / "train_log.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix(loss=row["loss"], top1=row["top1"], **(
                {"val_accepted": last_eval["val_accepted"]} if last_eval else {}))  # fmt: skip
            if self.step % cfg.ckpt_every == 0 or last:
                self.save_checkpoint()
                self.export()
        bar.close()
        return last_eval

    # ---- files ---------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                 "config": asdict(self.cfg)}  # fmt: skip
        torch.save(state, self.out / "checkpoint.pt")

    def resume(self) -> bool:
        path = self.out / "checkpoint.pt"
        if not path.is_file():
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])
        return True

    def export(self) -> Path:
        """The head in its official layout under ``out/head``."""
        head = self.out / "head"
        head.mkdir(exist_ok=True)
        if self.cfg.method == "eagle3":
            export_eagle3(self.model, self.used, self.target, self.data.manifest, head)
        elif self.cfg.method == "eagle":
            export_eagle(self.model, self.target, head)
        else:
            export_medusa(self.model, self.target, head)
        return head


def _read_head(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() if v.is_floating_point() else v
            for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}  # fmt: skip


def _chain_state(w: dict[str, torch.Tensor], m: ChainHead) -> dict[str, torch.Tensor]:
    """An exported EAGLE-3 head's tensors (export_eagle3's keys) as ``m``'s state dict."""
    names = {v: k for k, v in _export_names(m).items()}
    state = {names[k]: v for k, v in w.items() if k in names}
    missing = set(m.state_dict()) - set(state)
    if missing:
        raise ValueError(f"--init: the head lacks {sorted(missing)}")
    return state


def _export_names(m: ChainHead) -> dict[str, str]:
    """ChainHead state-dict key -> export_eagle3's key."""
    out = {}
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"{n}.weight"] = f"layers.0.self_attn.{n}.weight"
    for n in ("gate_proj", "up_proj", "down_proj"):
        out[f"{n}.weight"] = f"layers.0.mlp.{n}.weight"
    for n in ("post_attention_layernorm", "input_layernorm", "hidden_norm"):
        out[n] = f"layers.0.{n}.weight"
    out |= {"fc.weight": "fc.weight", "norm": "norm.weight", "lm_head.weight": "lm_head.weight"}
    return {k: v for k, v in out.items() if k in m.state_dict()}


def _layer_keys(m: ChainHead, prefix: str) -> dict[str, torch.Tensor]:
    out = {
        prefix + f"self_attn.{n}.weight": getattr(m, n).weight
        for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    out |= {prefix + f"mlp.{n}.weight": getattr(m, n).weight
            for n in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    out[prefix + "post_attention_layernorm.weight"] = m.post_attention_layernorm
    return out


def _layer_config(t: _Target) -> dict:
    c = t.cfg
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size, "num_hidden_layers": 1,
        "max_position_embeddings": c.max_position_embeddings,
    }  # fmt: skip


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    def half(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu()
        return t.to(torch.float16).contiguous() if t.is_floating_point() else t.contiguous()

    save_file({k: half(v) for k, v in tensors.items()}, str(path))


def export_eagle3(m: ChainHead, used: torch.Tensor, t: _Target, manifest: dict, out: Path) -> None:
    """vLLM's speculators layout (what ``specdec.spec_decode.eagle3`` and vLLM load)."""
    w = _layer_keys(m, "layers.0.")
    w["layers.0.input_layernorm.weight"] = m.input_layernorm
    w["layers.0.hidden_norm.weight"] = m.hidden_norm
    w |= {"fc.weight": m.fc.weight, "norm.weight": m.norm, "lm_head.weight": m.lm_head.weight}
    w["d2t"] = used - torch.arange(len(used))
    t2d = torch.zeros(t.cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    w["t2d"] = t2d
    _save(w, out / "model.safetensors")
    cfg = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_version": "0.1.0",
        "transformer_layer_config": _layer_config(t),
        "draft_vocab_size": len(used),
        "target_hidden_size": t.cfg.hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": manifest["aux_layers"],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": t.source, "architectures": ["LlamaForCausalLM"]},
        },
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def export_eagle(m: ChainHead, t: _Target, out: Path) -> None:
    """SafeAILab's EAGLE layout (keys fc.*, layers.0.*; the first layer has no input norm)."""
    w = _layer_keys(m, "layers.0.") | {"fc.weight": m.fc.weight, "fc.bias": m.fc.bias}
    _save(w, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(_layer_config(t) | {"bias": True}, indent=1))


def export_medusa(m: MedusaHeads, t: _Target, out: Path) -> None:
    """FasterDecoding's layout: medusa_lm_head.safetensors, head i = block i.0 then i.1."""
    w = {}
    for i, b in enumerate(m.blocks):
        w[f"{i}.0.linear.weight"], w[f"{i}.0.linear.bias"] = b.weight, b.bias
        w[f"{i}.1.weight"] = t.lm_head.clone()  # NOTE: safetensors stores no shared memory
    _save(w, out / "medusa_lm_head.safetensors")
    cfg = {"medusa_num_heads": len(m.blocks), "medusa_num_layers": 1,
           "hidden_size": t.cfg.hidden_size, "base_model_name_or_path": t.source}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
