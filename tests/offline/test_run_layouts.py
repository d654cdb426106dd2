"""The layout travels with the run: a monitored run's checkpoints are analysed exactly with no options.

A model the name discovery cannot read (fused qkv interleaved per head, head count in ``heads``) is
watched with an explicit spec; its checkpoints from a plain loop (.pt, .safetensors), the HF Trainer
(checkpoint-N) and Lightning (.ckpt) are analysed with no options and compared with a float64 full SVD
of the hand-sliced weights and with the live Monitor. Also: ``--layout FILE`` for bare state dicts
(per-stage head counts), and the negative cases: refusals and printed assumptions.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from diag.cli.main import main
from diag.errors import ConfigError
from diag.layouts.vocab import QKVLayout
from diag.offline.layoutfile import FILE_NAME, LayoutEntry, read_layout_file, write_layout_file
from diag.offline.series import analyze_checkpoints
from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor
from tests.support import zoo

E, H, VOCAB, T = 32, 4, 50, 8
TAGS = ("qk_sigma1", "qk_sec", "qk_erank", "qk_stable_rank")


class PerHead(nn.Module):
    """qkv rows per head [Q_h | K_h | V_h] (as GPT-NeoX), head count in an attribute ``heads``."""

    def __init__(self, e: int, heads: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(e, 3 * e), nn.Linear(e, e), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, self.heads, 3, e // self.heads).permute(3, 0, 2, 1, 4)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, e))


class Net(nn.Module):
    """Two stages with different head counts: blocks.0 has ``heads[0]``, blocks.1 ``heads[1]``."""

    def __init__(self, heads=(H, H)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, E)
        self.blocks = nn.ModuleList(PerHead(E, h) for h in heads)
        self.head = nn.Linear(E, VOCAB)
        with torch.no_grad():
            for block in self.blocks:
                block.qkv.weight.normal_(0, 0.5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.emb(input_ids)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def spec(heads=(H, H)) -> dict[str, QKVLayout]:
    return {f"blocks.{i}": QKVLayout(h, E // h, q="qkv.weight", packing="fused_per_head", o="proj.weight")
            for i, h in enumerate(heads)}


def reference(state: dict[str, torch.Tensor], heads=(H, H), prefix: str = "") -> list[torch.Tensor]:
    """Per block (h, D): singular values of Wq_h^T Wk_h, sliced as PerHead.forward does, float64 full SVD."""
    out = []
    for i, h in enumerate(heads):
        d = E // h
        w = state[f"{prefix}blocks.{i}.qkv.weight"].double().view(h, 3, d, E)
        out.append(torch.stack([torch.linalg.svdvals(w[j, 0].T @ w[j, 1])[:d] for j in range(h)]))
    return out


def live(model: nn.Module, heads=(H, H)) -> dict[str, float]:
    mem = MemorySink()
    with Monitor(model, every=1, sinks=[mem], signals=("spectra",), spec=spec(heads)) as monitor:
        monitor.step(0)
    return {t: v for t, v in mem.records[0].scalars.items() if t.startswith(TAGS)}


def check(analysis, state, heads=(H, H), prefix: str = "", model: nn.Module | None = None) -> None:
    assert not analysis.failures, analysis.failures
    step = analysis.steps[-1]
    for la, ref in zip(analysis.layers, reference(state, heads, prefix), strict=True):
        got = torch.as_tensor(analysis.spectra[step][la.label]["qk_spectrum"], dtype=torch.float64)
        torch.testing.assert_close(got.reshape(ref.shape[0], -1)[:, : ref.shape[1]], ref, rtol=1e-6, atol=1e-9)
    if model is not None:
        offline = {t: v for t, v in analysis.records[-1].scalars.items() if t.startswith(TAGS)}
        want = live(model, heads)
        assert sorted(offline) == sorted(want)
        for tag, value in want.items():
            assert offline[tag] == pytest.approx(value, rel=1e-6, abs=1e-12), tag


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


# --------------------------------------------------------------- plain loop


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "container"])
def test_plain_loop_checkpoints_need_no_options(fmt, tmp_path):
    model = Net()
    with Monitor(model, logdir=tmp_path / "run", every=1, spec=spec()):
        pass
    assert (tmp_path / "run" / FILE_NAME).is_file()
    state = plain_state(model)
    (tmp_path / "run" / "ckpt").mkdir()
    path = tmp_path / "run" / "ckpt" / f"step_7.{fmt if fmt != 'container' else 'pth'}"
    if fmt == "safetensors":
        save_file(state, str(path))
    elif fmt == "pt":
        torch.save(state, path)
    else:  # a container, the model under a wrapper's prefix (DDP and a LightningModule-like "net.")
        torch.save({"model": {f"module.net.{k}": v for k, v in state.items()}, "step": 7}, path)
    analysis = analyze_checkpoints([path])
    assert analysis.heads.source == "run" and not analysis.heads.assumptions
    assert [la.layout.packing for la in analysis.layers] == ["fused_per_head"] * 2
    check(analysis, state, model=model)


def test_without_the_runs_layout_the_assumption_is_printed_and_the_layout_file_fixes_it(tmp_path, capsys):
    model = Net()
    state = plain_state(model)
    torch.save(state, tmp_path / "bare.pt")
    code = main(["analyze", str(tmp_path / "bare.pt"), "--heads", "4", "--out", str(tmp_path / "o1"), "--json",
                 "--no-report"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["heads"]["source"] == "--heads"
    assert any("[all Q | all K | all V]" in a and "packing='fused_per_head'" in a for a in summary["assumptions"])
    code = main(["analyze", str(tmp_path / "bare.pt"), "--heads", "4", "--out", str(tmp_path / "o2"), "--no-report"])
    assert code == 0 and "assumed: the fused weight's rows" in capsys.readouterr().out
    write_layout_file(tmp_path / "layout.json", [LayoutEntry("blocks.*", spec()["blocks.0"])])
    analysis = analyze_checkpoints([tmp_path / "bare.pt"], layout=tmp_path / "layout.json")
    assert analysis.heads.source == "--layout" and not analysis.heads.assumptions
    check(analysis, state, model=model)


def test_layout_file_gives_per_stage_head_counts(tmp_path):
    heads = (2, 8)
    model = Net(heads)
    state = plain_state(model)
    torch.save(state, tmp_path / "stages.pt")
    write_layout_file(tmp_path / "layout.json", [LayoutEntry(k, v) for k, v in spec(heads).items()])
    check(analyze_checkpoints([tmp_path / "stages.pt"], layout=tmp_path / "layout.json"), state, heads, model=model)
    check(analyze_checkpoints([tmp_path / "stages.pt"], layout=spec(heads)), state, heads, model=model)  # API
    assert read_layout_file(tmp_path / "layout.json").entries[1].layout.n_heads == 8


def test_zoo_runs_round_trip_through_their_saved_layout(tmp_path):
    for name in ("nanogpt", "llama", "torch_encoder", "bart"):
        case = getattr(zoo, name)()
        run = tmp_path / name
        mem = MemorySink()
        with Monitor(case.model, logdir=run, every=1, sinks=[mem], signals=("spectra",)) as monitor:
            monitor.step(0)
        want = {t: v for t, v in mem.records[0].scalars.items() if t.startswith(TAGS)}
        save_file(plain_state(case.model), str(run / "model_step0.safetensors"))
        analysis = analyze_checkpoints([run / "model_step0.safetensors"])
        assert not analysis.failures and analysis.heads.source == "run", (name, analysis.failures)
        got = {t: v for t, v in analysis.records[0].scalars.items() if t.startswith(TAGS)}
        assert sorted(got) == sorted(want), name
        for tag, value in want.items():
            assert got[tag] == pytest.approx(value, rel=1e-6, abs=1e-12), (name, tag)


# --------------------------------------------------------------- trainers


def test_hf_trainer_checkpoints_carry_the_layout(tmp_path):
    from transformers import Trainer, TrainingArguments

    from hooks.integrations.hf import LAYOUT_FILE, MonitorCallback

    model = Net()
    ids = torch.randint(0, VOCAB, (8, T), generator=torch.Generator().manual_seed(5))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, save_steps=2,
                             save_strategy="steps", report_to="none", use_cpu=True, disable_tqdm=True,
                             learning_rate=1e-2, dataloader_pin_memory=False, )
    callback = MonitorCallback(logdir=tmp_path / "tb", every=1, spec=spec(), sinks=[MemorySink()])
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    folder = tmp_path / "checkpoint-2"
    assert (folder / LAYOUT_FILE).is_file()
    weights = folder / "model.safetensors"
    analysis = analyze_checkpoints([weights])
    assert analysis.heads.source == "run" and analysis.steps == [2]
    from safetensors.torch import load_file

    check(analysis, load_file(str(weights)), model=model)


def test_lightning_checkpoints_carry_the_layout_inside(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hooks.integrations.lightning import MonitorCallback

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.net(ids, ids)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    ids = torch.randint(0, VOCAB, (8, T), generator=torch.Generator().manual_seed(5))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    callback = MonitorCallback(logdir=tmp_path / "tb", every=1, sinks=[MemorySink()],
                               spec={f"net.{k}": v for k, v in spec().items()})
    lit = Lit()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, callbacks=[callback, saver], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(lit, loader)
    (path,) = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    (tmp_path / "tb" / FILE_NAME).unlink()  # only the copy inside the checkpoint is left
    analysis = analyze_checkpoints([path])
    assert analysis.heads.source == "run" and "attnscope_layout" in analysis.heads.note
    state = torch.load(path, weights_only=True)["state_dict"]
    check(analysis, state, prefix="net.", model=lit.net)


# --------------------------------------------------------------- refusals and messages


def test_layout_and_heads_together_are_refused(tmp_path, capsys):
    torch.save(plain_state(Net()), tmp_path / "a.pt")
    write_layout_file(tmp_path / "layout.json", [LayoutEntry("blocks.*", spec()["blocks.0"])])
    with pytest.raises(ConfigError, match="either layout="):
        analyze_checkpoints([tmp_path / "a.pt"], layout=tmp_path / "layout.json", heads=4)
    code = main(["analyze", str(tmp_path / "a.pt"), "--layout", str(tmp_path / "layout.json"), "--heads", "4",
                 "--out", str(tmp_path / "o"), "--quiet"])
    assert code == 2 and "not both" in capsys.readouterr().err


def test_a_layout_of_another_model_is_refused_naming_both(tmp_path, capsys):
    torch.save(plain_state(zoo.nanogpt().model), tmp_path / "gpt.pt")
    write_layout_file(tmp_path / "layout.json", [LayoutEntry("blocks.*", spec()["blocks.0"])])
    code = main(["analyze", str(tmp_path / "gpt.pt"), "--layout", str(tmp_path / "layout.json"),
                 "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "blocks.*" in err and "h.0.attn" in err and "--layout FILE" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": [{"module": "h.*.attn", "layout": {"n_heads": 4, "head_dim": 8,
                                                                             "q": "c_attn.weight", "pkg": 1}}]}))
    code = main(["analyze", str(tmp_path / "gpt.pt"), "--layout", str(bad), "--out", str(tmp_path / "o2"),
                 "--quiet"])
    assert code == 2 and "pkg" in capsys.readouterr().err


def test_shapes_that_do_not_fit_the_layout_file_are_refused(tmp_path, capsys):
    torch.save(plain_state(zoo.nanogpt().model), tmp_path / "gpt.pt")
    wrong = QKVLayout(3, 8, q="c_attn.weight", packing="fused")  # 3 heads of 8: 72 rows, the weight has 96
    write_layout_file(tmp_path / "layout.json", [LayoutEntry("h.*.attn", wrong)])
    code = main(["analyze", str(tmp_path / "gpt.pt"), "--layout", str(tmp_path / "layout.json"),
                 "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "(96, 32)" in err and "needs 72" in err


def test_refusal_reads_n_heads_from_the_config_and_lists_only_qkv_tensors(tmp_path, capsys):
    state = plain_state(Net())
    torch.save(state, tmp_path / "m.pt")
    (tmp_path / "config.json").write_text(json.dumps({"n_heads": 3}))  # 96 rows do not split into 3 heads
    code = main(["analyze", str(tmp_path / "m.pt"), "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "n_heads=3 (config.json)" in err and "None head" not in err
    assert "blocks.0.qkv.weight (96, 32)" in err and "proj.weight" not in err and "emb.weight" not in err
    code = main(["analyze", str(tmp_path / "m.pt"), "--heads", "5", "--out", str(tmp_path / "o2"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "pass --heads" not in err and "check --heads/--kv-heads" in err


def test_grouped_query_pairing_assumed_by_kv_heads_is_stated(tmp_path, capsys):
    case = zoo.llama()
    torch.save(plain_state(case.model), tmp_path / "llama.pt")
    code = main(["analyze", str(tmp_path / "llama.pt"), "--heads", "4", "--kv-heads", "2", "--json",
                 "--out", str(tmp_path / "o"), "--no-report"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and "2 key/value heads (--kv-heads)" in summary["heads"]["note"]
    assert summary["layers"][0]["kv_map"] == [0, 0, 1, 1] and summary["layers"][0]["packing"] == "separate"
    every, pairing, position = summary["assumptions"]
    assert "every attention layer has 4 heads" in every and "one entry per stage" in every
    assert "h // 2" in pairing and "weights cannot tell" in pairing and "--kv-map tiled" in pairing
    assert "attnscope_layout.json" in pairing and "--model module:callable" in pairing
    assert "position in the series" in position


class TiledGQA(nn.Module):
    """Grouped-query attention that tiles its key heads: query head h reads key head h % G (not h // (H/G))."""

    def __init__(self, heads: int = H, kv: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        d = E // heads
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, kv * d), nn.Linear(E, kv * d)
        self.heads, self.kv = heads, kv
        for lin in (self.q, self.k):
            nn.init.normal_(lin.weight, 0, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(b, t, self.kv, -1).transpose(1, 2).repeat(1, self.heads // self.kv, 1, 1)
        v = self.v(x).view(b, t, self.kv, -1).transpose(1, 2).repeat(1, self.heads // self.kv, 1, 1)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, E)


def test_a_layout_file_with_kv_map_gives_the_tiled_pairing(tmp_path):
    model = nn.ModuleDict({"attn": TiledGQA()})
    state = plain_state(model)
    torch.save(state, tmp_path / "gqa.pt")
    layout = QKVLayout(H, E // H, q="q.weight", k="k.weight", v="v.weight", n_kv_heads=2,
                       kv_map=tuple(h % 2 for h in range(H)))
    write_layout_file(tmp_path / "layout.json", [LayoutEntry("attn", layout)])
    analysis = analyze_checkpoints([tmp_path / "gqa.pt"], layout=tmp_path / "layout.json")
    assert not analysis.failures and not analysis.heads.assumptions
    wq = state["attn.q.weight"].double().view(H, E // H, E)
    wk = state["attn.k.weight"].double().view(2, E // H, E)
    ref = torch.stack([torch.linalg.svdvals(wq[h].T @ wk[h % 2])[: E // H] for h in range(H)])
    got = torch.as_tensor(analysis.spectra[analysis.steps[0]]["L00"]["qk_spectrum"], dtype=torch.float64)
    torch.testing.assert_close(got.reshape(H, -1)[:, : E // H], ref, rtol=1e-6, atol=1e-9)
    wrong = torch.stack([torch.linalg.svdvals(wq[h].T @ wk[h // 2])[: E // H] for h in range(H)])
    assert not torch.allclose(ref, wrong, rtol=1e-3)  # the two pairings really differ on this model


BARE = ["nanogpt", "gpt2", "llama", "bert", "mistral", "gpt_neox", "t5", "bart", "torch_encoder", "torch_seq2seq"]


@pytest.mark.parametrize("family", BARE)
def test_bare_state_dicts_are_exact_refused_or_explicit(family, tmp_path):
    """No run layout, no config: whatever the analysis does with no options, it is never silently wrong."""
    case = getattr(zoo, family)()
    save_file(plain_state(case.model), str(tmp_path / "model.safetensors"))
    analysis = analyze_checkpoints([tmp_path / "model.safetensors"])
    if analysis.failures:
        (_, message), = analysis.failures
        assert "--layout FILE" in message, message
        return
    want = {t: v for t, v in live_scalars(case.model).items()}
    got = {t: v for t, v in analysis.records[0].scalars.items() if t.startswith(TAGS)}
    exact = sorted(got) == sorted(want) and all(got[t] == pytest.approx(v, rel=1e-6, abs=1e-12)
                                                for t, v in want.items())
    stated = analysis.heads.source == "assumed" or bool(analysis.heads.assumptions)
    assert exact or stated, (family, analysis.heads)
    if analysis.heads.source == "assumed":
        assert "one head" in analysis.heads.note and "--layout FILE" in analysis.heads.note


def live_scalars(model: nn.Module) -> dict[str, float]:
    mem = MemorySink()
    with Monitor(model, every=1, sinks=[mem], signals=("spectra",)) as monitor:
        monitor.step(0)
    return {t: v for t, v in mem.records[0].scalars.items() if t.startswith(TAGS)}


def test_a_layout_file_above_that_belongs_to_another_model_is_ignored_out_loud(tmp_path):
    with Monitor(Net(), logdir=tmp_path / "run", every=1, spec=spec()):
        pass
    (tmp_path / "run" / "other").mkdir()
    torch.save(plain_state(zoo.nanogpt().model), tmp_path / "run" / "other" / "gpt.pt")
    analysis = analyze_checkpoints([tmp_path / "run" / "other" / "gpt.pt"], heads=4)
    assert not analysis.failures and analysis.heads.source == "--heads"  # explicit options win over the file
    analysis = analyze_checkpoints([tmp_path / "run" / "other" / "gpt.pt"])
    assert not analysis.failures and analysis.heads.source == "assumed"
    assert any(a.startswith("ignored the run's layout file") and "blocks.0" in a for a in analysis.heads.assumptions)


def test_grouped_query_refusal_gives_the_kv_heads_that_fit(tmp_path, capsys):
    torch.save(plain_state(zoo.llama().model), tmp_path / "llama.pt")
    code = main(["analyze", str(tmp_path / "llama.pt"), "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "q_proj.weight has 32 rows and its k_proj 16" in err and "--kv-heads N/2" in err
    code = main(["analyze", str(tmp_path / "llama.pt"), "--heads", "4", "--kv-heads", "2", "--out",
                 str(tmp_path / "o2"), "--quiet", "--no-report"])
    assert code == 0  # the option the message gave works
