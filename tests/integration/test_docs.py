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
