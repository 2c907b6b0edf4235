"""Trainable EAGLE-3, EAGLE and Medusa heads (PyTorch), with EAGLE-3's training-time test.

The chain heads (``ChainHead``) compute exactly what ``specdec.spec_decode.eagle3`` /
``eagle`` compute at inference. Training-time test (Li et al., 2025): step 0 reads the target's
states; step j reads, at position t, the head's own step j - 1 output at t - 1, and attends to
step 0's keys at positions <= t - j plus step i's key at t - j + i for i = 1..j: what the head's
KV cache holds when it drafts its (j + 1)-th token. Every step predicts the token two past its
position, against the target's distribution there (soft labels).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class ChainHead(nn.Module):
    """One decoder layer drafting from (token embedding, feature) pairs.

    ``variant`` "eagle3": fc over the 3 auxiliary states, attention over [normed embedding;
    normed feature], a final norm and a reduced-vocabulary head. "eagle": fc over [embedding;
    final state] (with bias), the layer without an input norm, the target's own LM head.
    """

    def __init__(
        self,
        variant: str,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        rope_theta: float,
        draft_vocab_size: int,
        num_aux: int = 3,
    ) -> None:
        super().__init__()
        H = hidden_size
        self.variant = variant
        self.H, self.nh, self.nkv, self.hd = H, num_heads, num_kv_heads, head_dim
        self.eps, self.theta = rms_norm_eps, rope_theta
        eagle3 = variant == "eagle3"
        attn_in = 2 * H if eagle3 else H
        self.fc = nn.Linear(num_aux * H if eagle3 else 2 * H, H, bias=not eagle3)
        self.q_proj = nn.Linear(attn_in, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(attn_in, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(attn_in, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, H, bias=False)
        self.gate_proj = nn.Linear(H, intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        if eagle3:
            self.input_layernorm = nn.Parameter(torch.ones(H))
            self.hidden_norm = nn.Parameter(torch.ones(H))
            self.norm = nn.Parameter(torch.ones(H))
            self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        for lin in (self.o_proj, self.down_proj):  # start near the identity map
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2))

    # ---- one step over a whole sequence --------------------------------------------------------
    def _attn_input(
        self, emb: torch.Tensor, feat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual [T, H], what q/k/v read [T, in])"""
        if self.variant == "eagle3":
            hidden = rms_norm(feat, self.hidden_norm, self.eps)
            return feat, torch.cat([rms_norm(emb, self.input_layernorm, self.eps), hidden], -1)
        return feat, feat

    def _rope_tables(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, device=device).float() / self.hd))
        freqs = torch.outer(torch.arange(T, device=device).float(), inv)
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)  # [T, 1, D]

    def forward_ttt(
        self,
        emb: torch.Tensor,  # [T, H] embedding of token t + 1 at position t
        feat0: torch.Tensor,  # [T, F] the target's states at position t
        num_steps: int,
        lm_head: torch.Tensor | None = None,  # [V, H] the target's (eagle)
    ) -> list[torch.Tensor]:  # per step, logits [T, V'] (rows t < step are meaningless)
        T, dev = emb.shape[0], emb.device
        cos, sin = self._rope_tables(T, dev)
        rep = self.nh // self.nkv
        if self.variant == "eagle3":
            feat = self.fc(feat0)
        else:
            feat = self.fc(torch.cat([emb, feat0], -1))
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        logits = []
        out = feat  # the previous step's output (set by step 0 before step 1 reads it)
        for j in range(num_steps):
            if j > 0:  # the previous step's output at t - 1
                if self.variant == "eagle3":
                    feat = torch.cat([torch.zeros_like(out[:1]), out[:-1]])
                else:
                    feat = self.fc(
                        torch.cat([emb, torch.cat([torch.zeros_like(out[:1]), out[:-1]])], -1)
                    )
            residual, attn_in = self._attn_input(emb, feat)
            q = _rope(self.q_proj(attn_in).view(T, self.nh, self.hd), cos, sin)
            k = _rope(self.k_proj(attn_in).view(T, self.nkv, self.hd), cos, sin)
            v = self.v_proj(attn_in).view(T, self.nkv, self.hd)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [T, nh, D]
            keys.append(k)
            values.append(v)
            scale = self.hd**-0.5
            s0 = torch.einsum("thd,phd->htp", q, keys[0]) * scale  # [nh, T, T]
            seen = torch.ones(T, T, dtype=torch.bool, device=dev).tril(-j)  # p <= t - j
            s0 = s0.masked_fill(~seen, float("-inf"))
            diag_s, diag_v = [], []
            for i in range(1, j + 1):
                shift = j - i  # step i's key at t - j + i
                ki = torch.roll(keys[i], shift, 0)
                vi = torch.roll(values[i], shift, 0)
                diag_s.append((q * ki).sum(-1).transpose(0, 1).unsqueeze(-1) * scale)  # [nh, T, 1]
                diag_v.append(vi)
            scores = torch.cat([s0, *diag_s], -1) if diag_s else s0
            w = torch.softmax(scores, -1)
            w = torch.nan_to_num(w)  # rows t < j see nothing: meaningless, not NaN
            attn = torch.einsum("htp,phd->thd", w[..., :T], values[0])
            for i, vi in enumerate(diag_v):
                attn = attn + w[..., T + i].transpose(0, 1).unsqueeze(-1) * vi
            x = residual + self.o_proj(attn.reshape(T, -1))
            h = rms_norm(x, self.post_attention_layernorm, self.eps)
            out = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
            if self.variant == "eagle3":
                logits.append(self.lm_head(rms_norm(out, self.norm, self.eps)))
            else:
                logits.append(F.linear(out, lm_head))
        return logits


class MedusaHeads(nn.Module):
    """K heads of one residual block each; projections start as (and stay) the target's head."""

    def __init__(self, hidden_size: int, num_heads: int, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for b in self.blocks:
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        self.register_buffer("lm_head", lm_head, persistent=False)

    def forward(self, final: torch.Tensor) -> list[torch.Tensor]:  # [T, H] -> per head [T, V]
        return [F.linear(final + F.silu(b(final)), self.lm_head) for b in self.blocks]
