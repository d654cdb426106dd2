"""The layout probe of a large Hugging Face model holds one attention module and little else: one layer, the
feed-forward widths, vocabulary and position tables cut; query/key heads scaled in place (no copy of a weight);
the layouts found still exact against float64 full SVDs."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

import hooks.checkpoint.search as search
from diag.layouts.vocab import QKVLayout
from diag.offline.series import analyze_checkpoints
from hooks.checkpoint import verdicts as verdicts_module
from hooks.checkpoint.search import ModelLayouts
from tests.offline.reference import assert_layer, head_spectra

E, H, G = 64, 8, 2


def _attention_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_the_twin_of_a_large_model_is_one_attention_module_and_little_else(family, tmp_path, monkeypatch):
    """Was: 2 layers with the whole feed-forward (at 70B width, 11 GB of float64 MLP weights)."""
    cfg = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "gemma2": tf.Gemma2Config}[family](
        hidden_size=E, intermediate_size=4096, num_hidden_layers=5, num_attention_heads=H, num_key_value_heads=G,
        head_dim=E // H, vocab_size=20000, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "checkpoint-1")
    monkeypatch.setattr(search, "MAX_TWIN_PARAMS", 1000)
    twins = []
    real = search.verdicts

    def seen(twin, batch, cands):
        twins.append(twin)
        return real(twin, batch, cands)

    monkeypatch.setattr(search, "verdicts", seen)
    analysis = analyze_checkpoints([tmp_path / "checkpoint-1"], model_layout=ModelLayouts())
    assert not analysis.failures and len(analysis.layers) == 5 and analysis.heads.source == "model"
    (twin,) = twins
    attention = _attention_params(twin.model.layers[0].self_attn)
    others = sum(p.numel() for p in twin.parameters()) - attention
    assert len(twin.model.layers) == 1 and twin.config.intermediate_size == search.PROBE_FFN
    assert others <= 2 * search.PROBE_VOCAB * E + 3 * search.PROBE_FFN * E + 8 * E  # embeddings, head, MLP, norms
    assert all(p.dtype == torch.float64 for p in twin.parameters())
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert_layer(analysis.spectra[1][f"L0{i}"], head_spectra(attn.q_proj.weight, attn.k_proj.weight, H,
                                                                 [h // (H // G) for h in range(H)]))


LAYOUTS = {
    "separate": (QKVLayout(4, 2, "q.weight", "k.weight", "v.weight", n_kv_heads=2),
                 {"q.weight": (8, 8), "k.weight": (4, 8), "v.weight": (4, 8)}),
    "separate-tiled": (QKVLayout(4, 2, "q.weight", "k.weight", "v.weight", n_kv_heads=2, kv_map=(0, 1, 0, 1)),
                       {"q.weight": (8, 8), "k.weight": (4, 8), "v.weight": (4, 8)}),
    "transposed": (QKVLayout(4, 2, "q.weight", "k.weight", "v.weight", n_kv_heads=2, transposed=True),
                   {"q.weight": (8, 8), "k.weight": (8, 4), "v.weight": (8, 4)}),
    "fused": (QKVLayout(4, 2, "qkv.weight", packing="fused", n_kv_heads=2), {"qkv.weight": (16, 8)}),
    "fused_per_head": (QKVLayout(4, 2, "qkv.weight", packing="fused_per_head"), {"qkv.weight": (24, 8)}),
    "fused_per_group": (QKVLayout(4, 2, "qkv.weight", packing="fused_per_group", n_kv_heads=2, groups=2,
                                  order="qvk"), {"qkv.weight": (16, 8)}),
    "q_kv": (QKVLayout(4, 2, "q.weight", "kv.weight", packing="q_kv", n_kv_heads=2),
             {"q.weight": (8, 8), "kv.weight": (8, 8)}),
    "heads_3d": (QKVLayout(4, 2, "wq", "wk", "wv", packing="heads_3d", n_kv_heads=2),
                 {"wq": (4, 2, 8), "wk": (2, 2, 8), "wv": (2, 2, 8)}),
}


class _Holder(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, nn.Parameter(torch.randn(*shape, dtype=torch.float64)))
            if leaf == "weight":
                owner.register_parameter("bias", nn.Parameter(torch.randn(shape[0], dtype=torch.float64)))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("with_k", [True, False])
def test_scaling_in_place_equals_the_scaling_by_element_numbers(name, with_k):
    """The in-place scaling through views of the weights (no copy) scales exactly the elements the reference
    (a factor per element found by splitting element numbers with the layout) does, biases alike; after the
    test the weights are back to within one rounding."""
    layout, shapes = LAYOUTS[name]
    torch.manual_seed(0)
    module = _Holder(shapes)
    params = dict(module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    want = {n: before[n] * s for n, s in verdicts_module._scales(layout, params, with_k).items()}
    assert verdicts_module._views(layout, params) is not None  # no packing needs a copy
    with verdicts_module._scaled(module, layout, with_k):
        for n, p in params.items():
            torch.testing.assert_close(p.detach(), want.get(n, before[n]), rtol=1e-15, atol=0)
    for n, p in params.items():
        torch.testing.assert_close(p.detach(), before[n], rtol=4e-16, atol=0)
