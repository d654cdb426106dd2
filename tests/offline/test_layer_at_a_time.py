"""A series is analysed one layer at a time across consecutive checkpoints: never more than two layers'
weights held, every number still the float64 full-SVD reference's."""

from __future__ import annotations

import weakref

import pytest
import torch

from diag.offline import loaders
from diag.offline.series import analyze_checkpoints
from tests.offline.reference import (
    LAYERS,
    G,
    H,
    assert_layer,
    assert_updates,
    head_spectra,
    llama_series,
    update_ratios,
)


def _attention(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    return {n: state[f"model.layers.{i}.self_attn.{n}_proj.weight"] for n in "qkvo"}


def test_every_number_of_a_series_is_the_full_svd_reference(tmp_path):
    states = llama_series(tmp_path)
    analysis = analyze_checkpoints([tmp_path])
    assert not analysis.failures and analysis.steps == [0, 10, 20]
    pairing = [h // (H // G) for h in range(H)]  # the probe forward confirmed LLaMA's repeat_kv pairing
    for n, (step, state) in enumerate(zip(analysis.steps, states)):
        for i in range(LAYERS):
            w = _attention(state, i)
            assert_layer(analysis.spectra[step][f"L0{i}"], head_spectra(w["q"], w["k"], H, pairing))
            if n + 1 < len(states):
                want = update_ratios(w, _attention(states[n + 1], i))
                assert_updates(analysis.updates[step][f"L0{i}"], want, rel=1e-3)  # sigma_1 to the estimator's 1e-3


def test_no_more_than_two_layers_of_weights_are_held_at_once(tmp_path, monkeypatch):
    """Every tensor read from a checkpoint is tracked until it is freed; the most held at once is two layers'
    (here one: the previous checkpoint's layer is copied into the update's float32 snapshot and dropped before
    this checkpoint's is read). Was: every layer of a checkpoint, and the previous checkpoint's."""
    llama_series(tmp_path)
    live: dict[int, int] = {}
    most = [0]
    read = loaders.TensorSource.read

    def tracked(self, names):
        out = read(self, names)
        for t in out.values():
            live[id(t)] = t.numel() * t.element_size()
            weakref.finalize(t, live.pop, id(t), None)
        most[0] = max(most[0], sum(live.values()))
        return out

    monkeypatch.setattr(loaders.TensorSource, "read", tracked)
    analysis = analyze_checkpoints([tmp_path])
    assert not analysis.failures and analysis.steps == [0, 10, 20]
    layer = sum(t.numel() * t.element_size() for t in _attention(llama_series(tmp_path / "again", 1)[0], 0).values())
    assert layer <= most[0] <= 2 * layer, (most[0], layer)


@pytest.mark.parametrize("fmt", ["pt-zip", "safetensors"])
def test_reads_are_copies_that_leave_no_mapping_behind(tmp_path, fmt):
    """A tensor read is the caller's own memory: freeing it frees everything (no view into a mapping of the
    whole file that would keep what was read resident)."""
    from safetensors.torch import save_file

    from diag.offline.checkpoint import open_checkpoint

    state = {f"w{i}": torch.randn(64, 64) for i in range(3)}
    path = tmp_path / ("m.pt" if fmt == "pt-zip" else "m.safetensors")
    torch.save(state, path) if fmt == "pt-zip" else save_file(state, str(path))
    ckpt = open_checkpoint(path)
    got = ckpt.tensors.read(["w1"])
    assert list(got) == ["w1"] and torch.equal(got["w1"], state["w1"])
    storage = got["w1"].untyped_storage()
    assert storage.nbytes() == 64 * 64 * 4  # its own storage, not a slice of the file's
