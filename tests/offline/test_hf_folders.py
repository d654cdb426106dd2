"""Hugging Face folders analysed with no options: the layouts of the model transformers builds from config.json.

Six families the name adapters do not know (Falcon, BLOOM, MPT, Phi-3, GPT-BigCode multi-query and
multi-head, DeBERTa-v2) and the zoo's Hugging Face families, each saved with ``save_pretrained``: every
head's spectrum equals a float64 full SVD of Wq_h^T Wk_h sliced by hand the way the family's own modeling
code splits its projections, and the live Monitor's (given the same layout as a spec where the name
discovery does not find it).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import transformers as tf

from diag.cli.main import main
from diag.layouts.infer import fused_layouts
from diag.layouts.vocab import QKVLayout, split_qkv
from diag.offline.series import analyze_checkpoints
from diag.outputs.sinks import MemorySink
from hooks.checkpoint.search import ModelLayouts
from hooks.checkpoint.verdicts import verdicts
from hooks.monitor.monitor import Monitor
from tests.support import zoo

H, D, E = 4, 8, 32
TAGS = ("qk_sigma1", "qk_sec", "qk_erank", "qk_stable_rank")


def _fused_qkv(w, g):  # rows [all Q | all K | all V]
    return w[: H * D].reshape(H, D, E), w[H * D : (H + g) * D].reshape(g, D, E)


def _per_head(w, width=3):  # rows per head [Q_h | K_h | V_h]
    per = w.reshape(H, width, D, E)
    return per[:, 0], per[:, 1]


# family -> (config, hand slicing of one attention module -> (q (H, D, E), k (G, D, E)), module name pattern,
# the layout as a Monitor spec (the live name discovery does not know these families))
FAMILIES = {
    "falcon-multi-query": (
        lambda: tf.FalconConfig(vocab_size=64, hidden_size=E, num_hidden_layers=2, num_attention_heads=H,
                                multi_query=True, new_decoder_architecture=False, alibi=False, bias=True),
        lambda m: _fused_qkv(m.query_key_value.weight, 1), "transformer.h.*.self_attention",
        QKVLayout(H, D, q="query_key_value.weight", packing="fused", n_kv_heads=1)),
    "falcon-multi-head": (
        lambda: tf.FalconConfig(vocab_size=64, hidden_size=E, num_hidden_layers=2, num_attention_heads=H,
                                multi_query=False, new_decoder_architecture=False),
        lambda m: _per_head(m.query_key_value.weight), "transformer.h.*.self_attention",
        QKVLayout(H, D, q="query_key_value.weight", packing="fused_per_head")),
    "bloom": (
        lambda: tf.BloomConfig(vocab_size=64, hidden_size=E, n_layer=2, n_head=H),
        lambda m: _per_head(m.query_key_value.weight), "transformer.h.*.self_attention",
        QKVLayout(H, D, q="query_key_value.weight", packing="fused_per_head")),
    "mpt": (
        lambda: tf.MptConfig(vocab_size=64, d_model=E, n_layers=2, n_heads=H, max_seq_len=64),
        lambda m: _fused_qkv(m.Wqkv.weight, H), "transformer.blocks.*.attn",
        QKVLayout(H, D, q="Wqkv.weight", packing="fused")),
    "phi3": (
        lambda: tf.Phi3Config(vocab_size=64, hidden_size=E, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=H, num_key_value_heads=2, pad_token_id=0),
        lambda m: _fused_qkv(m.qkv_proj.weight, 2), "model.layers.*.self_attn",
        QKVLayout(H, D, q="qkv_proj.weight", packing="fused", n_kv_heads=2)),
    "gpt-bigcode-multi-query": (
        lambda: tf.GPTBigCodeConfig(vocab_size=64, n_embd=E, n_layer=2, n_head=H, multi_query=True),
        lambda m: _fused_qkv(m.c_attn.weight, 1), "transformer.h.*.attn",
        QKVLayout(H, D, q="c_attn.weight", packing="fused", n_kv_heads=1)),
    "gpt-bigcode-multi-head": (  # c_attn (3E, E) viewed as (H, 3D): interleaved per head
        lambda: tf.GPTBigCodeConfig(vocab_size=64, n_embd=E, n_layer=2, n_head=H, multi_query=False),
        lambda m: _per_head(m.c_attn.weight), "transformer.h.*.attn",
        QKVLayout(H, D, q="c_attn.weight", packing="fused_per_head")),
    "deberta-v2": (
        lambda: tf.DebertaV2Config(vocab_size=64, hidden_size=E, num_hidden_layers=2, num_attention_heads=H,
                                   intermediate_size=64),
        lambda m: (m.query_proj.weight.reshape(H, D, E), m.key_proj.weight.reshape(H, D, E)),
        "deberta.encoder.layer.*.attention.self",
        QKVLayout(H, D, q="query_proj.weight", k="key_proj.weight", v="value_proj.weight")),
}


# Falcon's new decoder architecture: [Q_1..Q_r | K | V] per key/value group
FAMILIES["falcon-grouped"] = (
    lambda: tf.FalconConfig(vocab_size=64, hidden_size=E, num_hidden_layers=2, num_attention_heads=H,
                            num_kv_heads=2, new_decoder_architecture=True),
    lambda m: _per_group(m.query_key_value.weight, 2), "transformer.h.*.self_attention",
    QKVLayout(H, D, q="query_key_value.weight", packing="fused_per_group", n_kv_heads=2))


def _per_group(w, g):
    per = w.reshape(g, H // g + 2, D, E)
    return per[:, : H // g].reshape(H, D, E), per[:, H // g]


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = FAMILIES[name][0]()
    cls = tf.DebertaV2ForMaskedLM if name == "deberta-v2" else tf.AutoModelForCausalLM
    return cls.from_config(cfg) if cls is tf.AutoModelForCausalLM else cls(cfg)


def _reference_spectra(model: torch.nn.Module, name: str) -> list[torch.Tensor]:
    """Per attention layer (H, D): singular values of Wq_h^T Wk_g, float64 full SVD, g = h // (H/G)."""
    _, slicer, pattern, _ = FAMILIES[name]
    import fnmatch

    out = []
    for mod_name, module in model.named_modules():
        if not fnmatch.fnmatchcase(mod_name, pattern):
            continue
        q, k = (t.detach().double() for t in slicer(module))
        pair = torch.arange(H) // (H // k.shape[0])
        out.append(torch.stack([torch.linalg.svdvals(q[h].T @ k[pair[h]])[:D] for h in range(H)]))
    assert len(out) == 2
    return out


def _live(model: torch.nn.Module, spec=None) -> dict[str, float]:
    mem = MemorySink()
    with Monitor(model, every=1, sinks=[mem], signals=("spectra",), spec=spec) as monitor:
        monitor.step(0)
    return {t: v for t, v in mem.records[0].scalars.items() if t.startswith(TAGS)}


def _offline(path, **kwargs):
    analysis = analyze_checkpoints([path], model_layout=ModelLayouts(), **kwargs)
    assert not analysis.failures, analysis.failures
    return analysis


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_folder_is_exact_with_no_options(name, tmp_path):
    model = _model(name)
    model.save_pretrained(tmp_path / name)
    analysis = _offline(tmp_path / name)
    assert analysis.heads.source == "model" and not analysis.heads.assumptions
    reference = _reference_spectra(model, name)
    assert [la.label for la in analysis.layers] == ["L00", "L01"]
    for la, ref in zip(analysis.layers, reference):
        got = torch.as_tensor(analysis.spectra[analysis.steps[0]][la.label]["qk_spectrum"], dtype=torch.float64)
        got = got.reshape(H, -1)[:, :D]
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)
    live = _live(model, {FAMILIES[name][2]: FAMILIES[name][3]})
    offline = {t: v for t, v in analysis.records[0].scalars.items() if t.startswith(TAGS)}
    assert sorted(live) == sorted(offline) and len(live) >= 4 * 2 * H
    for tag, value in live.items():
        assert offline[tag] == pytest.approx(value, rel=1e-6, abs=1e-12), tag


def test_bigcode_multi_head_is_not_read_as_all_q_all_k_all_v(tmp_path):
    """GPT-BigCode's c_attn has nanoGPT's name and shape but is interleaved per head."""
    model = _model("gpt-bigcode-multi-head")
    model.save_pretrained(tmp_path / "bc")
    layers = _offline(tmp_path / "bc").layers
    assert {la.layout.packing for la in layers} == {"fused_per_head"}
    naive = torch.linalg.svdvals(_fused_qkv(model.transformer.h[0].attn.c_attn.weight.double(), H)[0][0].T
                                 @ _fused_qkv(model.transformer.h[0].attn.c_attn.weight.double(), H)[1][0])
    right = _reference_spectra(model, "gpt-bigcode-multi-head")[0][0]
    assert not torch.allclose(naive[:D], right, rtol=1e-3)  # the two readings really differ


ZOO = ["gpt2", "llama", "bert", "roberta", "mistral", "qwen3", "gpt_neox", "t5", "bart", "gpt2_cross", "vit"]


@pytest.mark.parametrize("family", ZOO)
def test_zoo_folder_equals_the_live_monitor_with_no_options(family, tmp_path):
    case = getattr(zoo, family)()
    case.model.save_pretrained(tmp_path / family)
    analysis = _offline(tmp_path / family)
    live = _live(case.model)
    offline = {t: v for t, v in analysis.records[0].scalars.items() if t.startswith(TAGS)}
    assert sorted(live) == sorted(offline) and len(live) > 10
    for tag, value in live.items():
        assert offline[tag] == pytest.approx(value, rel=1e-6, abs=1e-12), tag
    if family == "qwen3":  # QK-norm: the probe forward cannot check, so the names' layout is stated as assumed
        assert any("by their names only" in a for a in analysis.heads.assumptions)
    else:
        assert not analysis.heads.assumptions


def test_config_that_contradicts_the_weights_is_refused(tmp_path, capsys):
    model = _model("bloom")
    model.save_pretrained(tmp_path / "bloom")
    config = json.loads((tmp_path / "bloom" / "config.json").read_text())
    config["hidden_size"] = config["n_embed"] = 64  # the weights are 32 wide
    (tmp_path / "bloom" / "config.json").write_text(json.dumps(config))
    code = main(["analyze", str(tmp_path / "bloom"), "--out", str(tmp_path / "out"), "--quiet", "--no-report"])
    err = capsys.readouterr().err
    assert code == 2 and "does not fit the checkpoint" in err and "query_key_value.weight" in err


def test_a_large_model_is_probed_on_a_small_twin_and_every_layer_gets_its_layout(tmp_path, monkeypatch):
    """Above MAX_TWIN_PARAMS the twin has 1 layer and a small vocabulary; the layouts reach all 4 layers."""
    import hooks.checkpoint.search as hf_layout

    monkeypatch.setattr(hf_layout, "MAX_TWIN_PARAMS", 1000)
    monkeypatch.setattr(hf_layout, "PROBE_VOCAB", 16)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.BloomConfig(vocab_size=64, hidden_size=E, n_layer=4, n_head=H))
    model.save_pretrained(tmp_path / "bloom")
    analysis = _offline(tmp_path / "bloom")
    assert [la.label for la in analysis.layers] == ["L00", "L01", "L02", "L03"]
    assert {la.layout.packing for la in analysis.layers} == {"fused_per_head"}
    for la, block in zip(analysis.layers, model.transformer.h):
        q, k = _per_head(block.self_attention.query_key_value.weight.detach().double())
        ref = torch.stack([torch.linalg.svdvals(q[h].T @ k[h])[:D] for h in range(H)])
        got = torch.as_tensor(analysis.spectra[analysis.steps[0]][la.label]["qk_spectrum"], dtype=torch.float64)
        torch.testing.assert_close(got.reshape(H, -1)[:, :D], ref, rtol=1e-6, atol=1e-9)


def test_the_command_line_reads_a_bigcode_folder_exactly_with_no_options(tmp_path, capsys):
    """GPT-BigCode end to end: its interleaved c_attn is never read as [all Q | all K | all V]."""
    model = _model("gpt-bigcode-multi-head")
    model.save_pretrained(tmp_path / "bigcode")
    code = main(["analyze", str(tmp_path / "bigcode"), "--json", "--out", str(tmp_path / "out"), "--no-report"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["heads"]["source"] == "model"
    (positional,) = summary["assumptions"]  # no layout assumption; the folder's step is its position, stated
    assert "position in the series" in positional and summary["checkpoints"][0]["step_from"] == "position"
    assert [la["packing"] for la in summary["layers"]] == ["fused_per_head"] * 2
    reference = _reference_spectra(model, "gpt-bigcode-multi-head")
    for la, ref in zip(summary["layers"], reference):
        sigma1 = summary["metrics"]["0"][la["label"]]["qk_sigma1"]
        assert sigma1 == pytest.approx(ref[:, 0].tolist(), rel=1e-6)


def test_a_codegen_folder_is_read_as_groups_of_query_value_key(tmp_path):
    """CodeGen's qkv_proj: 4 groups of [Q | V | K]. The probe forward finds QKVLayout(groups=4, order='qvk')
    among the fused candidates (its logits, computed in float32 inside a float64 twin, are held to float32's
    precision, not float64's), and the spectra are the full SVD of Wq_h^T Wk_h sliced
    by hand as transformers' CodeGenAttention splits its rows."""
    nh, d = 8, 4
    torch.manual_seed(0)
    model = tf.CodeGenForCausalLM(tf.CodeGenConfig(vocab_size=64, n_embd=nh * d, n_head=nh, n_layer=2,
                                                   n_positions=64, rotary_dim=2))
    model.save_pretrained(tmp_path / "codegen")
    analysis = _offline(tmp_path / "codegen")
    assert [(la.layout.packing, la.layout.groups, la.layout.order) for la in analysis.layers] == [
        ("fused_per_group", 4, "qvk")] * 2
    local = nh * d // 4
    for la, block in zip(analysis.layers, model.transformer.h):
        w = block.attn.qkv_proj.weight.detach().double().reshape(4, 3 * local, nh * d)  # per group q, v, k
        q, k = w[:, :local].reshape(nh, d, -1), w[:, 2 * local:].reshape(nh, d, -1)
        ref = torch.stack([torch.linalg.svdvals(q[h].T @ k[h])[:d] for h in range(nh)])
        got = torch.as_tensor(analysis.spectra[analysis.steps[0]][la.label]["qk_spectrum"], dtype=torch.float64)
        torch.testing.assert_close(got.reshape(nh, -1)[:, :d], ref, rtol=1e-6, atol=1e-9)


class _Fused(torch.nn.Module):
    """A toy attention whose one weight is packed as ``layout`` says (any groups and order)."""

    def __init__(self, layout: QKVLayout, e: int) -> None:
        super().__init__()
        self.layout = layout
        self.qkv = torch.nn.Linear(e, (layout.n_heads + 2 * layout.kv_heads) * layout.head_dim, bias=False).double()
        self.out = torch.nn.Linear(layout.n_heads * layout.head_dim, e).double()

    def forward(self, x):
        lay = self.layout
        q, k, v = (torch.einsum("bte,hde->bhtd", x, w) for w in split_qkv({"qkv.weight": self.qkv.weight}, lay))
        r = lay.n_heads // lay.kv_heads
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        a = torch.softmax(q @ k.transpose(-1, -2) / lay.head_dim ** 0.5, -1)
        return self.out((a @ v).transpose(1, 2).flatten(2))


@pytest.mark.parametrize("h, g", [(4, 4), (4, 2)])
def test_the_probe_finds_every_grouping_and_order_q_before_k(h, g):
    """The probe forward over fused_layouts(q_first=True) finds each true (groups, order) exactly, except that
    it cannot tell a query block from a key block of the same size (scaling one by c and the other by 1/c is
    symmetric): with g == h a weight storing K before Q is read with the two swapped, Q first, the convention
    the docs state (sigma_1 of Wq^T Wk is the same; the q and k gradient norms trade places)."""
    d, e = 2, 8
    ids = torch.arange((h + 2 * g) * d).reshape(-1, 1)
    for groups in (n for n in range(1, g + 1) if g % n == 0):
        for order in map("".join, itertools.permutations("qkv")):
            true = QKVLayout(h, d, "qkv.weight", packing="fused_per_group", n_kv_heads=g, groups=groups, order=order)
            torch.manual_seed(0)
            model = torch.nn.Sequential(_Fused(true, e))
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, p.shape[-1] ** -0.5)
            found, _ = verdicts(model, {"input": torch.randn(2, 6, e, dtype=torch.float64)},
                                {"0": fused_layouts(h, d, "qkv.weight", g, q_first=True)})
            got = [t.flatten().tolist() for t in split_qkv({"qkv.weight": ids}, found["0"])]
            want = [t.flatten().tolist() for t in split_qkv({"qkv.weight": ids}, true)]
            if g == h and order.index("k") < order.index("q"):
                want = [want[1], want[0], want[2]]  # read Q first: the blocks of Q and K swapped
            assert got == want, (groups, order, found["0"].describe())
