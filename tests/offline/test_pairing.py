"""Grouped-query pairing offline: never silent. The weights cannot tell which key/value head a query head
reads; ``--heads/--kv-heads`` state the pairing they assume (text and JSON), ``--kv-map`` sets it, and a
``--kv-map`` that contradicts a pairing read from the model is refused."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diag.cli.main import main
from diag.layouts.vocab import QKVLayout
from diag.offline.layers import FIX_PAIRING
from diag.offline.series import analyze_checkpoints
from tests.offline.reference import assert_layer, head_spectra
from tests.support import zoo

E, H = 32, 4
D = E // H


class GQA(nn.Module):
    """Grouped-query attention over separate q/k/v; ``tiled``: query head h reads key head h % G (Tensor.repeat),
    else h // (H/G) (repeat_interleave, as Hugging Face's repeat_kv)."""

    def __init__(self, kv: int, tiled: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, kv * D), nn.Linear(E, kv * D)
        self.kv, self.tiled = kv, tiled
        for lin in (self.q, self.k):
            nn.init.normal_(lin.weight, 0, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, D).transpose(1, 2)  # (B, nh, T, hs)
        k, v = (p(x).view(b, t, self.kv, D).transpose(1, 2) for p in (self.k, self.v))
        k, v = ((z.repeat(1, H // self.kv, 1, 1) if self.tiled else z.repeat_interleave(H // self.kv, 1))
                for z in (k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, E)


def _pairing(kv: int, tiled: bool) -> list[int]:
    return [h % kv if tiled else h // (H // kv) for h in range(H)]


def _save(path, kv: int = 2, tiled: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in nn.ModuleDict({"attn": GQA(kv, tiled)}).state_dict().items()}
    torch.save(state, path)
    return state


def _reference(state, kv: int, tiled: bool) -> torch.Tensor:
    return head_spectra(state["attn.q.weight"], state["attn.k.weight"], H, _pairing(kv, tiled))


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["analyze", *map(str, args), "--no-report"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_kv_map_tiled_reads_a_tiled_model_exactly(tmp_path, capsys):
    state = _save(tmp_path / "step_1.pt")
    code, out, _ = _cli(capsys, tmp_path / "step_1.pt", "--heads", H, "--kv-heads", 2, "--kv-map", "tiled", "--json",
                        "--out", tmp_path / "o")
    summary = json.loads(out)
    assert code == 0 and summary["layers"][0]["kv_map"] == [0, 1, 0, 1]
    assert "query head h pairs with key/value head h % G (--kv-map tiled)" in summary["heads"]["note"]
    assert not any(FIX_PAIRING in a for a in summary["assumptions"])  # set, not assumed
    analysis = analyze_checkpoints([tmp_path / "step_1.pt"], heads=H, kv_heads=2, kv_map="tiled")
    assert_layer(analysis.spectra[1]["L00"], _reference(state, 2, tiled=True))
    listed = analyze_checkpoints([tmp_path / "step_1.pt"], heads=H, kv_heads=2, kv_map="0,1,0,1")
    assert listed.records[0].scalars == analysis.records[0].scalars


def test_without_kv_map_the_assumed_pairing_is_stated_in_the_text_and_the_json(tmp_path, capsys):
    _save(tmp_path / "step_1.pt")
    code, out, _ = _cli(capsys, tmp_path / "step_1.pt", "--heads", H, "--kv-heads", 2, "--out", tmp_path / "o")
    assert code == 0 and "query head h pairs with key/value head h // 2" in out and "weights cannot tell" in out
    assert "--kv-map tiled" in out
    code, _, err = _cli(capsys, tmp_path / "step_1.pt", "--heads", H, "--kv-heads", 2, "--quiet", "--out",
                        tmp_path / "o2")
    assert code == 0 and "note: assumed: query head h pairs with key/value head h // 2" in err
    code, out, _ = _cli(capsys, tmp_path / "step_1.pt", "--heads", H, "--kv-heads", 2, "--json", "--out",
                        tmp_path / "o3")
    summary = json.loads(out)
    assert summary["layers"][0]["kv_map"] == [0, 0, 1, 1]
    assert [a for a in summary["assumptions"] if FIX_PAIRING in a and "h // 2" in a]


def test_a_kv_map_that_contradicts_the_models_own_pairing_is_refused(tmp_path, capsys):
    zoo.llama().model.save_pretrained(tmp_path / "checkpoint-5")  # the probe forward reads repeat_kv's pairing
    code, _, err = _cli(capsys, tmp_path / "checkpoint-5", "--kv-map", "tiled", "--quiet", "--out", tmp_path / "o")
    assert code == 2 and "contradicts the pairing" in err and "drop --kv-map" in err
    code, _, _ = _cli(capsys, tmp_path / "checkpoint-5", "--kv-map", "grouped", "--quiet", "--out", tmp_path / "o2")
    assert code == 0


@pytest.mark.parametrize("options, says", [
    (["--heads", "4", "--kv-map", "tiled"], "no attention layer has fewer key/value heads"),
    (["--heads", "4", "--kv-heads", "2", "--kv-map", "0,1,0"], "--kv-map '0,1,0': expected"),
])
def test_a_kv_map_that_cannot_apply_is_refused_naming_it(tmp_path, capsys, options, says):
    if "--kv-heads" in options:
        _save(tmp_path / "m.pt")
    else:
        torch.save({k: v.detach().clone() for k, v in zoo.nanogpt().model.state_dict().items()}, tmp_path / "m.pt")
    code, _, err = _cli(capsys, tmp_path / "m.pt", *options, "--quiet", "--out", tmp_path / "o")
    assert code == 2 and says in err and "--kv-map" in err


def test_kv_map_syntax_and_its_company_are_checked(tmp_path, capsys):
    _save(tmp_path / "m.pt")
    with pytest.raises(SystemExit):
        main(["analyze", str(tmp_path / "m.pt"), "--kv-map", "h%2"])
    assert "expected 'grouped', 'tiled'" in capsys.readouterr().err
    (tmp_path / "layout.json").write_text(json.dumps({"layers": [{"module": "attn", "layout": QKVLayout(
        H, D, "q.weight", "k.weight", "v.weight", n_kv_heads=2).to_dict()}]}))
    code, _, err = _cli(capsys, tmp_path / "m.pt", "--layout", tmp_path / "layout.json", "--kv-map", "tiled",
                        "--out", tmp_path / "o")
    assert code == 2 and "kv_map field" in err


COMBOS = list(itertools.product([None, 2, 4, 8], [None, 1, 2, 4], [None, "grouped", "tiled"]))


@pytest.mark.parametrize("tiled", [True, False])
def test_no_combination_of_heads_and_kv_heads_is_silently_wrong(tmp_path, tiled):
    """Every combination is exact (float64 full SVD, the model's own pairing), refused naming what works, or
    states each thing it took that differs from the model: the head count (--heads) and the pairing."""
    state = _save(tmp_path / "m.pt", kv=2, tiled=tiled)
    truth = _reference(state, 2, tiled)
    for heads, kv, kv_map in COMBOS:
        analysis = analyze_checkpoints([tmp_path / "m.pt"], heads=heads, kv_heads=kv, kv_map=kv_map)
        if analysis.failures:
            ((_, message),) = analysis.failures
            assert any(fix in message for fix in ("--layout FILE", "--model", "--heads", "--kv-map")), message
            continue
        lay, stated = analysis.layers[0].layout, analysis.assumptions
        if (lay.n_heads, lay.kv_heads, list(lay.kv_index)) == (H, 2, _pairing(2, tiled)):
            assert_layer(analysis.spectra[0]["L00"], truth)  # read as the model computes: exact
            continue
        said = " ".join(stated) + " " + analysis.heads.note
        if lay.n_heads != H:
            assert f"{lay.n_heads} heads (--heads)" in said or "one head" in said, (heads, kv, kv_map, said)
        elif list(lay.kv_index) != _pairing(2, tiled):
            assert FIX_PAIRING in said or f"--kv-map {kv_map}" in said, (heads, kv, kv_map, said)
