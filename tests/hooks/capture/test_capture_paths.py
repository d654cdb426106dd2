"""Every capture path against a float64 per-head reference, with the layout check on q and k.

Models written here in the styles real code uses: fairseq / fair-esm (time-first input,
``bmm`` of ``(B*H, T, D)`` tensors, key padding by ``view`` + ``masked_fill``, softmax in
float32), BLOOM-like ``baddbmm``, ``einsum`` on ``(B, H, T, D)`` and on ``(B, T, H, D)``
operands, ``'...id,...jd->...ij'``. For each: entropy (mean over token rows), rank and max
logit per head equal a reference computed by hand from the weights in float64 with
per-head loops; the capture identified the kernel's q and k and the layout check compared
them per head ("q,k"). A wrong head pairing on the einsum path is refused; logits built
without a recognisable product are measured but reported once as not verifiable; a
second attention call in one forward is reported once as not measured.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diag.layouts.vocab import QKVLayout
from diag.math.attention import stats_from_probabilities_reference
from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor

E, H, T, B = 32, 4, 9, 3
D = E // H
REL = 1e-6


class Attention(nn.Module):
    """Separate q/k/v projections; ``style`` picks how the logits are formed."""

    def __init__(self, style: str, kv_heads: int = H, pairing: str = "interleave") -> None:
        super().__init__()
        self.style, self.kv_heads, self.pairing = style, kv_heads, pairing
        self.q_proj, self.out_proj = nn.Linear(E, E), nn.Linear(E, E)
        self.k_proj, self.v_proj = nn.Linear(E, kv_heads * D), nn.Linear(E, kv_heads * D)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:  # (B, T, n*D) -> (B, n, T, D)
        return x.unflatten(-1, (n, D)).transpose(1, 2)

    def expand(self, k: torch.Tensor) -> torch.Tensor:  # (B, G, S, D) -> (B, H, S, D)
        r = H // self.kv_heads
        return k.repeat_interleave(r, 1) if self.pairing == "interleave" else k.repeat(1, r, 1, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        if self.style in ("bmm", "baddbmm"):
            return self.fairseq(x, pad)
        q, k, v = self.heads(self.q_proj(x), H), self.heads(self.k_proj(x), self.kv_heads), self.v_proj(x)
        k, v = self.expand(k), self.expand(self.heads(v, self.kv_heads))
        if self.style == "einsum":
            s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D)
        elif self.style == "einsum-bthd":
            s = torch.einsum("bqhd,bkhd->bhqk", q.transpose(1, 2), k.transpose(1, 2)) * D**-0.5
        elif self.style == "einsum-ellipsis":
            s = torch.einsum("...id,...jd->...ij", q * D**-0.5, k)
        elif self.style == "einsum-grouped":  # GQA without repeating k: (B, G, R, T, D) queries
            r = H // self.kv_heads
            qg = self.heads(self.q_proj(x), H).unflatten(1, (self.kv_heads, r))
            kg = self.heads(self.k_proj(x), self.kv_heads)
            s = torch.einsum("bgrid,bgjd->bgrij", qg, kg) / math.sqrt(D)  # (B, G, R, T, S)
        elif self.style == "matmul-grouped":
            r = H // self.kv_heads
            qg = self.heads(self.q_proj(x), H).unflatten(1, (self.kv_heads, r))  # (B, G, R, T, D)
            kg = self.heads(self.k_proj(x), self.kv_heads)[:, :, None]  # (B, G, 1, S, D)
            s = qg @ kg.transpose(-1, -2) / math.sqrt(D)  # (B, G, R, T, S)
        else:  # "broadcast": no product the capture recognises
            s = (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1) / math.sqrt(D)
        if pad is not None:
            s = s.masked_fill(pad.view(-1, *(1,) * (s.dim() - 2), pad.shape[-1]), -math.inf)
        y = s.softmax(dim=-1).reshape(-1, H, *s.shape[-2:]) @ v
        return self.out_proj(y.transpose(1, 2).flatten(2))

    def fairseq(self, x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """fairseq's MultiheadAttention (and fair-esm's): x is (T, B, E), time first."""
        tgt, bsz, _ = x.shape
        q = self.q_proj(x) * D**-0.5
        q = q.contiguous().view(tgt, bsz * H, D).transpose(0, 1)  # (B*H, T, D)
        k = self.k_proj(x).contiguous().view(-1, bsz * H, D).transpose(0, 1)
        v = self.v_proj(x).contiguous().view(-1, bsz * H, D).transpose(0, 1)
        if self.style == "bmm":
            w = torch.bmm(q, k.transpose(1, 2))  # (B*H, T, S)
        else:  # BLOOM: the bias the product is added to (here zeros), then viewed as (B, H, T, S)
            w = torch.zeros(bsz * H, tgt, tgt).baddbmm(q, k.transpose(1, 2), beta=1.0, alpha=1.0)
        if pad is not None:
            w = w.view(bsz, H, tgt, tgt).masked_fill(pad[:, None, None, :], float("-inf")).view(bsz * H, tgt, tgt)
        p = F.softmax(w.float() if self.style == "bmm" else w.view(bsz, H, tgt, tgt), dim=-1)
        y = torch.bmm(p.view(bsz * H, tgt, tgt), v)  # (B*H, T, D)
        return self.out_proj(y.transpose(0, 1).contiguous().view(tgt, bsz, E))


class Model(nn.Module):
    def __init__(self, style: str, **kw) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.style = style
        self.emb = nn.Embedding(50, E)
        self.blocks = nn.ModuleList(Attention(style, **kw) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(E) for _ in range(2))

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids)
        time_first = self.style in ("bmm", "baddbmm")
        if time_first:
            x = x.transpose(0, 1)
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x), pad)
        return x.transpose(0, 1) if time_first else x


def batch(left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, slice(0, 3) if left else slice(-3, None)] = True  # padding in the second sequence
    return ids, pad


SPEC = {"blocks.*": QKVLayout(H, D, "q_proj.weight", "k_proj.weight", "v_proj.weight")}


def run(model: Model, spec=SPEC, with_pad: bool = True, left: bool = False, **kw):
    sink = MemorySink()
    ids, pad = batch(left)
    inputs = {}
    def keep(i: int):
        def hook(module, args):
            inputs.setdefault(i, args[0].detach().clone())  # returns None: the args stay as they are

        return hook

    hooks = [b.register_forward_pre_hook(keep(i)) for i, b in enumerate(model.blocks)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(model, every=1, sinks=[sink], spec=spec, signals=("attention", "spectra"), **kw)
        model(ids, pad if with_pad else None).square().mean().backward()
        checked, notes = dict(monitor.capture.checked), dict(monitor.capture.notes)
        monitor.step(0)
        monitor.close()
    for h in hooks:
        h.remove()
    return sink.records[0].scalars, checked, notes, inputs, [str(w.message) for w in caught]


@torch.no_grad()
def reference(model: Model, inputs: dict, with_pad: bool = True, rank_rows: int = 256,
              left: bool = False) -> list[dict]:
    """Per layer: entropy, rank (over token rows) and max logit per head, float64, per-head loops."""
    _, pad = batch(left)
    n = 2
    pad = pad[:n] if with_pad else torch.zeros(n, T, dtype=torch.bool)
    tokens = ~pad
    out = []
    for i, block in enumerate(model.blocks):
        x = inputs[i].detach().double()
        x = x.transpose(0, 1) if model.style in ("bmm", "baddbmm") else x
        x = x[:n]  # (n, T, E)
        q = x @ block.q_proj.weight.double().T + block.q_proj.bias.double()
        k = x @ block.k_proj.weight.double().T + block.k_proj.bias.double()
        logits = torch.empty(n, H, T, T, dtype=torch.float64)
        for h in range(H):
            g = h // (H // block.kv_heads) if block.pairing == "interleave" else h % block.kv_heads
            qh, kh = q[..., h * D : (h + 1) * D], k[..., g * D : (g + 1) * D]
            logits[:, h] = qh @ kh.transpose(-1, -2) / math.sqrt(D)
        allowed = tokens[:, None, :].expand(n, T, T)
        probs = logits.masked_fill(~allowed[:, None], -math.inf).softmax(-1)
        entropy, rank = stats_from_probabilities_reference(probs, allowed, rank_rows, query_valid=tokens)
        valid = (allowed & tokens[:, :, None])[:, None]
        max_logit = logits.masked_fill(~valid, -math.inf).amax(dim=(0, 2, 3))
        out.append({"attn_entropy": entropy, "attn_rank": rank, "attn_max_logit": max_logit})
    return out


def assert_matches(scalars: dict, ref: list[dict]) -> None:
    for i, layer in enumerate(ref):
        for metric, values in layer.items():
            got = [scalars[f"{metric}/L{i:02d}/H{h:02d}"] for h in range(H)]
            assert got == pytest.approx(values.tolist(), rel=REL), (metric, i)


@pytest.mark.parametrize("style", ["bmm", "baddbmm", "einsum", "einsum-bthd", "einsum-ellipsis"])
@pytest.mark.parametrize("with_pad", [True, False])
def test_each_path_is_exact_and_verified_per_head(style, with_pad):
    model = Model(style).train()
    scalars, checked, notes, inputs, caught = run(model, with_pad=with_pad)
    assert checked == {0: "q,k", 1: "q,k"}, checked  # the kernel's q and k compared with the projections
    assert notes == {} and not caught, (notes, caught)
    assert_matches(scalars, reference(model, inputs, with_pad))


@pytest.mark.parametrize("style", ["einsum-grouped", "matmul-grouped"])
def test_grouped_query_logits_without_repeated_keys(style):
    """5-D (B, G, R, T, S) logits from keys that were never repeated: query head g*R + r, key head g."""
    model = Model(style, kv_heads=2).train()
    spec = {"blocks.*": QKVLayout(H, D, "q_proj.weight", "k_proj.weight", "v_proj.weight", n_kv_heads=2)}
    scalars, checked, notes, inputs, caught = run(model, spec)
    assert checked == {0: "q,k", 1: "q,k"} and notes == {} and not caught, (checked, notes, caught)
    assert_matches(scalars, reference(model, inputs))


@pytest.mark.parametrize("style", ["bmm", "einsum"])
def test_rank_takes_the_first_token_rows(style):
    """Left padding: the rank's 4 rows are the first 4 tokens (rows 3-6 of the padded sequence), not rows 0-3."""
    model = Model(style).train()
    scalars, _, _, inputs, _ = run(model, left=True, attn_rank_rows=4)
    assert_matches(scalars, reference(model, inputs, rank_rows=4, left=True))
    assert scalars["attn_rows/L00"] == 4


def test_a_wrong_head_pairing_on_the_einsum_path_is_refused():
    """Query head h uses key head h % G; a layout that says h // (H/G) gives another head's sigma_1: refused."""
    model = Model("einsum", kv_heads=2, pairing="tile").train()
    spec = {"blocks.*": QKVLayout(H, D, "q_proj.weight", "k_proj.weight", "v_proj.weight", n_kv_heads=2)}
    scalars, checked, _, _, caught = run(model, spec)
    assert checked == {}
    assert not any(t.startswith(("attn_", "qk_")) for t in scalars)
    assert sum("not measured" in m and "key heads" in m for m in caught) == 2, caught
    right = Model("einsum", kv_heads=2, pairing="interleave").train()  # the pairing the layout says: exact
    scalars, checked, _, inputs, _ = run(right, spec)
    assert checked == {0: "q,k", 1: "q,k"}
    assert_matches(scalars, reference(right, inputs))


def test_logits_from_no_recognised_product_are_reported_not_verifiable():
    model = Model("broadcast").train()
    scalars, checked, notes, inputs, caught = run(model)
    assert checked == {0: "heads", 1: "heads"}
    assert set(notes) == {0, 1} and all("not verifiable" in n for n in notes.values())
    assert sum("not verifiable" in m for m in caught) == 2  # once per layer
    assert_matches(scalars, reference(model, inputs))  # still exact: the logits are the softmax's input


class TwoCalls(nn.Module):
    """Calls SDPA twice in one forward (e.g. two attention branches): only the first is measured; said once."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.n_heads = nn.Linear(E, 3 * E), H

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (H, D)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v) + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).flatten(2)


def test_a_second_attention_call_in_one_forward_is_reported():
    model = nn.Sequential(TwoCalls()).train()
    spec = {"0": QKVLayout(H, D, "qkv.weight", packing="fused")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(model, every=1, sinks=[MemorySink()], spec=spec, signals=("attention",))
        model(torch.randn(2, 5, E)).sum().backward()
        monitor.step(0)
        monitor.close()
    messages = [str(w.message) for w in caught]
    assert sum("2 attention calls" in m and "only the first is measured" in m for m in messages) == 1, messages


def test_the_capture_sees_every_product_form():
    from hooks.capture.kernels import product_operands

    a, b = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 4)
    for func, args in [(torch.einsum, ("bhid,bhjd->bhij", a, b)), (torch.einsum, ("bhjd,bhid->bhij", b, a)),
                       (torch.einsum, ("bhid,bhjd->bhij", [a, b])), (torch.matmul, (a, b.transpose(-1, -2)))]:
        p = product_operands(func, args, {}, func(*args))
        assert torch.equal(p.q, a) and torch.equal(p.k, b), (func, args[0])
    assert product_operands(torch.einsum, ("bhid,bhid->bhi", a, a), {}, torch.einsum("bhid,bhid->bhi", a, a)) is None


def test_a_sampled_step_without_a_training_forward_is_reported():
    """The module ran, but only in eval mode (a frozen block): said once, with the reason, not silently absent."""
    model = Model("einsum").train()
    model.blocks[1].eval()
    ids, pad = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(model, every=1, sinks=[MemorySink()], spec=SPEC, signals=("attention",))
        model(ids, pad).square().mean().backward()
        monitor.step(0)
        model(ids, pad).square().mean().backward()
        monitor.step(1)
        monitor.close()
    messages = [str(w.message) for w in caught]
    assert sum("blocks.1 not measured" in m and "only in eval mode" in m for m in messages) == 1, messages
    assert not any("blocks.0" in m for m in messages)


def test_time_first_input_as_long_as_the_batch_is_still_verified():
    """(T, B, E) with T == B: both readings fit the shapes; the one whose projections match is taken."""
    model = Model("bmm").train()
    ids = torch.randint(0, 50, (4, 4), generator=torch.Generator().manual_seed(2))
    monitor = Monitor(model, every=1, sinks=[MemorySink()], spec=SPEC, signals=("attention",))
    model(ids).square().mean().backward()
    checked = dict(monitor.capture.checked)
    monitor.step(0)
    monitor.close()
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused


# ------------------------------------------------------------------ third-party code (PyPI: x-transformers)


@pytest.mark.parametrize("flash", [False, True])
def test_x_transformers_padded_batch_matches_its_own_attention(flash):
    """x-transformers (einsum logits, or SDPA with attn_flash), key padding through its ``mask`` argument (not
    called attention_mask: the padding is read from the kernel). Entropy and rank per head equal its own
    post-softmax attention (return_intermediates) over the token rows; q and k checked per head."""
    import x_transformers as xt  # in the test extra: never a skip
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=50, max_seq_len=16, attn_layers=xt.Encoder(
        dim=E, depth=2, heads=H, attn_dim_head=D, attn_flash=flash))
    layout = QKVLayout(H, D, "to_q.weight", "to_k.weight", "to_v.weight")
    spec = {"attn_layers.layers.0.1": layout, "attn_layers.layers.2.1": layout}
    ids, pad = batch(left=True)
    sink = MemorySink()
    monitor = Monitor(model, every=1, sinks=[sink], spec=spec, signals=("attention",), attn_rank_rows=4)
    model.train()
    model(ids, mask=~pad).logsumexp(-1).mean().backward()
    checked = dict(monitor.capture.checked)
    monitor.step(0)
    monitor.close()
    assert checked == {0: "q,k", 1: "q,k"} and not monitor.refused
    model.eval()
    with torch.no_grad():  # flash=True returns no probabilities: the same weights without flash give them
        ref_model = xt.TransformerWrapper(num_tokens=50, max_seq_len=16, attn_layers=xt.Encoder(
            dim=E, depth=2, heads=H, attn_dim_head=D))
        ref_model.load_state_dict(model.state_dict())
        _, inter = ref_model.eval()(ids[:2], mask=~pad[:2], return_intermediates=True)
    tokens = ~pad[:2]
    for i, a in enumerate(inter.attn_intermediates):
        p = a.post_softmax_attn.double()  # (2, H, T, T)
        entropy, rank = stats_from_probabilities_reference(p, tokens[:, None, :].expand(2, T, T), 4, tokens)
        for metric, ref in (("attn_entropy", entropy), ("attn_rank", rank)):
            got = [sink.records[0].scalars[f"{metric}/L{i:02d}/H{h:02d}"] for h in range(H)]
            assert got == pytest.approx(ref.tolist(), rel=1e-5), (metric, i)


class KeywordInput(nn.Module):
    """SDPA on q and k the capture sees, but the input arrives as ``feats=``: nothing to project and compare."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.n_heads = nn.Linear(E, 3 * E), H

    def forward(self, *, feats: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (H, D)).transpose(1, 2) for t in self.qkv(feats).chunk(3, -1))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


def test_q_and_k_without_a_visible_input_are_reported_not_verifiable():
    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = KeywordInput()

        def forward(self, x):
            return self.attn(feats=x)

    model = Wrap().train()
    spec = {"attn": QKVLayout(H, D, "qkv.weight", packing="fused")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(model, every=1, sinks=[MemorySink()], spec=spec, signals=("attention",))
        model(torch.randn(2, 5, E)).sum().backward()
        checked = dict(monitor.capture.checked)
        monitor.step(0)
        monitor.close()
    assert checked == {0: "shapes"}
    assert sum("not verifiable" in str(w.message) and "module input" in str(w.message) for w in caught) == 1
