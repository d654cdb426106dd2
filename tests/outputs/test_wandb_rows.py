"""A user's W&B run keeps every row with a WandbSink, read back right after ``run.finish()``: benchmarks/wandb_rows.py
with its defaults, 30 runs of the user loop, three processes at once beside a process writing other W&B runs.

In every fifth run of each process W&B's finish message is held back for 8 s, as on a machine too busy to run
W&B's service: there a copy of the file taken when ``run.finish()`` returned lacks the last row (so a reader that
does not wait would have missed it), and the run read with ``read_offline_run`` must still hold every row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = list(range(6))


def test_thirty_user_loops_three_at_once_keep_every_row(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wandb_rows.py"), "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-4000:]}"
    results = json.loads(out.read_text())
    assert len(results) == 30 and len({r["run"] for r in results}) == 30
    for r in results:  # every user row and every Monitor step, each in its own row
        assert r["read"] == {"user": STEPS, "monitor": STEPS}, r
    late = [r for r in results if r["late"]]
    assert len(late) == 6
    for r in late:  # the end of the file was not on disk when run.finish() returned: the check can fail
        assert r["bytes_at_finish"] < r["bytes"], r
        assert r["at_once"]["user"] != STEPS and 5 not in r["at_once"]["user"], r
    assert "30 of 30 runs" in done.stdout and "read_offline_run: 30 of 30 kept every row" in done.stdout
