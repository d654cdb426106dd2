"""The documentation site builds with --strict (no broken link or nav entry) and the examples run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "metrics" / "index.html").exists()


def test_custom_attention_example_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "02_custom_attention.py")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "qk_sigma1/L00/H00" in result.stdout


def test_every_alert_field_is_in_the_defaults_table_and_none_that_is_gone():
    """docs/alerts.md#defaults lists exactly AlertConfig's fields, one a row, each with its default: no field the
    config lacks, none it has missing."""
    import re

    from diag.detectors import AlertConfig

    doc = (Path(__file__).resolve().parents[2] / "docs" / "alerts.md").read_text()
    table = doc[doc.index("## Defaults"):doc.index("## The kinds")]
    rows = re.findall(r"^\| `([a-z_]+)`(?:, `([a-z_]+)`)? \| ([^|]+) \|", table, re.M)
    assert all(not second for _, second, _ in rows), "one field a row: its default is the row's number"
    documented = {name: default for name, _, default in rows}
    fields = AlertConfig().fields()
    assert set(documented) == set(fields)
    for name, value in fields.items():
        assert float(documented[name].split()[0]) == value, (name, documented[name])
