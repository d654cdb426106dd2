"""analyze --probe: attention signals from a model built from config.json equal the live Monitor's."""

from __future__ import annotations

import pytest
import torch

from diag.cli.main import main
from diag.offline.series import analyze_checkpoints
from diag.outputs.sinks import MemorySink
from hooks.checkpoint.probe import Probe
from hooks.monitor.monitor import Monitor
from tests.support import zoo

ATTN_TAGS = ("attn_entropy", "attn_rank", "attn_max_logit", "attn_rows", "attn_entropy_uniform")


def _ids() -> torch.Tensor:
    return torch.randint(0, zoo.VOCAB, (2, zoo.SEQ), generator=torch.Generator().manual_seed(1))


def _live(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, float]:
    mem = MemorySink()
    model.train()
    with Monitor(model, every=1, sinks=[mem], signals=("attention",)) as monitor:
        model(input_ids=ids)
        monitor.step(0)
    return {t: v for t, v in mem.records[0].scalars.items() if t.startswith(ATTN_TAGS)}


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_probe_gives_the_live_monitors_attention(model_name, tmp_path):
    case = zoo.gpt2(dropout=0.0) if model_name == "gpt2" else zoo.llama(dropout=0.0)
    case.model.save_pretrained(tmp_path / "hf")
    ids = _ids()
    (tmp_path / "ids.txt").write_text("\n".join(" ".join(map(str, row.tolist())) for row in ids))
    live = _live(case.model, ids)
    analysis = analyze_checkpoints([tmp_path / "hf"], probe=Probe(tmp_path / "ids.txt"))
    assert not analysis.failures, analysis.failures
    offline = {t: v for t, v in analysis.records[0].scalars.items() if t.startswith(ATTN_TAGS)}
    assert sorted(offline) == sorted(live) and len(live) > 10
    for tag, value in live.items():
        assert offline[tag] == pytest.approx(value, rel=1e-6, abs=1e-9), tag


def test_probe_without_a_config_is_reported_and_the_weights_still_analysed(tmp_path, capsys):
    torch.save(zoo.nanogpt().model.state_dict(), tmp_path / "step_1.pt")
    (tmp_path / "ids.txt").write_text("1 2 3 4 5\n")
    code = main(["analyze", str(tmp_path / "step_1.pt"), "--heads", "4", "--probe", str(tmp_path / "ids.txt"),
                 "--out", str(tmp_path / "out"), "--quiet", "--no-report"])
    assert code == 1
    assert "probe: " in capsys.readouterr().err and (tmp_path / "out" / "metrics.jsonl").stat().st_size > 0
    assert main(["analyze", str(tmp_path / "step_1.pt"), "--probe", str(tmp_path / "nope.txt"),
                 "--out", str(tmp_path / "out2"), "--quiet"]) == 2


def test_probe_from_the_command_line_adds_the_attention_figure(tmp_path, capsys):
    case = zoo.gpt2(dropout=0.0)
    case.model.save_pretrained(tmp_path / "checkpoint-5")
    (tmp_path / "ids.txt").write_text(" ".join(map(str, _ids()[0].tolist())))
    out = tmp_path / "out"
    assert main(["analyze", str(tmp_path / "checkpoint-5"), "--probe", str(tmp_path / "ids.txt"),
                 "--out", str(out), "--quiet"]) == 0
    assert (out / "report" / "attention.png").read_bytes()[:4] == b"\x89PNG"
    assert "attn_entropy/L01/H03" in (out / "metrics.jsonl").read_text()
