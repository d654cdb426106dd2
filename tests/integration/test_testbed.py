"""The test bed closer to users' runs (evaluation/testbed.py): models that start with attention sinks
(evaluation/sinks.py), their fine-tunes, the larger healthy families and the LLaMA collapse sweep's QK-norm twin,
and the sets that hold them (evaluation/seeds.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from evaluation import sinks
from evaluation.lm import corpus
from evaluation.seeds import SETS
from evaluation.spec import RunSpec

FIXTURE = "built-sinks-gpt2-2x4x64.safetensors"


def _pydoc(context: int, batch: int, seed: int = 1) -> torch.Tensor:
    data = torch.frombuffer(bytearray(corpus("pydoc").encode()), dtype=torch.uint8).long()
    return sinks.bos_batches(data, context, batch, torch.Generator().manual_seed(seed))()["input_ids"]


@pytest.mark.parametrize(("family", "context"), [("gpt2", 512), ("llama", 1024)])
def test_built_in_sinks_hold_most_of_their_heads_attention_over_the_whole_context(family, context):
    """The implant alone (no pre-train): every sink head puts most of its attention on BOS at every distance (the
    LLaMA's sink lies in its lowest rotary frequency, which turns 0.32 radians over 1,024 positions), every
    other head about what uniform causal attention gives position 0 (the mean of 1 / (i + 1): 0.7% at 1,024)."""
    torch.manual_seed(0)
    model = sinks.build(family, layers=2, heads=8, width=128, context=context)
    heads = sinks.sink_heads(2, 8)
    sinks.implant(model, heads, seed=0)
    mass = sinks.mass_on_first(model, _pydoc(context, 2))  # (layers, heads)
    for layer, chosen in heads.items():
        for h in range(8):
            assert (mass[layer, h] > 0.5) if h in chosen else (mass[layer, h] < 0.05), (layer, h, mass.tolist())


def test_the_fixture_model_starts_with_sinks():
    """The stored model (tests/fixtures) loads at single precision and starts with sinks: several heads give
    position 0 at least half of their attention, measured from its own attention weights."""
    model = sinks.load(sinks.FIXTURES / FIXTURE)
    context = model.config.max_position_embeddings
    mass = sinks.mass_on_first(model, _pydoc(context, 2))
    assert next(model.parameters()).dtype == torch.float32
    assert int((mass >= 0.5).sum()) >= 4, mass.tolist()


def test_a_sink_fine_tune_records_its_observations_and_its_sinks(tmp_path, monkeypatch):
    """RunSpec(task="finetune"): a built-in-sink LLaMA (a pre-train of 5 steps here, the implant) fine-tuned with
    the Monitor at its default cadence; run.json holds each head's share on position 0 before and after."""
    from evaluation.runs import record
    from evaluation.truth import load_run

    monkeypatch.setitem(sinks.PRETRAIN, "steps", 5)
    spec = RunSpec("finetune", 0, 3e-4, 6, warmup=2, schedule="cosine", model="llama", sinks="built", layers=2,
                   heads=4, width=64, context=128, batch=2, corpus="pydoc", every=0)
    run = load_run(record(spec, tmp_path))
    assert run.name == "ft-llama-built-lr0.0003-w2-cosine-2x4x64-pydoc-ctx128-b2-s0"
    assert run.spec.purpose == "sinks" and len(run.losses) == 6 and all(map(math.isfinite, run.losses))
    start = torch.tensor(run.info["sink_mass"]["start"])
    chosen = sinks.sink_heads(2, 4)  # 2 heads of the first layer, 3 of the second
    assert start.shape == (2, 4) and all((start[i, h] > 0.5) == (h in chosen[i]) for i in range(2) for h in range(4))
    assert any("attn_entropy" in m for o in run.obs for m in o.layers.values())


def test_the_llama_qknorm_twin_is_qwen3_from_the_same_weights():
    """The LLaMA sweep's twin: HF Qwen3 (RMSNorm on q and k per head), at one seed the plain model's weights plus
    the norms."""
    from evaluation.healthy import build

    torch.manual_seed(3)
    plain = build("llama", 2, 8, 64, 128).state_dict()
    torch.manual_seed(3)
    twin = build("llama", 2, 8, 64, 128, twin="qknorm")
    assert type(twin).__name__ == "Qwen3ForCausalLM"
    extra = [k for k in twin.state_dict() if k not in plain]
    assert extra and all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in extra)
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in plain.items())


def test_a_spec_says_what_its_run_is_for():
    """The purpose: the task's unless named (a healthy nanoGPT, a LLaMA that may collapse); a fine-tune names
    its sinks, and only a fine-tune."""
    assert RunSpec("lm", 0, 5e-3, 300).purpose == "collapse"
    assert RunSpec("vit", 0, 1e-3, 2000).purpose == "eureka"
    assert RunSpec("hf", 0, 1e-3, 500, model="gpt2").purpose == "healthy"
    assert RunSpec("lm", 0, 1e-3, 500, context=512, purpose="healthy").purpose == "healthy"
    assert RunSpec("finetune", 0, 3e-4, 300, model="gpt2", sinks="built").purpose == "sinks"
    assert RunSpec("hf", 0, 1e-3, 500, model="gpt2", purpose="") == RunSpec("hf", 0, 1e-3, 500, model="gpt2")
    with pytest.raises(ValueError, match="names the sinks"):
        RunSpec("finetune", 0, 3e-4, 300, model="gpt2")
    with pytest.raises(ValueError, match="names the sinks"):
        RunSpec("hf", 0, 1e-3, 300, model="gpt2", sinks="built")


def test_the_users_set_holds_what_the_test_bed_promises():
    """Frozen before recording: 6 sink fine-tunes of 2 families at context 512 or more, at the default cadence; 16
    healthy runs (4 families x 2 schedules x 2 seeds, context 512 or more, 8 heads, one family in bf16 autocast);
    both collapse sweeps with a QK-norm twin for every run, part of them at context 512; the Eureka task on both
    implementations, each with a NormSoftmax twin; seeds no other set uses."""
    users = SETS["users"]
    fine = [s for s in users if s.purpose == "sinks"]
    assert len(fine) == 6 and {s.model for s in fine} == {"gpt2", "llama"} and all(s.context >= 512 for s in fine)
    assert all(s.every == 0 for s in fine)
    healthy = [s for s in users if s.purpose == "healthy"]
    families = {(s.task, s.model) for s in healthy}
    assert len(healthy) == 16 and len(families) == 4 and {s.schedule for s in healthy} == {"constant", "cosine"}
    assert all(s.context >= 512 and s.heads == 8 and s.every == 0 for s in healthy)
    assert any(s.autocast == "bf16" for s in healthy)
    collapse = [s for s in users if s.purpose == "collapse"]
    assert all(replace(s, twin="qknorm") in collapse and s.every == 1 for s in collapse)
    assert any(s.context >= 512 for s in collapse) and any(s.context == 0 for s in collapse)
    eureka = [s for s in users if s.purpose == "eureka"]
    assert {s.model for s in eureka} == {"", "hfvit"}
    assert {s.model for s in eureka if s.twin == "normsoftmax"} == {"", "hfvit"}
    seeds = {s.seed for s in users}
    others = {s.seed for name, specs in SETS.items() if name != "users" for s in specs}
    assert not seeds & others
    assert len({s.name for s in users}) == len(users)


def test_the_second_eureka_implementation_records_its_attention_and_its_normsoftmax_twin_computes_normsoftmax(
        tmp_path):
    """The Eureka task on Hugging Face's ViT (two candidate cells): a short run records losses, held-out
    evaluations and the attention the Monitor read; its NormSoftmax twin starts from the same weights and its
    attention is softmax(s / (T std(s))) over the keys, checked against that formula computed by hand."""
    from evaluation import eureka_hf
    from evaluation.eureka import DigitGrid, EurekaConfig
    from evaluation.runs import record
    from evaluation.truth import load_run

    run = load_run(record(RunSpec("vit", 0, 1.2e-3, 6, model="hfvit", every=2), tmp_path))
    assert run.name == "vit-hfvit-lr0.0012-s0" and len(run.losses) == 6 and all(map(math.isfinite, run.losses))
    assert any("attn_entropy" in m and "grad_ratio_qk_v" in m for o in run.obs for m in o.layers.values())
    assert DigitGrid(candidates=2).candidates == 2 and 0.4 < run.info["blind"] < 0.75

    shape = eureka_hf.SHAPE
    torch.manual_seed(0)
    soft = eureka_hf.GridViT(shape["n_layer"], shape["n_head"], shape["n_embd"], shape["patch"], "softmax")
    torch.manual_seed(0)
    twin = eureka_hf.GridViT(shape["n_layer"], shape["n_head"], shape["n_embd"], shape["patch"], "normsoftmax")
    assert all(torch.equal(a, b) for a, b in zip(soft.state_dict().values(), twin.state_dict().values()))
    layer = twin.vit.vit.layers[0].attention
    x = torch.randn(3, 17, shape["n_embd"], dtype=torch.float64)
    layer.double()
    got = layer(x)[0]
    heads, d = layer.num_attention_heads, layer.head_dim
    q, k, v = (p(x).view(3, 17, heads, d).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    p = torch.softmax(s / (EurekaConfig.temperature * s.std(dim=-1, keepdim=True) + 1e-6), dim=-1)
    want = layer.o_proj((p @ v).transpose(1, 2).reshape(3, 17, -1))
    assert torch.allclose(got, want, atol=1e-10)
