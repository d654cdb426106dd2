"""One command that measures, on a lent CUDA device, what the Monitor costs users who train on GPUs.

    python3 benchmarks/gpu_check.py --out "$OUT"          # on the device, from the checkout's root (<= 8 minutes)
    python3 benchmarks/gpu_check.py --dry-run --out /tmp/x  # the same parts on the CPU with tiny sizes (CI)

Runs each part in its own child process under its own time limit (``--limit NAME=SECONDS``), all of them within
``--budget`` seconds, and writes ``gpu_check.json`` and ``gpu_check.md`` under ``--out`` before and after every
part, so a run cut short still leaves what it measured (a part cut off is recorded as ``timed out``, with the
figures its output held until then; one the whole run was killed in stays ``running``). The parts, in order:

* ``device``: the device, driver, CUDA, torch and transformers versions, and where ``diag`` is imported from;
* ``cuda tests``: every ``cuda``-marked test of ``tests/`` (``pytest -m cuda``), passed, failed or skipped, each;
* ``overhead <model> batch``: ``benchmarks/overhead.py --device cuda --only 2 3 4`` at batch 4 x 128, GPT-2-small
  and the 4 x 256 GPT-2: the time ratio of training with the Monitor at the default cadence and at ``every=100``,
  one non-sampled ``monitor.step``, and each signal family's sampled step as a fraction of a training step;
* ``attention``: ``overhead.py --only 6`` at 4,096 and 8,192 tokens, the capture per sampled layer against the
  model's forward and backward;
* ``overhead <model> long step``: items 2 and 4 at the batch that makes a plain step at least 100 ms long
  (``--min-step-ms``: the batch's sequences doubled from 4 until it does).

The checkout needs no installation: the children run with the checkout on ``PYTHONPATH``, models are built from
configs with random weights, and nothing reads the network. docs/cost.md#the-gpu-check says where the outputs
go.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

# benchmarks/, this file's folder: first on the path of a script
from gpu_check_env import commit
from gpu_check_table import markdown

ROOT = Path(__file__).resolve().parents[1]
OVERHEAD = "benchmarks/overhead.py"


@dataclass(frozen=True)
class Sizes:
    """What the parts measure: on the device, or tiny on the CPU (``--dry-run``)."""

    device: str
    models: tuple[str, ...]
    everys: tuple[str, ...]  # overhead.py --everys: "default" (whose window is 100 steps) and a period
    batch: tuple[int, int]
    min_step_ms: float
    max_batch: int
    reps: int
    long_reps: int
    lengths: tuple[int, ...]
    width: int
    heads: int
    threads: int


GPU = Sizes("cuda", ("small", "4x256"), ("default", "100"), (4, 128), 100.0, 1024, 3, 2, (4096, 8192), 256, 8, 2)
# The doubling stops at the --max-batch of 4 sequences long before a 1,000 ms step: the loop and its limit both run.
DRY = Sizes("cpu", ("tiny",), ("default", "10"), (1, 8), 1000.0, 4, 1, 1, (64, 128), 64, 4, 1)
LIMITS = {"device": 60, "cuda tests": 180, "overhead small batch": 150, "overhead 4x256 batch": 90,
          "attention": 120, "overhead small long step": 180, "overhead 4x256 long step": 150}


@dataclass
class Part:
    name: str
    argv: list[str]  # run as [sys.executable, "-u", *argv] from the checkout's root
    read: Callable[[str, Path], dict]  # (its stdout, its scratch folder) -> its figures
    expect: tuple[str, ...]  # the figures an "ok" part holds
    limit_s: float = 120.0


# ---- reading benchmarks/overhead.py's output -------------------------------------------------------------------

NUMBER = r"(-?[\d.]+)"  # a difference of two timings can fall below zero
OVERHEAD_LINES = {
    "model": re.compile(r"^model: GPT-2 shape (\d+) layers x (\d+) heads, d_model (\d+); batch (\d+) x (\d+)"
                        r"(?: \(([^)]*)\))?;"),
    "window": re.compile(rf"^\s+(default|every=\d+)\s+\(\s*(\d+) steps\): time ratio {NUMBER} \(min {NUMBER}, "
                         rf"max {NUMBER};.*accounted share of the Monitor {NUMBER}%"),
    "step": re.compile(rf"training step without monitor: {NUMBER} ms"),
    "non_sampled": re.compile(rf"^3\. one non-sampled monitor\.step (with|without) a loss: {NUMBER} us = {NUMBER}%"),
    "family": re.compile(rf"^\s+(\w+): first \(cold\)\s+{NUMBER}%, warm\s+{NUMBER}% \(min {NUMBER}, max {NUMBER}\)"),
    "tokens": re.compile(rf"^\s*(\d+) tokens: forward\+backward\s+{NUMBER} ms; capture per sampled layer: default"
                         rf"\s+{NUMBER} ms =\s+{NUMBER}x, every row\s+{NUMBER} ms =\s+{NUMBER}x"),
}


def read_overhead(stdout: str, _: Path) -> dict:
    """The figures of overhead.py's items 2, 3, 4 and 6 in ``stdout``: whatever lines it printed."""
    out: dict = {}
    for line in stdout.splitlines():
        for kind, pattern in OVERHEAD_LINES.items():
            m = pattern.search(line)
            if m is None:
                continue
            g = m.groups()
            if kind == "model":
                out["model"] = {"layers": int(g[0]), "heads": int(g[1]), "d_model": int(g[2])}
                out["batch"] = [int(g[3]), int(g[4])]
                if g[5]:
                    out["calibration"] = g[5]
            elif kind == "window":
                out.setdefault("windows", {})[g[0]] = {"steps": int(g[1]), "ratio": float(g[2]), "min": float(g[3]),
                                                       "max": float(g[4]), "accounted_pct": float(g[5])}
            elif kind == "step":
                out["step_ms"] = float(g[0])
            elif kind == "non_sampled":
                out.setdefault("non_sampled_us", {})[f"{g[0]} a loss"] = float(g[1])
            elif kind == "family":
                out.setdefault("families_pct", {})[g[0]] = {"cold": float(g[1]), "warm": float(g[2]),
                                                            "min": float(g[3]), "max": float(g[4])}
            else:
                out.setdefault("tokens", {})[g[0]] = {"forward_backward_ms": float(g[1]), "default_ms": float(g[2]),
                                                      "default_x": float(g[3]), "every_row_ms": float(g[4]),
                                                      "every_row_x": float(g[5])}
            break
    return out


def read_junit(_: str, scratch: Path) -> dict:
    """Each test's outcome from pytest's JUnit XML: passed, failed, error or skipped, with the message."""
    tests = {}
    for case in ET.parse(scratch / "cuda_tests.xml").getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome, message = ("failed" if kind == "failure" else kind), found.get("message", "")
                break
        tests[f"{case.get('classname')}::{case.get('name')}"] = {"outcome": outcome, "message": message[:500]}
    counts = {o: sum(t["outcome"] == o for t in tests.values()) for o in ("passed", "failed", "error", "skipped")}
    return {"tests": tests, **counts}


def read_device(stdout: str, _: Path) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# ---- the parts -------------------------------------------------------------------------------------------------


# A test marked cuda: a decorator line, or a module's pytestmark.
CUDA_MARK = re.compile(r"^\s*(?:@pytest\.mark\.cuda\b|pytestmark\s*=.*\bpytest\.mark\.cuda\b)", re.M)


def cuda_test_files() -> list[str]:
    """The test files that hold ``cuda``-marked tests (found in their text: nothing else is collected)."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
                  if CUDA_MARK.search(p.read_text(encoding="utf-8")))


def parts(sizes: Sizes, scratch: Path) -> list[Part]:
    common = ["--device", sizes.device, "--threads", str(sizes.threads)]
    if sizes.device == "cpu":
        common += ["--clock", "cpu"]
    family = ("model", "step_ms", "windows", "families_pct")
    out = [Part("device", ["benchmarks/gpu_check_env.py", sizes.device], read_device, ("torch",)),
           Part("cuda tests", ["-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                               f"--junitxml={scratch / 'cuda_tests.xml'}", *cuda_test_files()], read_junit, ("tests",))]
    for model in sizes.models:
        out.append(Part(f"overhead {model} batch", [OVERHEAD, *common, "--models", model, "--only", "2", "3", "4",
                                                    "--reps", str(sizes.reps), "--everys", *sizes.everys,
                                                    "--batch", *map(str, sizes.batch)],
                        read_overhead, (*family, "non_sampled_us")))
    out.append(Part("attention", [OVERHEAD, *common, "--only", "6", "--reps", str(sizes.reps), "--lengths",
                                  *map(str, sizes.lengths), "--width", str(sizes.width), "--heads", str(sizes.heads)],
                    read_overhead, ("tokens",)))
    for model in sizes.models:
        out.append(Part(f"overhead {model} long step",
                        [OVERHEAD, *common, "--models", model, "--only", "2", "4", "--reps", str(sizes.long_reps),
                         "--everys", *sizes.everys, "--batch", *map(str, sizes.batch), "--min-step-ms",
                         f"{sizes.min_step_ms:g}", "--max-batch", str(sizes.max_batch)], read_overhead, family))
    for part in out:
        part.limit_s = LIMITS.get(part.name, 120)
    return out


def child_env(dry_run: bool) -> dict[str, str]:
    """The checkout first on the import path (no installation needed), unbuffered output (a part cut off keeps what
    it printed), and the Hugging Face libraries told to stay offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Interrupted(Exception):
    """The run was asked to stop (SIGTERM): the part running is recorded as such and the report written."""


def run_part(part: Part, limit: float, scratch: Path, env: dict[str, str]) -> dict:
    out_path, err_path = scratch / "stdout.txt", scratch / "stderr.txt"
    t0, rc, status = time.monotonic(), None, "timed out"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-u", *part.argv], cwd=ROOT, env=env, stdout=out, stderr=err)
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            pass
        except Interrupted:
            status = "interrupted"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    record = {"status": status, "seconds": round(time.monotonic() - t0, 1), "limit_s": round(limit, 1), "rc": rc,
              "command": ["python3", *part.argv], "results": {}, "stdout": stdout[-20000:],
              "stderr_tail": stderr[-4000:]}
    try:
        record["results"] = part.read(stdout, scratch)
    except Exception as exc:  # noqa: BLE001 - a part whose output cannot be read is recorded, never fatal
        record["error"] = f"its output could not be read: {type(exc).__name__}: {exc}"
    missing = [k for k in part.expect if k not in record["results"]]
    if status == "ok" and missing:
        record["status"], record["error"] = "failed", f"no {', '.join(missing)} in its output"
    return record


# ---- the report --------------------------------------------------------------------------------------------------


def write(report: dict, out: Path) -> None:
    """The JSON and the markdown, each replaced whole (a reader never sees half a file)."""
    for name, text in (("gpu_check.json", json.dumps(report, indent=1)), ("gpu_check.md", markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, out / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU with tiny sizes (also: --device cpu)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all parts together")
    parser.add_argument("--limit", action="append", type=limit, default=[], metavar="PART=SECONDS",
                        help="a part's own time limit, e.g. --limit attention=60 (repeatable)")
    parser.add_argument("--parts", nargs="+", metavar="PART", help="run only these parts (names as in the report)")
    parser.add_argument("--commit", help="the commit checked out, where this copy has neither git nor .git")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out is required: the folder the JSON and the markdown table are written to")
    dry = args.dry_run or args.device == "cpu"
    return check(args, GPU if not dry else DRY, dry)


def limit(text: str) -> tuple[str, float]:
    name, sep, seconds = text.rpartition("=")
    try:
        return name, float(seconds if sep and name else "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PART=SECONDS, e.g. attention=60") from None


def chosen(args: argparse.Namespace, sizes: Sizes, scratch: Path) -> list[Part]:
    """The parts to run (``--parts``, else all), each with its limit (``--limit``, else its own)."""
    every = parts(sizes, scratch)
    limits = dict(args.limit)
    unknown = (set(args.parts or []) | set(limits)) - {p.name for p in every}
    if unknown:
        raise SystemExit(f"gpu_check.py: no part named {', '.join(sorted(unknown))}; the parts: "
                         f"{', '.join(p.name for p in every)}")
    for part in every:
        part.limit_s = limits.get(part.name, part.limit_s)
    return [p for p in every if not args.parts or p.name in args.parts]


def stop(signum, frame):
    raise Interrupted


def check(args: argparse.Namespace, sizes: Sizes, dry: bool) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as folder:
        todo = chosen(args, sizes, Path(folder))
        report = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "finished": None,
                  "dry_run": dry, "device": sizes.device,
                  "command": ["python3", "benchmarks/gpu_check.py", *sys.argv[1:]], "commit": commit(args.commit),
                  "budget_s": args.budget, "sizes": asdict(sizes),
                  "parts": {p.name: {"status": "waiting"} for p in todo}}
        signal.signal(signal.SIGTERM, stop)
        start = time.monotonic()
        try:
            run_all(todo, report, args, Path(folder), child_env(dry))
        except Interrupted:
            pass
        finally:
            report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            report["seconds"] = round(time.monotonic() - start, 1)
            write(report, args.out)
    return 0 if all(p.get("status") == "ok" for p in report["parts"].values()) else 1


def run_all(todo: list[Part], report: dict, args: argparse.Namespace, scratch: Path, env: dict[str, str]) -> None:
    """Each part in turn within the budget, the report written before and after each; after a device part that
    finds no CUDA device where one was asked for, none of the others."""
    start, done = time.monotonic(), report["parts"]
    for i, part in enumerate(todo):
        left = args.budget - (time.monotonic() - start)
        if left < 10:
            done[part.name] = {"status": "not run", "error": f"the budget of {args.budget:g} s was spent"}
            continue
        done[part.name] = {"status": "running", "limit_s": round(min(part.limit_s, left), 1)}
        write(report, args.out)
        done[part.name] = run_part(part, min(part.limit_s, left), scratch, env)
        write(report, args.out)
        if done[part.name]["status"] == "interrupted":
            return
        if part.name == "device" and report["device"] == "cuda" and not done["device"]["results"].get("cuda_available"):
            report["error"] = "no CUDA device here: run with --dry-run for the CPU"
            for rest in todo[i + 1:]:
                done[rest.name] = {"status": "not run", "error": "no CUDA device"}
            return


if __name__ == "__main__":
    sys.exit(main())
