"""Both reproductions over seeds, in one table: are the alerts early, right and quiet on healthy runs?

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.alerts --seeds 0 1 2

Collapse (``hooks.demo``, see evaluation/collapse.py): per seed the
no-warmup run and its 100-step warmup twin. Columns: first ``collapse_warning``,
first ``malignant_collapse``, established collapse and divergence (measured from
the metrics and the losses, not from the detectors), lead = (established or
divergence, whichever comes first) - first warning.

Eureka (evaluation/eureka.py): per seed the plain-softmax ViT and its NormSoftmax
twin. Columns: the step the plateau was flagged (``eureka_plateau``), the
detected ``eureka_moment``, the accuracy jump (first evaluation above halfway
from the no-indicator accuracy to 100%), their distance in logging intervals,
and the mean Q/K-to-V gradient ratio over the middle of the plateau (25-75% of
the way to the jump) and over the last quarter of the run.

The last column of every row lists the warning and critical alerts raised
(``kind@step``). Definitions: docs/alerts.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from evaluation import collapse, eureka


def eureka_row(seed: int, attention: str, steps: int, blind: float) -> dict:
    cfg = eureka.EurekaConfig(attention=attention, seed=seed, steps=steps)
    run = eureka.train(cfg)
    alerts = run.monitor.alert_sink.history
    plateau = collapse.first(alerts, "eureka_plateau")
    moment = collapse.first(alerts, "eureka_moment")
    jump, threshold = eureka.accuracy_jump(run.evals, blind)
    ratio = eureka.layer_mean_series(run.memory, "grad_ratio_qk_v")
    return {
        "seed": seed,
        "run": attention,
        "plateau": plateau,
        "moment": moment,
        "jump": jump,
        "threshold": threshold,
        "off": None if moment is None or jump is None else (moment - jump) / cfg.every,
        "ratio_plateau": eureka.mean_between(ratio, 0.25 * jump, 0.75 * jump) if jump else eureka.math.nan,
        "ratio_end": eureka.mean_between(ratio, 0.75 * steps, steps),
        "acc": run.evals[-1][2],
        "raised": sorted({f"{a.kind}@{a.step}" for a in alerts if a.level != "info"},
                         key=lambda s: int(s.split("@")[1])),
    }


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--collapse-steps", type=int, default=300)
    parser.add_argument("--eureka-steps", type=int, default=eureka.EurekaConfig.steps)
    parser.add_argument("--skip", choices=("collapse", "eureka"), default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    collapse, eurekas = [], []
    if args.skip != "collapse":
        with tempfile.TemporaryDirectory() as tmp:
            for seed in args.seeds:
                collapse += collapse.pair(seed, args.collapse_steps, Path(tmp))
                print(f"  [{time.perf_counter() - start:6.0f}s] collapse seed {seed}: "
                      f"{collapse[-2]['raised']} / {collapse[-1]['raised']}", flush=True)
    if args.skip != "eureka":
        blind = eureka.blind_accuracy()
        for seed in args.seeds:
            for attention in ("softmax", "normsoftmax"):
                eurekas.append(eureka_row(seed, attention, args.eureka_steps, blind))
                print(f"  [{time.perf_counter() - start:6.0f}s] eureka seed {seed} {attention}: "
                      f"{eurekas[-1]['raised']}", flush=True)

    if collapse:
        print("\nCollapse (hooks.demo, lr 5e-3; steps; lead = min(established, behind twin, divergence) "
              "- first warning)\n")
        print("| seed | run | first warning | first critical | established | behind twin | divergence | lead "
              "| final loss | warning/critical alerts |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in collapse:
            raised = ", ".join(r["raised"][:6]) + (" ..." if len(r["raised"]) > 6 else "") or "none"
            print(f"| {r['seed']} | {r['run']} | {fmt(r['warning'])} | {fmt(r['critical'])} | "
                  f"{fmt(r['established'])} | {fmt(r['behind'])} | {fmt(r['divergence'])} | {fmt(r['lead'])} | "
                  f"{r['loss']:.3f} | "
                  f"{raised} |")
    if eurekas:
        print(f"\nEureka (evaluation/eureka.py; no-indicator accuracy {blind:.3f}; jump = first evaluation above "
              f"the threshold, halfway from it to the final accuracy; offset = (moment - jump) in logging "
              f"intervals of {eureka.EurekaConfig.every} steps)\n")
        print("| seed | attention | plateau flagged | Eureka-moment | accuracy jump (threshold) | offset | "
              "Q/K:V ratio plateau | Q/K:V ratio end | final acc | warning/critical alerts |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in eurekas:
            raised = ", ".join(r["raised"]) or "none"
            print(f"| {r['seed']} | {r['run']} | {fmt(r['plateau'])} | {fmt(r['moment'])} | {fmt(r['jump'])} "
                  f"({r['threshold']:.2f}) | {fmt(r['off'])} | {fmt(r['ratio_plateau'])} | {fmt(r['ratio_end'])} | "
                  f"{r['acc']:.3f} | {raised} |")
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
