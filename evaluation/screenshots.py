"""Screenshots of what a user sees, taken in a real browser: TensorBoard on a run, and the HTML reports.

    python -m diag demo --logdir runs/demo && python -m diag report runs/demo
    python -m evaluation.screenshots runs/demo --report runs/demo/report.html --out docs/img
    python -m evaluation.screenshots runs/demo --report runs/demo/report.html --reports-only --out shots

Starts a real TensorBoard server (``python -m tensorboard.main``, bound to 127.0.0.1 only) on the
folder above the run (not with ``--reports-only``), opens its dashboards in headless Chromium from the system packages
(``apt-get install chromium``), driven by Playwright (``pip install playwright``; no browser
download: ``executable_path=/usr/bin/chromium``, software WebGL so the Time Series charts draw),
and saves one PNG per view. It also reads from the pages what a user would check (the run names a
chart's legend lists, the colours of its lines, the images' sizes, where a report's figures stand on the page)
and prints it as JSON; the browser tests (tests/integration/test_browser.py) assert on the same facts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = os.environ.get("ATTNSCOPE_CHROMIUM", "/usr/bin/chromium")
# software WebGL (SwiftShader): without it headless Chromium draws TensorBoard's Time Series axes but no lines
CHROMIUM_ARGS = ["--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader", "--ignore-gpu-blocklist"]
VIEWPORT = {"width": 1280, "height": 900}
REPORT_VIEWPORT = {"width": 1400, "height": 1000}  # a laptop's browser window: two figures side by side
REPORT_SHOT_HEIGHT = 1600  # the top of a report: its summary and first figures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tensorboard(logdir: Path, timeout: float = 180.0) -> Iterator[str]:
    """A TensorBoard server on ``logdir`` (read once, before it serves); yields its base URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port",
           str(port), "--load_fast=false", "--reload_interval=0", "--reload_task=blocking"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield _wait(f"http://127.0.0.1:{port}", proc, log, timeout)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait(base: str, proc: subprocess.Popen, log, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"tensorboard exited with {proc.returncode}: {log.read()[-2000:].decode()}")
        try:
            urllib.request.urlopen(base + "/data/runs", timeout=10).read()
            return base
        except OSError as err:
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensorboard did not answer in {timeout:.0f} s") from err
            time.sleep(0.3)


@contextlib.contextmanager
def browser() -> Iterator[object]:
    """A Playwright page in the system's headless Chromium."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or set ATTNSCOPE_CHROMIUM)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b.new_page(viewport=VIEWPORT)
        finally:
            b.close()


def custom_scalars(page, base: str, out: Path, runs: list[str]) -> dict:
    """The Custom Scalars dashboard: each chart's lines' colours, and which runs its runs list (the legend of
    the colours) names."""
    page.goto(base + "/#custom_scalars")
    page.wait_for_selector("tf-custom-scalar-multi-line-chart-card", timeout=90_000)
    page.wait_for_timeout(6000)
    page.screenshot(path=str(out / "tb_custom_scalars.png"))
    charts = []
    cards = page.locator("tf-custom-scalar-multi-line-chart-card")
    for i in range(cards.count()):
        card = cards.nth(i)
        strokes = card.locator("path.line").evaluate_all("ps => ps.map(p => getComputedStyle(p).stroke)")
        title = card.locator("#chart-title, .title, h3").first
        charts.append({"title": title.inner_text().strip() if title.count() else "",
                       "colours": sorted(set(strokes))})
    legend = [run for run in runs if page.get_by_text(run, exact=True).count()]  # pierces the shadow DOM
    return {"charts": charts, "legend": legend}


def time_series(page, base: str, out: Path, tag: str) -> dict:
    """The Time Series card of ``tag``: the runs its legend table names, and whether its canvas drew lines."""
    page.goto(base + "/#timeseries")
    page.wait_for_selector("input[placeholder*='Filter tags']", timeout=90_000)
    page.locator("input[placeholder*='Filter tags']").fill(f"^{tag}$")
    page.wait_for_selector("scalar-card", timeout=60_000)
    page.wait_for_timeout(6000)
    page.keyboard.press("Escape")
    card = page.locator("scalar-card").first
    card.screenshot(path=str(out / "tb_time_series_card.png"))
    page.screenshot(path=str(out / "tb_time_series.png"))
    legend = [r for r in card.locator("table, .data-table, tb-data-table").first.inner_text().splitlines()
              if r.strip()] if card.locator("table, .data-table, tb-data-table").count() else []
    return {"title": card.locator(".heading, .tag, span").first.inner_text().strip(), "legend": legend}


def images(page, base: str, out: Path) -> dict:
    """The Images dashboard: every image shown, with its natural size."""
    page.goto(base + "/#images")
    page.wait_for_selector("img", timeout=90_000)
    # the figures, not the attention maps (this dashboard's filter is a labelled input, no placeholder)
    page.get_by_label(re.compile("Filter tags")).first.fill("^(heatmap|step_size)/")
    page.wait_for_timeout(5000)
    page.screenshot(path=str(out / "tb_images.png"), full_page=False)
    sizes = page.locator("img").evaluate_all(
        "xs => xs.filter(x => x.complete).map(x => [x.naturalWidth, x.naturalHeight, x.src])")
    shown = [s for s in sizes if "individualImage" in s[2]]
    drawn = page.locator("img[src*='individualImage']")
    for i in range(min(drawn.count(), 4)):  # each image as the browser drew it
        drawn.nth(i).scroll_into_view_if_needed()
        drawn.nth(i).screenshot(path=str(out / f"tb_image_{i}.png"))
    return {"images": shown}


def report(page, path: Path, out: Path, name: str) -> dict:
    """An HTML report at :data:`REPORT_VIEWPORT`: its headings, its figures (decoded by the browser, with where
    each grid's figures stand on the page) and its alert rows. The PNG is the page's top, up to
    :data:`REPORT_SHOT_HEIGHT` pixels."""
    page.set_viewport_size(REPORT_VIEWPORT)
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    height = min(page.evaluate("document.documentElement.scrollHeight"), REPORT_SHOT_HEIGHT)
    page.screenshot(path=str(out / f"{name}.png"), full_page=True,
                    clip={"x": 0, "y": 0, "width": REPORT_VIEWPORT["width"], "height": height})
    figures = page.locator("img").evaluate_all("xs => xs.map(x => [x.naturalWidth, x.naturalHeight, x.alt])")
    grids = page.locator(".grid").evaluate_all(
        "gs => gs.map(g => Array.from(g.querySelectorAll('img')).map(x => {const r = x.getBoundingClientRect();"
        " return [r.left, r.top, r.width, r.height]}))")
    page.set_viewport_size(VIEWPORT)
    return {"headings": page.locator("h1, h2").all_inner_texts(), "figures": figures, "grids": grids,
            "page_width": REPORT_VIEWPORT["width"], "rows": page.locator("tr").count(),
            "text": page.locator("body").inner_text()}


def shoot(run: Path, out: Path, reports: list[Path], tag: str = "by_layer/qk_sigma1/max",
          dashboards: bool = True) -> dict:
    """Every view above, for the run folder ``run`` (``dashboards=False``: the reports only, no TensorBoard);
    returns the facts read from the pages."""
    out.mkdir(parents=True, exist_ok=True)
    facts: dict = {}
    with browser() as page:
        if dashboards:
            with tensorboard(run.resolve().parent) as base:
                facts["runs"] = json.loads(urllib.request.urlopen(base + "/data/runs").read())
                facts["custom_scalars"] = custom_scalars(page, base, out, facts["runs"])
                facts["time_series"] = time_series(page, base, out, tag)
                facts["images"] = images(page, base, out)
        for path in reports:
            name = {"report.html": "run", "index.html": "checkpoints"}.get(path.name, path.stem)
            facts[name] = report(page, path, out, f"report_{name}")
    return facts


def shrink(folder: Path, colours: int = 128) -> None:
    """Palette PNGs (a few tens of kB each), for the docs."""
    from PIL import Image

    for path in folder.glob("*.png"):
        Image.open(path).convert("RGB").quantize(colours).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder written by the Monitor (e.g. runs/demo)")
    parser.add_argument("--report", type=Path, action="append", default=[], help="an HTML report to open too")
    parser.add_argument("--out", type=Path, default=Path("screenshots"), help="folder for the PNGs")
    parser.add_argument("--reports-only", action="store_true", help="only the HTML reports, no TensorBoard")
    args = parser.parse_args()
    facts = shoot(args.run, args.out, args.report, dashboards=not args.reports_only)
    shrink(args.out)
    for value in facts.values():
        if isinstance(value, dict):
            value.pop("text", None)
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
