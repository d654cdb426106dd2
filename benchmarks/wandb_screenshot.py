"""A screenshot of W&B's own terminal viewer (LEET) on the offline W&B run of the demo, taken in a real browser.

    python benchmarks/wandb_screenshot.py --out docs/figures/wandb_leet.png

Steps, all in a temporary folder (nothing is left in the repository but the PNG):

1. ``python -m diag demo --wandb`` (short: ``--steps 60 --every 5`` by default) writes the demo's training,
   with a ``WandbSink``, into an offline W&B run; ``--run DIR`` takes an existing run folder instead
   (``LOGDIR/wandb/latest-run``), copied first, since LEET writes its state beside the runs it shows.
2. ``python -m wandb leet run <run>`` (W&B LEET, the terminal UI that ships with ``wandb``) runs inside a
   pseudo-terminal of fixed size (200x56, ``TERM=xterm-256color``); its configuration is a file in the
   temporary folder (``WANDB_CONFIG_DIR``), so the user's own LEET settings are neither read nor changed:
   a 3x3 metrics grid, no system-metrics sidebar, one colour per chart. The script then types what a user
   would: a metrics filter (``--filter``, a regex: the loss, ``qk_sigma1`` and the attention entropy per
   layer), an overview filter (the command line, the loss, the alerts, ``collapse_risk``), and drags the
   sidebar's border with the mouse to give the charts the width.
3. ``pyte`` (a terminal emulator library) replays the bytes LEET wrote into a screen of the same size; the
   screen becomes an HTML page, one ``<span>`` per run of cells of equal style, colours from the xterm
   256-colour palette (LEET writes 24-bit colours, kept as they are), DejaVu Sans Mono for the box-drawing
   and Braille characters LEET draws its charts with.
4. Headless Chromium (the system's ``/usr/bin/chromium``, or ``ATTNSCOPE_CHROMIUM``), driven by
   ``playwright`` (which never downloads a browser here: ``executable_path``), renders the page and writes
   the PNG.

What it needs beyond the project: ``pip install -e '.[wandb]'``, ``pip install pyte playwright`` and
``apt-get install chromium`` (pyte and playwright are tools of this script, not dependencies of attnscope).
It takes 30 s on two idle CPU cores (the demo's training 16 s, LEET 12 s, the browser 2 s); the training takes
longer on busy cores (90 s when the two are shared with other jobs).
"""

from __future__ import annotations

import argparse
import fcntl
import html
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("ATTNSCOPE_CHROMIUM", "/usr/bin/chromium")
COLS, ROWS = 200, 56
# the Monitor's headline signals: the loss, sigma_1 of W_Q W_K^T and the lowest attention entropy, per layer
METRICS = r"attnscope/loss|qk_sigma1/L\d+/max$|attn_entropy/L\d+/min$"
OVERVIEW = r"args|^attnscope/(loss|step|alerts_fired|last_alert)$|^collapse_risk/"
SIDEBAR = 52  # the column (1-based) the sidebar's border is dragged to: LEET gives the sidebar over a third
FG, BG = "#d0d0d0", "#1c1c1c"  # the terminal's default colours (LEET asks for the background: OSC 11)
LEET_CONFIG = {  # W&B LEET's own configuration keys (python -m wandb leet config lists them)
    "metrics_grid": {"rows": 3, "cols": 3},
    "right_sidebar_visible": False,
    "left_sidebar_visible": True,
    "single_run_color_mode": "per_plot",
    "chart_guides": "off",
}
ANSI = ["black", "red", "green", "brown", "blue", "magenta", "cyan", "white"]  # pyte's names of colours 0-7


def run_demo(workdir: Path, steps: int, every: int) -> Path:
    """Train the demo with ``--wandb`` into ``workdir/demo``; the W&B run folder it wrote."""
    logdir = workdir / "demo"
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "diag", "demo", "--wandb", "--quiet", "--steps", str(steps),
                    "--every", str(every), "--logdir", str(logdir)], cwd=workdir, env=env, check=True)
    return (logdir / "wandb" / "latest-run").resolve()


def _read(fd: int, out: bytearray, quiet: float, limit: float) -> None:
    """Read what the terminal's program writes until it has written nothing for ``quiet`` seconds (or
    ``limit`` seconds have passed), answering its background-colour query as a terminal would."""
    start = last = time.monotonic()
    while time.monotonic() - start < limit and time.monotonic() - last < quiet:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if not ready:
            continue
        try:
            data = os.read(fd, 1 << 16)
        except OSError:  # the program exited
            return
        if not data:
            return
        out.extend(data)
        last = time.monotonic()
        if b"\x1b]11;?" in data:
            rgb = "/".join(BG[i:i + 2] * 2 for i in (1, 3, 5))
            os.write(fd, f"\x1b]11;rgb:{rgb}\x1b\\".encode())


def _border(raw: bytes) -> int | None:
    """The column (1-based) of the left sidebar's border on the screen ``raw`` draws: the first column whose
    cells in rows 5-40 are all a vertical line."""
    import pyte

    screen = pyte.Screen(COLS, ROWS)
    pyte.ByteStream(screen).feed(raw)
    for x in range(COLS):
        if all(screen.buffer[y][x].data == "\u2502" for y in range(5, 40)):
            return x + 1
    return None


def capture_leet(run_dir: Path, workdir: Path, metrics: str) -> bytes:
    """What ``python -m wandb leet run <run_dir>`` writes to a COLSxROWS terminal, filters typed and the
    sidebar resized: the bytes up to the screen to show, before LEET is told to quit."""
    config = workdir / "wandb-config"
    config.mkdir(exist_ok=True)
    (config / "wandb-leet.json").write_text(json.dumps(LEET_CONFIG, indent=2))
    env = dict(os.environ, TERM="xterm-256color", COLORTERM="truecolor", COLUMNS=str(COLS), LINES=str(ROWS),
               WANDB_CONFIG_DIR=str(config), WANDB_MODE="offline", WANDB_SILENT="true")
    pid, fd = pty.fork()
    if pid == 0:  # the child: its terminal is the pseudo-terminal's other end, sized before LEET starts
        try:
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
            os.chdir(workdir)
            os.execve(sys.executable, [sys.executable, "-m", "wandb", "leet", "run", str(run_dir)], env)
        finally:
            os._exit(127)
    out = bytearray()
    try:
        _read(fd, out, quiet=3.0, limit=60.0)  # LEET reads the whole run before it draws the charts
        for keys in ("/", metrics, "\r", "o", OVERVIEW, "\r"):
            os.write(fd, keys.encode())
            _read(fd, out, quiet=0.4, limit=5.0)
        border = _border(bytes(out))
        if border is not None and border > SIDEBAR:  # press on the border, move, release (SGR mouse reports)
            moves = [*range(border - 4, SIDEBAR, -4), SIDEBAR]
            for keys in (f"\x1b[<0;{border};20M", *(f"\x1b[<32;{c};20M" for c in moves), f"\x1b[<0;{SIDEBAR};20m"):
                os.write(fd, keys.encode())
                _read(fd, out, quiet=0.3, limit=5.0)
        _read(fd, out, quiet=2.0, limit=15.0)
        shown = bytes(out)
        os.write(fd, b"q")
        _read(fd, out, quiet=3.0, limit=5.0)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                break
            os.kill(pid, sig)
            time.sleep(0.5)
        else:
            os.waitpid(pid, 0)
        os.close(fd)
    return shown


def _colour(name: str, default: str) -> str:
    """A CSS colour from pyte's name for it: ``default``, one of the 16 ANSI names, or 6 hex digits."""
    from pyte.graphics import FG_BG_256  # the xterm 256-colour palette, 6 hex digits each

    if name == "default":
        return default
    bright = name.startswith("bright")
    base = name.removeprefix("bright")
    if base in ANSI:
        return "#" + FG_BG_256[ANSI.index(base) + 8 * bright]
    return "#" + name if re.fullmatch(r"[0-9a-fA-F]{6}", name) else default


def _monospace(char: str) -> bool:
    """Whether DejaVu Sans Mono draws ``char`` in one cell: ASCII, box drawing and block elements. Others (the
    Braille patterns of LEET's charts, bullets, arrows) come from a proportional fallback font."""
    return " " <= char <= "~" or "\u2500" <= char <= "\u259f"


def screen_html(screen, title: str = "W&B LEET") -> str:
    """A pyte screen as an HTML page: a line per row, a ``<span>`` per run of cells of equal style; a character
    the monospace font lacks sits in a box one cell wide (two for a wide character), so the columns stay put."""
    rows = []
    for y in range(screen.lines):
        line = screen.buffer[y]
        spans: list[tuple[tuple, list[str]]] = []
        for x in range(screen.columns):
            char = line[x]
            if char.data == "":  # the second cell of a wide character
                continue
            fg, bg = _colour(char.fg, FG), _colour(char.bg, BG)
            if char.reverse:
                fg, bg = bg, fg
            style = (fg, bg, char.bold, char.italics, char.underscore)
            text = html.escape(char.data)
            if not _monospace(char.data):
                wide = x + 1 < screen.columns and line[x + 1].data == ""
                text = f'<i class="{"w" if wide else "c"}">{text}</i>'
            if spans and spans[-1][0] == style:
                spans[-1][1].append(text)
            else:
                spans.append((style, [text]))
        cells = []
        for (fg, bg, bold, italics, underscore), texts in spans:
            css = f"color:{fg}" + (f";background:{bg}" if bg != BG else "") + (";font-weight:bold" if bold else "")
            css += (";font-style:italic" if italics else "") + (";text-decoration:underline" if underscore else "")
            cells.append(f'<span style="{css}">{"".join(texts)}</span>')
        rows.append("".join(cells))
    body = "\n".join(rows)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title><style>"
            f"body{{margin:0;background:{BG}}}"
            f"#term{{display:inline-block;padding:10px 12px;background:{BG};color:{FG};white-space:pre;"
            "font-family:'DejaVu Sans Mono',monospace;font-size:13px;line-height:16px}"
            "#term i{display:inline-block;width:1ch;text-align:center;font-style:normal}#term i.w{width:2ch}"
            f"</style></head><body><div id=\"term\">{body}</div></body></html>\n")


def screenshot(page_html: Path, png: Path) -> None:
    """Render ``page_html`` in headless Chromium and write the terminal's box to ``png``."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise SystemExit(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or set ATTNSCOPE_CHROMIUM)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1800, "height": 1000})
            page.goto(page_html.as_uri())
            page.evaluate("document.fonts.ready")
            png.parent.mkdir(parents=True, exist_ok=True)
            page.locator("#term").screenshot(path=str(png))
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "wandb_leet.png",
                        help="the PNG to write (default: docs/figures/wandb_leet.png)")
    parser.add_argument("--run", type=Path, default=None,
                        help="an existing W&B run folder (LOGDIR/wandb/latest-run) instead of a fresh demo run")
    parser.add_argument("--steps", type=int, default=60, help="the demo's training steps (default: 60)")
    parser.add_argument("--every", type=int, default=5, help="the demo's sampling period (default: 5)")
    parser.add_argument("--filter", default=METRICS, help=f"LEET's metrics filter, a regex (default: {METRICS})")
    parser.add_argument("--keep", type=Path, default=None,
                        help="also keep the work here: the run, LEET's output bytes, the HTML page")
    args = parser.parse_args()
    import pyte  # checked before the demo trains: pip install pyte

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wandb-leet-") as tmp:
        work = Path(tmp)
        if args.run is None:
            run_dir = run_demo(work, args.steps, args.every)
            print(f"demo run written ({time.monotonic() - start:.0f} s): {run_dir}", flush=True)
        else:
            source = args.run.resolve()
            if not list(source.glob("*.wandb")):
                raise SystemExit(f"{args.run}: no .wandb file (expected a run folder, LOGDIR/wandb/latest-run)")
            run_dir = work / "wandb" / source.name
            shutil.copytree(source, run_dir)
        raw = capture_leet(run_dir, work, args.filter)
        screen = pyte.Screen(COLS, ROWS)
        pyte.ByteStream(screen).feed(raw)
        text = "\n".join(screen.display)
        if "Metrics [" not in text:
            raise SystemExit("LEET did not show its metrics grid:\n" + text)
        page = work / "wandb_leet.html"
        page.write_text(screen_html(screen, f"W&B LEET: {run_dir.name}"), encoding="utf-8")
        (work / "leet.out").write_bytes(raw)
        (work / "screen.txt").write_text(text + "\n", encoding="utf-8")
        screenshot(page, args.out)
        if args.keep is not None:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
    print(f"{args.out} ({args.out.stat().st_size / 1024:.0f} KiB) in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
