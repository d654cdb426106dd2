"""``--jobs N`` and ``--resume``: the outputs of one uninterrupted process, byte for byte."""

from __future__ import annotations

import json

import pytest

import diag.offline.series as series
import diag.offline.source as source
from diag.cli import analyze as analyze_cli
from diag.cli.main import main
from tests.offline.reference import LAYERS, G, H, assert_layer, head_spectra, llama_series


def _run(paths, out, *options) -> int:
    return main(["analyze", *map(str, paths), "--out", str(out), "--quiet", "--no-report", *options])


def _outputs(out) -> tuple[bytes, bytes]:
    return (out / "metrics.jsonl").read_bytes(), (out / "alerts.jsonl").read_bytes()


def _events(out) -> list:
    return sorted(p.relative_to(out) for p in out.rglob("events.out.tfevents.*"))


class Count:
    """compute_unit, counted (the units the analysis really computed, not read back)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        original = source.compute_unit

        def counted(entry, previous, *args):
            self.calls.append(entry.path.name)
            return original(entry, previous, *args)

        monkeypatch.setattr(source, "compute_unit", counted)


def test_jobs_give_the_outputs_of_one_process_byte_for_byte(tmp_path, capsys):
    states = llama_series(tmp_path / "ckpts", 4)
    assert _run([tmp_path / "ckpts"], tmp_path / "one", "--json") == 0
    one = json.loads(capsys.readouterr().out)
    assert _run([tmp_path / "ckpts"], tmp_path / "three", "--json", "--jobs", "3") == 0
    three = json.loads(capsys.readouterr().out)
    assert _outputs(tmp_path / "one") == _outputs(tmp_path / "three")
    one.pop("outputs"), three.pop("outputs")
    assert one == three and len(one["checkpoints"]) == 4
    sigma1 = one["metrics"]["30"]["L03"]["qk_sigma1"]  # and the numbers are the reference's
    want = head_spectra(states[3]["model.layers.3.self_attn.q_proj.weight"],
                        states[3]["model.layers.3.self_attn.k_proj.weight"], H, [h // (H // G) for h in range(H)])
    assert sigma1 == pytest.approx(want[:, 0].tolist(), rel=1e-6)


def test_an_interrupted_analysis_resumes_with_the_outputs_of_an_uninterrupted_one(tmp_path, monkeypatch):
    llama_series(tmp_path / "ckpts", 4)
    assert _run([tmp_path / "ckpts"], tmp_path / "whole") == 0

    def interrupted(quiet):  # Ctrl-C after the second checkpoint was written
        def wrap(items):
            for i, item in enumerate(items):
                if i == 2:
                    raise KeyboardInterrupt
                yield item
        return wrap

    monkeypatch.setattr(analyze_cli, "_progress", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run([tmp_path / "ckpts"], tmp_path / "out")
    monkeypatch.undo()
    stored = list((tmp_path / "out" / "per-checkpoint").glob("*.json"))
    assert len(stored) == 2 and (tmp_path / "out" / "metrics.jsonl").read_bytes() != _outputs(tmp_path / "whole")[0]
    assert _run([tmp_path / "ckpts"], tmp_path / "out") == 2  # not without --resume (nor --overwrite)
    count = Count(monkeypatch)
    assert _run([tmp_path / "ckpts"], tmp_path / "out", "--resume") == 0
    assert count.calls == ["checkpoint-20", "checkpoint-30"]  # the two stored ones are read back, not computed
    assert _outputs(tmp_path / "out") == _outputs(tmp_path / "whole")
    assert len(_events(tmp_path / "out")) == len(_events(tmp_path / "whole"))  # the stopped run's events replaced


def test_resume_computes_only_new_or_changed_checkpoints(tmp_path, monkeypatch):
    states = llama_series(tmp_path / "ckpts", 3)
    assert _run([tmp_path / "ckpts"], tmp_path / "out") == 0
    count = Count(monkeypatch)
    assert _run([tmp_path / "ckpts"], tmp_path / "out", "--resume") == 0
    assert count.calls == []
    state = {k: v.clone() for k, v in states[1].items()}
    state["model.layers.0.self_attn.q_proj.weight"] *= 2  # checkpoint-10 re-written with other weights
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "ckpts" / "checkpoint-10" / "model.safetensors"), metadata={"format": "pt"})
    assert _run([tmp_path / "ckpts"], tmp_path / "out", "--resume") == 0
    assert count.calls == ["checkpoint-10", "checkpoint-20"]  # it, and the update from it to the next
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    got = {r["tag"]: r["value"] for r in lines if r["step"] == 10 and r["tag"].startswith("qk_sigma1/L00/")}
    want = head_spectra(state["model.layers.0.self_attn.q_proj.weight"],
                        state["model.layers.0.self_attn.k_proj.weight"], H, [h // (H // G) for h in range(H)])
    assert [got[f"qk_sigma1/L00/H{h:02d}"] for h in range(H)] == pytest.approx(want[:, 0].tolist(), rel=1e-6)
    assert len(list((tmp_path / "out" / "per-checkpoint").glob("*.json"))) == 3  # stale units removed


def test_a_torn_unit_is_computed_again(tmp_path, monkeypatch):
    llama_series(tmp_path / "ckpts", 2)
    assert _run([tmp_path / "ckpts"], tmp_path / "out") == 0
    whole = _outputs(tmp_path / "out")
    torn = sorted((tmp_path / "out" / "per-checkpoint").glob("*.json"))[0]
    torn.write_text(torn.read_text()[:100])
    count = Count(monkeypatch)
    assert _run([tmp_path / "ckpts"], tmp_path / "out", "--resume") == 0
    assert len(count.calls) == 1 and _outputs(tmp_path / "out") == whole


def test_overwrite_starts_again_and_both_together_are_refused(tmp_path, monkeypatch, capsys):
    llama_series(tmp_path / "ckpts", 2)
    assert _run([tmp_path / "ckpts"], tmp_path / "out") == 0
    assert _run([tmp_path / "ckpts"], tmp_path / "out", "--overwrite", "--resume") == 2
    assert "either --overwrite" in capsys.readouterr().err
    count = Count(monkeypatch)
    assert _run([tmp_path / "ckpts"], tmp_path / "out", "--overwrite") == 0
    assert len(count.calls) == 2


def test_a_series_spread_over_processes_keeps_the_layer_arrays_of_the_reference(tmp_path):
    states = llama_series(tmp_path / "ckpts", 3)
    analysis = series.analyze_checkpoints([tmp_path / "ckpts"], jobs=2)
    assert not analysis.failures and analysis.steps == [0, 10, 20]
    pairing = [h // (H // G) for h in range(H)]
    for step, state in zip(analysis.steps, states):
        for i in range(LAYERS):
            q, k = (state[f"model.layers.{i}.self_attn.{n}_proj.weight"] for n in "qk")
            assert_layer(analysis.spectra[step][f"L0{i}"], head_spectra(q, k, H, pairing))
