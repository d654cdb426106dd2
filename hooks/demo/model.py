"""The demo's model: a nanoGPT-style, pre-LN character-level GPT with a fused ``c_attn`` (few wide heads).

Its attention and block are also the evaluation's ViT's (``evaluation.eureka``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Block", "GPT", "GPTConfig", "SelfAttention"]


@dataclass
class GPTConfig:
    vocab_size: int = 128  # set from the data
    block_size: int = 128  # context length
    n_layer: int = 4
    n_head: int = 2  # few wide heads: d_head = n_embd // n_head = 64
    n_embd: int = 128
    batch_size: int = 16
    qk_norm: bool = False  # LayerNorm on q and k per head (Dehghani et al. 2023): attention that cannot collapse


class SelfAttention(nn.Module):
    """nanoGPT's attention: a fused ``c_attn`` (q, k, v) and ``n_head``, as the Monitor's nanoGPT adapter reads it.

    ``causal``: a language model's mask, else every token sees every other (a ViT). ``qk_norm``: LayerNorm on q
    and k per head. :meth:`attend` is the one place a variant changes (NormSoftmax, say)."""

    def __init__(self, n_embd: int, n_head: int, causal: bool = True, qk_norm: bool = False) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.causal = causal
        self.q_norm = nn.LayerNorm(n_embd // n_head) if qk_norm else None
        self.k_norm = nn.LayerNorm(n_embd // n_head) if qk_norm else None

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = self.attend(q, k, v)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, nh, T, hs)


class Block(nn.Module):
    """A pre-LN transformer block around ``attn``: x + attn(ln_1(x)), then x + mlp(ln_2(x)) (a 4x GELU MLP)."""

    def __init__(self, n_embd: int, attn: nn.Module) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = attn
        c = n_embd
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg.n_embd, SelfAttention(cfg.n_embd, cfg.n_head, qk_norm=cfg.qk_norm))
                               for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in nanoGPT
        for name, p in self.named_parameters():  # N(0, 0.02); attention output c_proj scaled down (nanoGPT)
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias") and ".ln_" not in name:
                nn.init.zeros_(p)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        t = idx.shape[1]  # idx, targets: (B, T)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
