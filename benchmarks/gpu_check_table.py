"""The markdown table of ``benchmarks/gpu_check.py``'s report: what docs/cost.md#the-accelerator-path shows."""

from __future__ import annotations

FAMILIES = (("loss", "loss"), ("grads", "gradient norms"), ("spectra", "spectra"), ("updates", "update ratios"),
            ("attention", "attention"), ("all", "all together"))


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def _heading(report: dict) -> list[str]:
    env = report["parts"].get("device", {}).get("results", {})
    name = env.get("name", "device unknown")
    commit = report.get("commit", {})
    dirty = " with uncommitted changes" if commit.get("dirty") else ""
    lines = [f"# GPU check: {name}, {report['started'][:10]}", ""]
    if report.get("dry_run"):
        lines += ["**Dry run on the CPU with tiny sizes: it checks the script, its figures are not the cost.**", ""]
    lines += [f"Commit `{commit.get('sha') or 'unknown'}`{dirty} ({commit.get('source')}); "
              f"torch {env.get('torch', '?')} (CUDA {env.get('cuda') or '-'}), driver {env.get('driver') or '-'}, "
              f"transformers {env.get('transformers') or '-'}, {env.get('memory_gib', '-')} GiB; "
              f"`{' '.join(report['command'])}`, started {report['started']}, "
              f"finished {report.get('finished') or '-'}.",
              ""]
    if report.get("error"):
        lines += [f"**{report['error']}**", ""]
    return lines


def _parts(report: dict) -> list[str]:
    rows = [[name, p.get("status"), p.get("seconds", "-"), p.get("limit_s", "-"), p.get("error", "")]
            for name, p in report["parts"].items()]
    return _table(["part", "status", "seconds", "limit (s)", "note"], rows)


def _tests(report: dict) -> list[str]:
    tests = report["parts"].get("cuda tests", {}).get("results", {}).get("tests", {})
    if not tests:
        return []
    rows = [[f"`{name}`", t["outcome"], t["message"][:120].replace("|", "/")] for name, t in tests.items()]
    return ["", "## The `cuda` tests", "", *_table(["test", "outcome", "message"], rows)]


def _model(r: dict) -> str:
    m = r.get("model", {})
    return f"{m.get('layers')} x {m.get('heads')}, d_model {m.get('d_model')}" if m else "?"


def _ratio(w: dict | None) -> str:
    return f"{w['ratio']:.3f} ({w['min']:.3f}-{w['max']:.3f}), {w['accounted_pct']:.1f}%" if w else "-"


def _overheads(report: dict) -> list[tuple[str, dict]]:
    return [(name, p.get("results", {})) for name, p in report["parts"].items()
            if name.startswith("overhead") and p.get("results")]


def _steps(report: dict) -> list[str]:
    rows = []
    labels = [e if e == "default" else f"every={e}" for e in report.get("sizes", {}).get("everys", ())]
    for _, r in _overheads(report):
        windows, quiet = r.get("windows", {}), r.get("non_sampled_us", {})
        batch = "x".join(map(str, r.get("batch", ["?"]))) + (f" ({r['calibration']})" if "calibration" in r else "")
        rows.append([_model(r), batch, f"{r['step_ms']:g} ms" if "step_ms" in r else "-",
                     *(_ratio(windows.get(label)) for label in labels),
                     f"{quiet['with a loss']:g} us" if "with a loss" in quiet else "-"])
    if not rows:
        return []
    return ["", "## Training steps with the Monitor / without", "",
            "Time ratio, median (min-max) of the repetitions, and the Monitor's accounted share of the plain step; "
            "on CUDA wall time after a synchronisation at every reading.", "",
            *_table(["model", "batch", "step without the Monitor", *(f"{label} cadence" for label in labels),
                     "one non-sampled `monitor.step` (with a loss)"], rows)]


def _families(report: dict) -> list[str]:
    rows = []
    for _, r in _overheads(report):
        fam = r.get("families_pct", {})
        if fam:
            rows.append([_model(r), "x".join(map(str, r.get("batch", ["?"]))),
                         *(f"{fam[k]['warm']:g}% ({fam[k]['cold']:g}%)" if k in fam else "-" for k, _ in FAMILIES)])
    if not rows:
        return []
    return ["", "## One sampled step of each family, as a fraction of a training step: warm (cold, the first)", "",
            *_table(["model", "batch", *(label for _, label in FAMILIES)], rows)]


def _attention(report: dict) -> list[str]:
    tokens = report["parts"].get("attention", {}).get("results", {}).get("tokens", {})
    if not tokens:
        return []
    rows = [[f"{int(n):,}", f"{t['forward_backward_ms']:g} ms", f"{t['default_ms']:g} ms = {t['default_x']:g}x",
             f"{t['every_row_ms']:g} ms = {t['every_row_x']:g}x"] for n, t in tokens.items()]
    sizes = report.get("sizes", {})
    model = f"2 layers x {sizes.get('heads')} heads, d_model {sizes.get('width')}"
    return ["", f"## The attention capture per sampled layer ({model}, batch 1)", "",
            *_table(["tokens", "forward + backward", "capture, default reading", "every row in float64"], rows)]


def markdown(report: dict) -> str:
    return "\n".join([*_heading(report), *_parts(report), *_tests(report), *_steps(report), *_families(report),
                      *_attention(report)])
