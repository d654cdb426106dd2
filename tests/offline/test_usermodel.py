"""``--model MODULE:CALLABLE``: the user's own model, built on the meta device, gives a bare state dict its
layouts; the pairing read by probing each attention module alone where the model is small enough, stated
where it is not."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

import hooks.checkpoint.usermodel as usermodel
from diag.cli.main import main
from diag.offline.layers import FIX_PAIRING
from diag.offline.series import analyze_checkpoints
from tests.offline.reference import assert_layer, head_spectra
from tests.offline.test_pairing import GQA, H, _pairing

SOURCE = '''
import torch
from torch import nn
from tests.offline.test_pairing import GQA

BUILT_ON = []


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = GQA(2, tiled=True)
        self.attn.heads = 4  # the head count is the module's own attribute
        BUILT_ON.append(self.attn.q.weight.device.type)


def build():
    return Net()


def not_a_model():
    return {"attn": 1}
'''


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    path = tmp_path / "usernet.py"
    path.write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "usernet", raising=False)
    torch.manual_seed(0)
    net = nn.Module()
    net.attn = GQA(2, tiled=True)
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save(state, tmp_path / "step_3.pt")
    return path, state


def test_a_tiled_model_of_its_own_is_exact_with_model(model_file, capsys):
    path, state = model_file
    code = main(["analyze", str(path.parent / "step_3.pt"), "--model", "usernet:build", "--json", "--no-report",
                 "--out", str(path.parent / "o")])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["heads"]["source"] == "--model"
    (layer,) = summary["layers"]
    assert layer["kv_map"] == [0, 1, 0, 1] and layer["adapter"].endswith("+probe") and layer["heads"] == H
    assert not any(FIX_PAIRING in a for a in summary["assumptions"])
    import usernet

    assert usernet.BUILT_ON[0] == "meta"  # discovery on the meta device; the probe's build is the second
    analysis = analyze_checkpoints([path.parent / "step_3.pt"], user_model=usermodel.UserModel(f"{path}:build"))
    assert_layer(analysis.spectra[3]["L00"], head_spectra(state["attn.q.weight"], state["attn.k.weight"], H,
                                                          _pairing(2, tiled=True)))


def test_a_model_too_large_to_probe_states_the_pairing_and_kv_map_sets_it(model_file, monkeypatch):
    path, state = model_file
    monkeypatch.setattr(usermodel, "MAX_TWIN_PARAMS", 0)
    analysis = analyze_checkpoints([path.parent / "step_3.pt"], user_model=usermodel.UserModel("usernet:build"))
    assert not analysis.failures and any(FIX_PAIRING in a for a in analysis.assumptions)
    fixed = analyze_checkpoints([path.parent / "step_3.pt"], user_model=usermodel.UserModel("usernet:build"),
                                kv_map="tiled")
    assert not fixed.failures and not any(FIX_PAIRING in a for a in fixed.assumptions)
    assert_layer(fixed.spectra[3]["L00"], head_spectra(state["attn.q.weight"], state["attn.k.weight"], H,
                                                       _pairing(2, tiled=True)))


@pytest.mark.parametrize("spec, says", [("usernet", "expected MODULE:CALLABLE"),
                                        ("no_such_module_xyz:build", "importing no_such_module_xyz failed"),
                                        ("usernet:nothing", "has no 'nothing'"),
                                        ("usernet:not_a_model", "not a torch.nn.Module"),
                                        ("missing.py:build", "no file missing.py")])
def test_a_model_option_that_cannot_be_used_exits_2_naming_it(model_file, capsys, spec, says):
    path, _ = model_file
    code = main(["analyze", str(path.parent / "step_3.pt"), "--model", spec, "--quiet", "--no-report", "--out",
                 str(path.parent / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"--model {spec}" in err.replace(repr(spec), spec) and says in err


def test_model_with_heads_is_refused(model_file, capsys):
    path, _ = model_file
    code = main(["analyze", str(path.parent / "step_3.pt"), "--model", "usernet:build", "--heads", "4", "--quiet",
                 "--out", str(path.parent / "o")])
    assert code == 2 and "--model" in capsys.readouterr().err
