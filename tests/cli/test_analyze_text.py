"""What ``analyze`` tells a user after the fact says what is there: the heads of grouped-query attention in the
summary, a finished analysis called finished (and what to pass to analyse again), ``alerts.jsonl`` in ``--out``
even when nothing fired."""

from __future__ import annotations

import pytest

from diag.cli.main import main
from tests.support import zoo


def _analyze(path, out, *options) -> int:
    return main(["analyze", str(path), "--out", str(out), "--no-report", *options])


def test_the_summary_names_the_key_value_heads_of_grouped_query_attention(tmp_path, capsys):
    zoo.llama(kv_heads=2).model.save_pretrained(tmp_path / "llama")
    assert _analyze(tmp_path / "llama", tmp_path / "gqa") == 0
    said = capsys.readouterr().out
    assert "4 query heads, 2 key/value heads, of 8)" in said, said
    zoo.llama(kv_heads=4).model.save_pretrained(tmp_path / "mha")
    assert _analyze(tmp_path / "mha", tmp_path / "mha-out") == 0
    said = capsys.readouterr().out
    assert "4 heads of 8)" in said and "key/value" not in said, said  # as many key/value heads: one count


def _files(out) -> dict:
    """Every file under ``out`` with its bytes and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_finished_analysis_is_called_finished_and_resume_has_nothing_to_continue(tmp_path, capsys):
    zoo.gpt2().model.save_pretrained(tmp_path / "tiny-gpt2")
    out = tmp_path / "out"
    assert _analyze(tmp_path / "tiny-gpt2", out, "--quiet") == 0
    assert (out / "alerts.jsonl").read_bytes() == b""  # nothing fired, and the file is there to say so
    capsys.readouterr()
    assert _analyze(tmp_path / "tiny-gpt2", out, "--quiet") == 2
    err = capsys.readouterr().err
    assert "holds a finished analysis" in err and "stopped" not in err and "--overwrite" in err, err
    before = _files(out)
    assert _analyze(tmp_path / "tiny-gpt2", out, "--resume") == 0
    captured = capsys.readouterr()
    assert "nothing to continue" in captured.err and "--overwrite" in captured.err, captured.err
    assert captured.out == "" and _files(out) == before  # left as it was: not one file written again
    assert _analyze(tmp_path / "tiny-gpt2", out, "--quiet", "--overwrite") == 0
    assert (out / "metrics.jsonl").read_bytes() == before[out / "metrics.jsonl"][0]


def test_a_stopped_analysis_is_called_stopped(tmp_path, capsys, monkeypatch):
    from diag.cli import analyze as analyze_cli

    for step in (0, 10):
        zoo.gpt2().model.save_pretrained(tmp_path / "ckpts" / f"checkpoint-{step}")

    def interrupted(quiet):  # Ctrl-C after the first checkpoint was computed
        def wrap(items):
            for i, item in enumerate(items):
                if i == 1:
                    raise KeyboardInterrupt
                yield item
        return wrap

    monkeypatch.setattr(analyze_cli, "_progress", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _analyze(tmp_path / "ckpts", tmp_path / "out")
    monkeypatch.undo()
    capsys.readouterr()
    assert _analyze(tmp_path / "ckpts", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "holds a stopped analysis" in err and "--resume" in err and "finished" not in err, err
    assert _analyze(tmp_path / "ckpts", tmp_path / "out", "--quiet", "--resume") == 0
    assert capsys.readouterr().err == ""  # continued: there was something to continue
    assert _analyze(tmp_path / "ckpts", tmp_path / "out") == 2
    assert "holds a finished analysis" in capsys.readouterr().err
