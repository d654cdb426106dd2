"""Attention modules written in the coding styles of research code, for zero-configuration tests.

Each style keeps its weights its own way (names, packing, nesting, 3-D per-head parameters, head-count
attribute or none, GQA pairing) and computes attention through one of the kernels (SDPA, matmul + softmax,
einsum + softmax), with RoPE or QK-norm where the style has them. Every style exposes ``qk(x)``: the raw
per-head projections (B, H, T, D) and (B, G, T, D) its forward uses, and ``kv_of`` (query head -> key head),
so a test can read the true per-head W_q, W_k by projecting the identity through the model's own code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

E, H, D, G = 32, 4, 8, 2


def rope(x: Tensor, interleaved: bool = False, partial: int | None = None) -> Tensor:
    """RoPE on (B, H, T, D): half-split pairs (i, i + D/2) or interleaved pairs (2i, 2i + 1), on the first
    ``partial`` features only when given."""
    rot = x.shape[-1] if partial is None else partial
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    t = torch.arange(x.shape[-2], dtype=x.dtype, device=x.device)
    freqs = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=x.dtype) / rot))
    ang = torch.outer(t, freqs)  # (T, rot/2)
    cos, sin = ang.cos(), ang.sin()
    if interleaved:
        a, b = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = x_rot.chunk(2, dim=-1)
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([out, x_pass], dim=-1)


def attend(q: Tensor, k: Tensor, v: Tensor, kernel: str) -> Tensor:
    """Causal attention (B, H, T, D) with k, v already at H heads, through the named kernel."""
    t = q.shape[-2]
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if kernel == "matmul":
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    elif kernel == "einsum":
        logits = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    else:  # broadcast: a product the capture cannot see (no matmul, bmm or einsum)
        logits = (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1) / math.sqrt(q.shape[-1])
    p = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return p @ v


def _heads(y: Tensor, n: int) -> Tensor:
    return y.unflatten(-1, (n, -1)).transpose(1, 2)  # (B, T, n*D) -> (B, n, T, D)


class Style(nn.Module):
    """Base: subclasses define ``project(x) -> q (B, H, T, D), k (B, G, T, D), v (B, G, T, D)``."""

    kernel = "sdpa"
    n_q, n_kv = H, H

    def kv_of(self, h: int) -> int:
        return h // (self.n_q // self.n_kv)

    def qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q, k, _ = self.project(x)
        return q, k

    def shape_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k  # RoPE / QK-norm in styles that have them

    def out_proj(self, y: Tensor) -> Tensor:
        return self.out(y)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.project(x)
        q, k = self.shape_qk(q, k)
        index = torch.tensor([self.kv_of(h) for h in range(self.n_q)])
        y = attend(q, k[:, index], v[:, index], self.kernel)
        return self.out_proj(y.transpose(1, 2).flatten(2))


class FusedHeadsAttr(Style):
    """``qkv`` Linear [Q | K | V], head count in ``heads``, output ``out``, SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = H
        self.qkv, self.out = nn.Linear(E, 3 * H * D), nn.Linear(H * D, E)

    def project(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return _heads(q, H), _heads(k, H), _heads(v, H)


class PerHeadNumHeads(Style):
    """``qkv`` Linear interleaved per head [Q_h | K_h | V_h], ``num_heads``, output ``proj``, matmul + softmax."""

    kernel = "matmul"

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.qkv, self.proj = nn.Linear(E, 3 * H * D), nn.Linear(H * D, E)

    def project(self, x):
        y = self.qkv(x).unflatten(-1, (H, 3, D))  # (B, T, H, 3, D)
        return tuple(y[..., i, :].transpose(1, 2) for i in range(3))

    def out_proj(self, y):
        return self.proj(y)


class PerGroupRope(Style):
    """``Wqkv`` Linear interleaved per KV group [Q_1..Q_r | K | V], ``n_heads``/``n_kv_heads``, RoPE, ``wo``."""

    n_kv = G

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = H, G
        self.Wqkv, self.wo = nn.Linear(E, (H + 2 * G) * D, bias=False), nn.Linear(H * D, E, bias=False)

    def project(self, x):
        r = H // G
        y = self.Wqkv(x).unflatten(-1, (G, r + 2, D))  # (B, T, G, r+2, D)
        q = y[..., :r, :].flatten(2, 3).transpose(1, 2)
        return q, y[..., r, :].transpose(1, 2), y[..., r + 1, :].transpose(1, 2)

    def shape_qk(self, q, k):
        return rope(q), rope(k)

    def out_proj(self, y):
        return self.wo(y)


class TileEinsum(Style):
    """Separate ``W_q``/``W_k``/``W_v`` Linears, head count in ``H``, query head h with KV head h % G,
    logits by ``torch.einsum`` + softmax, output ``o``."""

    kernel, n_kv = "einsum", G

    def __init__(self) -> None:
        super().__init__()
        self.H = H
        self.W_q, self.W_k, self.W_v = nn.Linear(E, H * D), nn.Linear(E, G * D), nn.Linear(E, G * D)
        self.o = nn.Linear(H * D, E)

    def kv_of(self, h):
        return h % G

    def project(self, x):
        return _heads(self.W_q(x), H), _heads(self.W_k(x), G), _heads(self.W_v(x), G)

    def out_proj(self, y):
        return self.o(y)


class TileBroadcast(TileEinsum):
    """As :class:`TileEinsum`, with logits from a broadcast product and sum: q and k are never visible."""

    kernel = "broadcast"


class TileSdpa(TileEinsum):
    """As :class:`TileEinsum` (pairing h % G), through SDPA with k and v tiled to the query heads."""

    kernel = "sdpa"


class _Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(E, H * D) for _ in range(3))


class Nested(Style):
    """Q/K/V Linears two levels down (``proj.q.weight``) in a helper module, ``nhead``, ``out_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.nhead = H
        self.proj, self.out_proj_ = _Projections(), nn.Linear(H * D, E)

    def project(self, x):
        return tuple(_heads(lin(x), H) for lin in (self.proj.q, self.proj.k, self.proj.v))

    def out_proj(self, y):
        return self.out_proj_(y)


class Heads3D(Style):
    """3-D per-head parameters ``Wq``/``Wk``/``Wv`` (H, E, D) used by einsum, no head-count attribute, SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.Wq, self.Wk, self.Wv = (nn.Parameter(torch.randn(H, E, D) / math.sqrt(E)) for _ in range(3))
        self.out = nn.Linear(H * D, E)

    def project(self, x):
        return tuple(torch.einsum("bte,hed->bhtd", x, w) for w in (self.Wq, self.Wk, self.Wv))


class OddQKNorm(Style):
    """``to_q``/``to_k``/``to_v``, a LayerNorm per head named ``ln_q``/``ln_k``, interleaved RoPE, ``n_head``."""

    kernel = "matmul"

    def __init__(self) -> None:
        super().__init__()
        self.n_head = H
        self.to_q, self.to_k, self.to_v = (nn.Linear(E, H * D, bias=False) for _ in range(3))
        self.ln_q, self.ln_k = nn.LayerNorm(D), nn.LayerNorm(D)
        with torch.no_grad():  # trained-looking gains, so the norm is not the identity up to scale
            for ln in (self.ln_q, self.ln_k):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.1, 0.1)
        self.to_out = nn.Sequential(nn.Linear(H * D, E), nn.Dropout(0.0))

    def project(self, x):
        return tuple(_heads(lin(x), H) for lin in (self.to_q, self.to_k, self.to_v))

    def shape_qk(self, q, k):
        return rope(self.ln_q(q), interleaved=True), rope(self.ln_k(k), interleaved=True)

    def out_proj(self, y):
        return self.to_out(y)


class NoAttrSequential(Style):
    """``to_qkv`` as ``nn.Sequential(Linear)`` (``to_qkv.0.weight``), no head-count attribute at all,
    partial RoPE, matmul + softmax; the kernel's shapes give the head count."""

    kernel = "matmul"

    def __init__(self) -> None:
        super().__init__()
        self.to_qkv, self.to_out = nn.Sequential(nn.Linear(E, 3 * H * D)), nn.Linear(H * D, E)

    def project(self, x):
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        return _heads(q, H), _heads(k, H), _heads(v, H)

    def shape_qk(self, q, k):
        return rope(q, partial=D // 2), rope(k, partial=D // 2)

    def out_proj(self, y):
        return self.to_out(y)


class RawTransposed(Style):
    """Raw 2-D parameters ``Wq``/``Wk``/``Wv`` stored (E, H*D) and used as ``x @ Wq``, ``num_heads``, GQA."""

    n_kv = G

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.Wq = nn.Parameter(torch.randn(E, H * D) / math.sqrt(E))
        self.Wk, self.Wv = (nn.Parameter(torch.randn(E, G * D) / math.sqrt(E)) for _ in range(2))
        self.W_o = nn.Parameter(torch.randn(H * D, E) / math.sqrt(E))

    def project(self, x):
        return _heads(x @ self.Wq, H), _heads(x @ self.Wk, G), _heads(x @ self.Wv, G)

    def out_proj(self, y):
        return y @ self.W_o


class QPlusKV(Style):
    """``to_q`` and one fused ``to_kv`` [all K | all V] (lucidrains style), GQA, ``heads``, matmul + softmax."""

    kernel, n_kv = "matmul", G

    def __init__(self) -> None:
        super().__init__()
        self.heads = H
        self.to_q, self.to_kv, self.to_out = nn.Linear(E, H * D), nn.Linear(E, 2 * G * D), nn.Linear(H * D, E)

    def project(self, x):
        k, v = self.to_kv(x).chunk(2, dim=-1)
        return _heads(self.to_q(x), H), _heads(k, G), _heads(v, G)

    def out_proj(self, y):
        return self.to_out(y)


class ClampedFused(Style):
    """MPT-style ``clip_qkv``: one ``Wqkv`` Linear [Q | K | V] whose output is clamped to [-clip, clip] before
    attention, ``n_heads``, matmul + softmax, ``out_proj``. ``qk`` gives the unclamped projections (the weights)."""

    kernel = "matmul"

    def __init__(self, clip: float = 0.5) -> None:
        super().__init__()
        self.n_heads, self.clip_qkv = H, clip
        self.Wqkv, self.out_proj_ = nn.Linear(E, 3 * H * D), nn.Linear(H * D, E)

    def raw(self, x):
        q, k, v = self.Wqkv(x).chunk(3, dim=-1)
        return _heads(q, H), _heads(k, H), _heads(v, H)

    def project(self, x):
        q, k, v = self.Wqkv(x).clamp(min=-self.clip_qkv, max=self.clip_qkv).chunk(3, dim=-1)
        return _heads(q, H), _heads(k, H), _heads(v, H)

    def qk(self, x):
        q, k, _ = self.raw(x)
        return q, k

    def out_proj(self, y):
        return self.out_proj_(y)


class ClampedRope(Style):
    """OLMo-style ``clip_qkv``: ``q_proj``/``k_proj``/``v_proj`` clamped in place (``clamp_``) to [-clip, clip], then
    RoPE, GQA, SDPA, ``o_proj``."""

    n_kv = G

    def __init__(self, clip: float = 0.5) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.clip = H, G, clip
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, H * D), nn.Linear(E, G * D), nn.Linear(E, G * D)
        self.o_proj = nn.Linear(H * D, E)

    def raw(self, x):
        return _heads(self.q_proj(x), H), _heads(self.k_proj(x), G), _heads(self.v_proj(x), G)

    def project(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        for t in (q, k, v):
            t.clamp_(min=-self.clip, max=self.clip)
        return _heads(q, H), _heads(k, G), _heads(v, G)

    def shape_qk(self, q, k):
        return rope(q), rope(k)

    def qk(self, x):
        q, k, _ = self.raw(x)
        return q, k

    def out_proj(self, y):
        return self.o_proj(y)


@dataclass
class HeadsConfig:
    """The head count lives only here, as TransformerLens keeps ``cfg.n_heads``: no attribute on the module."""

    n_heads: int = H
    d_head: int = D
    d_model: int = E


class ConfigHeads3D(nn.Module):
    """TransformerLens-style attention: per-head 3-D ``W_Q``, ``W_K``, ``W_V`` (heads, d_model, d_head) with biases
    ``b_Q``, ``b_K``, ``b_V`` (heads, d_head), ``W_O`` (heads, d_head, d_model); the head count only in ``cfg``;
    scores by einsum, a causal mask, its own softmax call. ``head_first=True`` stores (heads, d_head, d_model).
    Names say nothing an adapter can use (``b_Q`` says q as much as ``W_Q``)."""

    def __init__(self, cfg: HeadsConfig | None = None, head_first: bool = False) -> None:
        super().__init__()
        self.cfg, self.head_first = cfg or HeadsConfig(), head_first
        h, d, e = self.cfg.n_heads, self.cfg.d_head, self.cfg.d_model
        shape = (h, d, e) if head_first else (h, e, d)
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(torch.randn(*shape) / math.sqrt(e)) for _ in range(3))
        self.b_Q, self.b_K, self.b_V = (nn.Parameter(0.3 * torch.randn(h, d)) for _ in range(3))
        self.W_O = nn.Parameter(torch.randn(h, d, e) / math.sqrt(h * d))
        self.b_O = nn.Parameter(torch.zeros(e))

    def per_head(self, w: Tensor) -> Tensor:
        """(heads, d_model, d_head) whatever the storage."""
        return w.transpose(1, 2) if self.head_first else w

    def qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The per-head q and k (B, H, T, D) the scores are made of."""
        q = torch.einsum("bte,hed->bhtd", x, self.per_head(self.W_Q)) + self.b_Q[:, None]
        k = torch.einsum("bte,hed->bhtd", x, self.per_head(self.W_K)) + self.b_K[:, None]
        return q, k

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (torch.einsum("bte,hed->bthd", x, self.per_head(w)) + b
                   for w, b in ((self.W_Q, self.b_Q), (self.W_K, self.b_K), (self.W_V, self.b_V)))  # (B, T, H, D)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.cfg.d_head)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        pattern = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        return torch.einsum("bqhd,hde->bqe", z, self.W_O) + self.b_O


STYLES = {cls.__name__: cls for cls in (FusedHeadsAttr, PerHeadNumHeads, PerGroupRope, TileEinsum, TileSdpa,
                                        Nested, Heads3D, OddQKNorm, NoAttrSequential, RawTransposed, QPlusKV)}


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(E), attn
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Net(nn.Module):
    """Two blocks of one style."""

    def __init__(self, style: type[Style], seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([Block(style()), Block(style())])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def per_head_weights(attn: Style) -> tuple[Tensor, Tensor]:
    """The true W_q (H, D, E) and, paired with each query head, W_k (H, D, E), float64: the identity basis
    projected through the module's own ``qk`` (minus the bias, the projection of zero)."""
    with torch.no_grad():
        basis = torch.eye(E)[None]  # (1, E tokens, E)
        q1, k1 = attn.qk(basis)
        q0, k0 = attn.qk(torch.zeros_like(basis))
    wq = (q1 - q0)[0].double().transpose(1, 2)  # (H, D, E): column e is the image of basis vector e
    wk = (k1 - k0)[0].double().transpose(1, 2)
    return wq, wk[[attn.kv_of(h) for h in range(attn.n_q)]]
