"""What ``analyze`` tells a user after the fact says what is there: the heads of grouped-query attention in the
summary, a finished analysis called finished (and what to pass to analyse again), ``alerts.jsonl`` in ``--out``
even when nothing fired."""

from __future__ import annotations

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
