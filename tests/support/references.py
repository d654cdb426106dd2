"""Slow, obviously correct references shared by the test files: one copy of each hand computation.

By hand, per family, written out here independently of ``diag``: which modules are the attention layers
(:func:`attention_modules`), their Q/K/V weights sliced per head (:func:`hand_sliced`), the keys each query may
see (:func:`allowed_keys`, :func:`token_rows`) and the float64 logits recomputed from each module's recorded
inputs, the hand-sliced weights and biases, RoPE through the family's own function and T5's relative position
bias (:func:`logits_by_hand`). A new family adds a branch to each, then a row to
``tests/math/test_max_logit_matrix.py``'s matrix.

The max attention logit, by hand: the largest of a head's float64 logits over the keys each query may see,
compared with the Monitor's ``attn_max_logit/<layer>/H<h>`` scalars (:func:`assert_max_logits`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.support import zoo

N_SEQ = 2  # the Monitor's default attn_seqs
ONE_IMPLEMENTATION = ("nanogpt", "torch-encoder", "torch-seq2seq")  # zoo names without an implementation suffix


def family(case: zoo.Case) -> str:
    """The family of a zoo case: its name less the attention implementation (``gpt2-cross-sdpa``: ``gpt2-cross``)."""
    return case.name if case.name in ONE_IMPLEMENTATION else case.name.rsplit("-", 1)[0]


def attention_modules(case: zoo.Case) -> list[tuple[nn.Module, bool]]:
    """(module, is_cross) in the order of the model's layers: encoder, then decoder self / cross."""
    m, fam = case.model, family(case)
    if fam == "nanogpt":
        return [(b.attn, False) for b in m.h]
    if fam == "gpt2":
        return [(b.attn, False) for b in m.transformer.h]
    if fam == "torch-encoder":
        return [(layer.self_attn, False) for layer in m.encoder.layers]
    if fam in ("bert", "roberta"):
        return [(layer.attention.self, False) for layer in getattr(m, fam).encoder.layer]
    if fam == "vit":
        return [(layer.attention, False) for layer in m.vit.layers]
    if fam in ("llama", "mistral", "qwen3"):
        return [(layer.self_attn, False) for layer in m.model.layers]
    if fam == "gpt-neox":
        return [(layer.attention, False) for layer in m.gpt_neox.layers]
    if fam == "t5":
        enc = [(b.layer[0].SelfAttention, False) for b in m.encoder.block]
        return enc + [x for b in m.decoder.block for x in ((b.layer[0].SelfAttention, False),
                                                            (b.layer[1].EncDecAttention, True))]
    if fam == "bart":
        enc = [(layer.self_attn, False) for layer in m.model.encoder.layers]
        return enc + [x for layer in m.model.decoder.layers for x in ((layer.self_attn, False),
                                                                      (layer.encoder_attn, True))]
    if fam == "gpt2-cross":
        return [x for b in m.transformer.h for x in ((b.attn, False), (b.crossattention, True))]
    enc = [(layer.self_attn, False) for layer in m.encoder.layers]
    return enc + [x for layer in m.decoder.layers for x in ((layer.self_attn, False), (layer.multihead_attn, True))]


def hand_sliced(case: zoo.Case, module: nn.Module, attr: str) -> dict:
    """Wq (H*D, E), Wk, Wv (G*D, E), biases bq, bk (or None), H, G, D: one family at a time."""
    def get(p):
        return None if p is None else getattr(p, attr)

    fam = family(case)
    if fam in ("bert", "roberta"):
        h, d = module.num_attention_heads, module.attention_head_size
        return dict(wq=get(module.query.weight), wk=get(module.key.weight), wv=get(module.value.weight),
                    bq=get(module.query.bias), bk=get(module.key.bias), H=h, G=h, D=d)
    if fam in ("vit", "llama", "mistral", "qwen3", "bart"):
        d = module.head_dim
        h, g = module.q_proj.weight.shape[0] // d, module.k_proj.weight.shape[0] // d
        return dict(wq=get(module.q_proj.weight), wk=get(module.k_proj.weight), wv=get(module.v_proj.weight),
                    bq=get(module.q_proj.bias), bk=get(module.k_proj.bias), H=h, G=g, D=d)
    if fam == "gpt-neox":
        d = module.head_size
        w, b = get(module.query_key_value.weight), get(module.query_key_value.bias)
        h = w.shape[0] // (3 * d)
        rows = [[range(i * 3 * d + j * d, i * 3 * d + (j + 1) * d) for i in range(h)] for j in range(3)]
        pick = [torch.tensor([r for rng in part for r in rng]) for part in rows]  # per head [Q_h | K_h | V_h]
        return dict(wq=w[pick[0]], wk=w[pick[1]], wv=w[pick[2]], bq=b[pick[0]], bk=b[pick[1]], H=h, G=h, D=d)
    if fam == "t5":
        h, d = module.n_heads, module.key_value_proj_dim
        return dict(wq=get(module.q.weight), wk=get(module.k.weight), wv=get(module.v.weight), bq=None, bk=None,
                    H=h, G=h, D=d)
    if fam == "nanogpt":
        w, b, h = get(module.c_attn.weight), get(module.c_attn.bias), module.n_head
        e = w.shape[1]
        return dict(wq=w[:e], wk=w[e : 2 * e], wv=w[2 * e :], bq=b[:e], bk=b[e : 2 * e], H=h, G=h, D=e // h)
    if fam in ("gpt2", "gpt2-cross"):
        h, d = module.num_heads, module.head_dim
        e = h * d
        if module.is_cross_attention:  # Conv1D stores (in, out): q_attn (E, E), c_attn (E, 2E) = [K | V]
            wkv, bkv = get(module.c_attn.weight).T, get(module.c_attn.bias)
            return dict(wq=get(module.q_attn.weight).T, wk=wkv[:e], wv=wkv[e:], bq=get(module.q_attn.bias),
                        bk=bkv[:e], H=h, G=h, D=d)
        w, b = get(module.c_attn.weight).T, get(module.c_attn.bias)
        return dict(wq=w[:e], wk=w[e : 2 * e], wv=w[2 * e :], bq=b[:e], bk=b[e : 2 * e], H=h, G=h, D=d)
    w, b = get(module.in_proj_weight), get(module.in_proj_bias)
    e, h = w.shape[1], module.num_heads
    return dict(wq=w[:e], wk=w[e : 2 * e], wv=w[2 * e :], bq=b[:e], bk=b[e : 2 * e], H=h, G=h, D=e // h)


def allowed_keys(case: zoo.Case, batch: dict, index: int) -> torch.Tensor:
    """(N, Q, K) allowed keys of the index-th attention module, by hand."""
    fam, n = family(case), N_SEQ
    layers = attention_modules(case)
    is_cross = layers[index][1]
    n_enc = sum(1 for _, c in layers if not c) - sum(1 for _, c in layers if c)  # encoder self-attention layers

    def causal(t: int) -> torch.Tensor:
        return torch.ones(t, t, dtype=torch.bool).tril()[None].expand(n, t, t)

    if fam == "vit":
        t = 1 + (16 // 4) ** 2
        return torch.ones(n, t, t, dtype=torch.bool)
    if fam == "nanogpt":
        return causal(batch["input_ids"].shape[1])
    if fam in ("torch-seq2seq", "torch-encoder"):
        src_ok = ~batch["pad"][:n]
        if index < n_enc:
            return src_ok[:, None, :].expand(n, src_ok.shape[1], -1)
        t = batch["tgt"].shape[1]
        return src_ok[:, None, :].expand(n, t, -1) if is_cross else causal(t)
    mask = batch["attention_mask"][:n].bool()
    seq = mask.shape[1]
    if fam in ("bert", "roberta"):
        return mask[:, None, :].expand(n, seq, seq)
    if fam in ("gpt2", "llama", "mistral", "qwen3", "gpt-neox"):
        return causal(seq) & mask[:, None, :]
    if fam == "gpt2-cross":
        if is_cross:
            enc = batch["encoder_attention_mask"][:n].bool()
            return enc[:, None, :].expand(n, seq, -1)
        return causal(seq) & mask[:, None, :]
    t = batch["labels"].shape[1]  # t5, bart: encoder over the source, decoder over the target
    if index < n_enc:
        return mask[:, None, :].expand(n, seq, seq)
    return mask[:, None, :].expand(n, t, seq) if is_cross else causal(t)


def token_rows(case: zoo.Case, batch: dict, index: int) -> torch.Tensor:
    """(N, Q) query rows of the index-th attention module that are tokens, not padding, by hand: the encoder's
    (or a decoder-only model's) self-attention over the padded source; every row of a decoder's."""
    n, probe = N_SEQ, allowed_keys(case, batch, index)
    layers = attention_modules(case)
    n_enc = sum(1 for _, c in layers if not c) - sum(1 for _, c in layers if c)
    if layers[index][1] or family(case) in ("vit", "nanogpt") or (family(case) in ("t5", "bart", "torch-seq2seq")
                                                     and index >= n_enc):
        return torch.ones(probe.shape[:2], dtype=torch.bool)
    if family(case) in ("torch-seq2seq", "torch-encoder"):
        return ~batch["pad"][:n]
    return batch["attention_mask"][:n].bool()


def logits_by_hand(case: zoo.Case, batch: dict, at_step0: zoo.Case, weights: zoo.Case | None = None
                   ) -> list[torch.Tensor]:
    """(N, H, Q, K) float64 logits from recorded module inputs and hand-sliced weights, excluded keys -inf.
    The inputs are those of ``at_step0``'s forward; ``weights``: a model of the same architecture whose weights
    are sliced instead of ``at_step0``'s (the logits of other weights on the same inputs, layer by layer)."""
    fam, n = family(case), N_SEQ
    sliced = attention_modules(weights if weights is not None else at_step0)
    small = {k: v[:n] for k, v in batch.items()}
    mods = attention_modules(at_step0)
    calls: dict[int, tuple] = {}
    outs: dict[int, object] = {}
    hooks = []
    for i, (m, _) in enumerate(mods):
        hooks.append(m.register_forward_pre_hook(
            lambda mod, a, kw, i=i: calls.setdefault(i, (a, kw)), with_kwargs=True))
        hooks.append(m.register_forward_hook(lambda mod, a, o, i=i: outs.setdefault(i, o)))
    with torch.no_grad():
        at_step0.loss(at_step0.model, small)
    for h in hooks:
        h.remove()
    result = []
    for i, (m, is_cross) in enumerate(mods):
        args, kw = calls[i]
        w = {k: (v.double() if isinstance(v, torch.Tensor) else v)
             for k, v in hand_sliced(at_step0, sliced[i][0], "data").items()}
        if fam in ("torch-seq2seq", "torch-encoder"):
            x = args[0].double()
            src = (args[1] if len(args) > 1 else kw["key"]).double()
        else:
            x = (args[0] if args else kw["hidden_states"]).double()
            src = kw.get("key_value_states", kw.get("encoder_hidden_states")) if is_cross else None
            src = x if src is None else src.double()
        q = x @ w["wq"].T + (0 if w["bq"] is None else w["bq"])
        k = src @ w["wk"].T + (0 if w["bk"] is None else w["bk"])
        q = q.unflatten(-1, (w["H"], w["D"])).transpose(1, 2)  # (n, H, Q, D)
        k = k.unflatten(-1, (w["G"], w["D"])).transpose(1, 2)  # (n, G, K, D)
        if fam == "qwen3":  # QK-norm: per-head RMSNorm of q and k before RoPE
            from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as rope

            q, k = m.q_norm(q), m.k_norm(k)
        if fam == "llama":
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as rope
        elif fam == "mistral":
            from transformers.models.mistral.modeling_mistral import apply_rotary_pos_emb as rope
        elif fam == "gpt-neox":
            from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as rope
        if fam in ("llama", "mistral", "qwen3", "gpt-neox"):
            cos, sin = (t.double() for t in kw["position_embeddings"])
            q, k = rope(q, k, cos, sin)
        k = k.repeat_interleave(w["H"] // w["G"], dim=1)
        scale = 1.0 if fam == "t5" else 1 / math.sqrt(w["D"])
        logits = q @ k.transpose(-1, -2) * scale
        if fam == "t5":
            logits = logits + outs[i][1].double()  # the relative position bias the layer used (zeros if none)
        allowed = (allowed_keys(case, batch, i) & token_rows(case, batch, i)[:, :, None])[:, None]
        result.append(logits.masked_fill(~allowed, -math.inf))
    return result


def max_logit_by_hand(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> list[float]:
    """Per head, the largest logit over allowed (query, key) pairs: logits (N, H, Q, K) float64; allowed
    (N, Q, K) or (N, 1, Q, K) bool, None when every pair is allowed (or the excluded ones are already -inf).
    A loop over heads, one ``max`` each."""
    if allowed is not None:
        logits = logits.masked_fill(~(allowed if allowed.dim() == 4 else allowed[:, None]), -math.inf)
    return [logits[:, h].max().item() for h in range(logits.shape[1])]


def assert_max_logits(scalars: dict[str, float], label: str, logits: torch.Tensor, allowed: torch.Tensor | None = None,
                      rel: float = 1e-4, abs: float = 0.0) -> None:  # noqa: A002 - pytest.approx's name
    """Every head's ``attn_max_logit/<label>/H<h>`` equals :func:`max_logit_by_hand` to ``rel`` (and ``abs``)."""
    for h, ref in enumerate(max_logit_by_hand(logits, allowed)):
        got = scalars[f"attn_max_logit/{label}/H{h:02d}"]
        assert got == pytest.approx(ref, rel=rel, abs=abs), (label, h, got, ref)
