"""Collapse alerts over seeds: the demo's no-warmup run against its warmup twin.

    .venv/bin/python -m evaluation.collapse --seeds 0 1 2 --steps 300

For each seed, trains the demo GPT (``hooks.demo``: character-level, Python's
standard library source, lr 5e-3) twice: without warmup (the collapse setting)
and with a 100-step linear warmup (the healthy twin). Prints one row per run:
the step of the first ``collapse_warning`` (early warning), of the first
``malignant_collapse`` (critical), of the established collapse and of the
divergence (both measured from the logged metrics and losses, independently of
the detectors; definitions below and in docs/alerts.md), the lead time, the
final loss (mean of the last 50 steps) and every alert kind raised. About 35 s
per run on 2 idle cores.

* established collapse: the first sampled step that starts ``ESTABLISHED_MIN``
  (5) consecutive samples, 50 steps, in which one head is malignant (attention
  entropy <= 0.5 nats and effective rank <= 10% of its rows, the state of Qi
  et al.);
* behind twin: the first step from which the run's 50-step mean loss stays
  more than 10% above its warmup twin's, to the end of the run;
* divergence: the first step whose loss is not finite or whose 10-step mean
  loss exceeds 1.5 times the lowest 10-step mean before it;
* lead time: the earliest of these three minus the first warning.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from diag.detectors import AlertConfig, attention_state
from hooks.demo import DemoRun, train

ESTABLISHED_MIN = 5  # consecutive samples (50 steps at every=10) a head must stay malignant
BEHIND_FACTOR = 1.1
BEHIND_WINDOW = 50
DIVERGE_FACTOR = 1.5
DIVERGE_WINDOW = 10


def first(alerts, kind: str, levels: tuple[str, ...] | None = None) -> int | None:
    steps = [a.step for a in alerts if a.kind == kind and (levels is None or a.level in levels)]
    return min(steps) if steps else None


def read_metrics(path: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl -> {step: {tag: value}} (non-finite values come back as NaN)."""
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        r = json.loads(line)
        by_step[r["step"]][r["tag"]] = math.nan if r["value"] is None else float(r["value"])
    return dict(by_step)


def established_collapse(by_step: dict[int, dict[str, float]], cfg: AlertConfig | None = None,
                         min_samples: int = ESTABLISHED_MIN) -> tuple[int | None, str]:
    """The first sampled step that starts `min_samples` consecutive samples in which one head is malignant."""
    cfg = cfg or AlertConfig()
    series: dict[str, list[tuple[int, bool]]] = defaultdict(list)
    for step in sorted(by_step):
        tags = by_step[step]
        for tag, entropy in tags.items():
            parts = tag.split("/")
            if parts[0] != "attn_entropy" or len(parts) != 3 or not parts[2].startswith("H"):
                continue
            layer = parts[1]
            rank, rows = tags.get(f"attn_rank/{layer}/{parts[2]}"), tags.get(f"attn_rows/{layer}")
            ok = rank is not None and rows is not None and math.isfinite(entropy) and math.isfinite(rank)
            state = attention_state(entropy, rank, rows, cfg) if ok else "normal"
            series[f"{layer}/{parts[2]}"].append((step, state == "malignant"))
    best: tuple[int | None, str] = (None, "")
    for where, points in series.items():
        run = 0
        for i, (_, malignant) in enumerate(points):
            run = run + 1 if malignant else 0
            if run == min_samples:
                start = points[i - min_samples + 1][0]
                if best[0] is None or start < best[0]:
                    best = (start, where)
                break
    return best


def behind_twin(losses: list[float], twin: list[float], factor: float = BEHIND_FACTOR,
                window: int = BEHIND_WINDOW) -> int | None:
    """The first step from which the run's `window`-step mean loss stays above `factor` x its twin's to the end."""
    n = min(len(losses), len(twin))
    start = None
    for t in range(window, n + 1):
        behind = sum(losses[t - window: t]) > factor * sum(twin[t - window: t])
        start = (start if start is not None else t - 1) if behind else None
    return start


def divergence(losses: list[float], factor: float = DIVERGE_FACTOR, window: int = DIVERGE_WINDOW) -> int | None:
    """The first step with a non-finite loss, or whose `window`-step mean exceeds `factor` x the lowest before it."""
    lowest = math.inf
    for t, loss in enumerate(losses):
        if not math.isfinite(loss):
            return t
        if t + 1 >= window:
            mean = sum(losses[t + 1 - window: t + 1]) / window
            if mean > factor * lowest:
                return t
            lowest = min(lowest, mean)
    return None


def run(seed: int, warmup: int, steps: int, logdir: Path) -> dict:
    monitor, losses = train(DemoRun(logdir=logdir, steps=steps, seed=seed, warmup=warmup, quiet=True))
    alerts = monitor.alert_sink.history
    warn, crit = first(alerts, "collapse_warning"), first(alerts, "malignant_collapse")
    established, head = established_collapse(read_metrics(logdir / "metrics.jsonl"))
    diverged = divergence(losses)
    return {
        "seed": seed,
        "run": f"warmup {warmup}" if warmup else "no warmup",
        "warning": warn,
        "note": first(alerts, "large_early_updates"),
        "critical": crit,
        "established": established,
        "established_head": head,
        "divergence": diverged,
        "behind": None,
        "lead": None,
        "loss": sum(losses[-50:]) / len(losses[-50:]),
        "losses": losses,
        "kinds": dict(Counter(a.kind for a in alerts)),
        "raised": sorted({f"{a.kind}@{a.step}" for a in alerts if a.level != "info"},
                         key=lambda s: int(s.split("@")[1])),
    }


def pair(seed: int, steps: int, tmp: Path) -> list[dict]:
    """The no-warmup run and its 100-step warmup twin; ``behind`` and ``lead`` filled in."""
    rows = [run(seed, warmup, steps, tmp / f"s{seed}-w{warmup}") for warmup in (0, 100)]
    rows[0]["behind"] = behind_twin(rows[0]["losses"], rows[1]["losses"])
    rows[1]["behind"] = behind_twin(rows[1]["losses"], rows[0]["losses"])
    for r in rows:
        ends = [s for s in (r["established"], r["behind"], r["divergence"]) if s is not None]
        r["lead"] = None if r["warning"] is None or not ends else min(ends) - r["warning"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for r in pair(seed, args.steps, Path(tmp)):
                print(f"seed {r['seed']}  {r['run']:<10}  first warning {str(r['warning']):>4}  "
                      f"first critical {str(r['critical']):>4}  established {str(r['established']):>4}  "
                      f"behind twin {str(r['behind']):>4}  divergence {str(r['divergence']):>4}  "
                      f"lead {str(r['lead']):>4}  final loss {r['loss']:.3f}  alerts {r['kinds']}", flush=True)


if __name__ == "__main__":
    main()
