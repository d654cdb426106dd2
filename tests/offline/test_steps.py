"""A checkpoint's step: stored with it first, then a name that reads as a step, never a model size; else its
position in the series, stated in the text and the JSON."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from diag.cli.main import main
from diag.offline.checkpoint import step_from_name
from diag.offline.series import analyze_checkpoints
from tests.support import zoo


def _state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in zoo.nanogpt().model.state_dict().items()}


@pytest.mark.parametrize("name, step", [("step-1000", 1000), ("checkpoint-1000", 1000), ("iter_0001000", 1000),
                                        ("global_step1000", 1000), ("ckpt_0005.pt", 5), ("step_100.safetensors", 100),
                                        ("epoch=2-step=300.ckpt", 300), ("000250.pt", 250), ("1000", 1000)])
def test_names_that_read_as_steps(tmp_path, name, step):
    assert step_from_name(tmp_path / name) == step


@pytest.mark.parametrize("name", ["llama8b", "gpt2.pt", "Llama-3.1-70B", "pythia-160m", "bert-base-uncased",
                                  "model_v2.safetensors", "t5-11b.bin"])
def test_model_sizes_and_versions_are_no_steps(tmp_path, name):
    assert step_from_name(tmp_path / name) is None


def test_a_folder_named_like_a_model_size_is_not_step_8(tmp_path, capsys):
    """Was: ``llama8b`` analysed at step 8, ``gpt2.pt`` at step 2 (the last number in the name)."""
    model = zoo.llama().model
    model.save_pretrained(tmp_path / "llama8b")
    code = main(["analyze", str(tmp_path / "llama8b"), "--json", "--out", str(tmp_path / "o"), "--no-report"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["checkpoints"] == [{"path": str(tmp_path / "llama8b"), "step": 0,
                                                     "step_from": "position"}]
    assert any("position in the series" in a and "llama8b" in a for a in summary["assumptions"])
    code = main(["analyze", str(tmp_path / "llama8b"), "--out", str(tmp_path / "o2"), "--no-report"])
    text = capsys.readouterr().out
    assert code == 0 and "steps 0..0" in text and "its position in the series" in text  # the text says so too


def test_the_step_stored_with_a_checkpoint_comes_before_its_name(tmp_path):
    torch.save({"model": _state(), "iter_num": 70}, tmp_path / "step_3.pt")  # the name says 3, the file 70
    save_file(_state(), str(tmp_path / "ckpt_9.safetensors"), metadata={"step": "12"})
    analysis = analyze_checkpoints([tmp_path], heads=4)
    assert analysis.analysed == [(str(tmp_path / "ckpt_9.safetensors"), 12), (str(tmp_path / "step_3.pt"), 70)]
    assert not analysis.positions and not any("position" in a for a in analysis.assumptions)


def test_trainer_state_gives_the_step_of_a_weights_file_inside_a_checkpoint_folder(tmp_path):
    folder = tmp_path / "run" / "last"
    zoo.gpt2().model.save_pretrained(folder)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 480}))
    analysis = analyze_checkpoints([folder / "model.safetensors"])
    assert analysis.steps == [480]


def test_a_series_without_steps_is_ordered_by_position_and_says_so(tmp_path):
    state = _state()
    for name in ("b.pt", "a.pt", "c.pt"):
        torch.save(state, tmp_path / name)
    analysis = analyze_checkpoints([tmp_path / "b.pt", tmp_path / "a.pt", tmp_path / "c.pt"], heads=4)
    assert analysis.analysed == [(str(tmp_path / n), i) for i, n in enumerate(("b.pt", "a.pt", "c.pt"))]
    assert analysis.positions == [p for p, _ in analysis.analysed]
    assert analysis.summary()["checkpoints"][2] == {"path": str(tmp_path / "c.pt"), "step": 2, "step_from": "position"}


def test_in_a_series_with_steps_a_checkpoint_without_one_fails_naming_the_fix(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "step_10.pt")
    torch.save(state, tmp_path / "step_20.pt")
    torch.save(state, tmp_path / "final.pt")
    analysis = analyze_checkpoints([tmp_path], heads=4)
    assert analysis.steps == [10, 20] and not analysis.positions
    ((path, message),) = analysis.failures
    assert path == str(tmp_path / "final.pt") and "rename it with its step" in message and "final.pt" in message
