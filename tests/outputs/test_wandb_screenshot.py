"""benchmarks/wandb_screenshot.py's terminal-screen-to-HTML step, on a tiny pyte screen (no browser, no LEET).

The screenshot keeps LEET's columns only if every cell is one character wide on the page and the colours are
those the terminal program asked for; both are checked here. pyte is in the test extra.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyte
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shot():
    spec = importlib.util.spec_from_file_location("wandb_screenshot", ROOT / "benchmarks" / "wandb_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _screen(data: str, cols: int = 8, rows: int = 2):
    screen = pyte.Screen(cols, rows)
    pyte.ByteStream(screen).feed(data.encode())
    return screen


def test_runs_of_equal_style_are_one_span_with_the_asked_colours(shot):
    page = shot.screen_html(_screen("\x1b[31mab\x1b[m<c\r\n\x1b[38;2;1;2;3;1mX\x1b[38;5;196mY"))
    assert '<span style="color:#cd0000">ab</span>' in page  # ANSI red, the xterm palette's colour 1
    assert f'<span style="color:{shot.FG}">&lt;c    </span>' in page  # escaped, the default colour
    assert '<span style="color:#010203;font-weight:bold">X</span>' in page  # 24-bit colour as written
    assert '<span style="color:#ff0000;font-weight:bold">Y' in page  # colour 196 of the 256


def test_characters_the_monospace_font_lacks_keep_one_cell(shot):
    # Braille (LEET's chart lines) and a bullet: each in a box one cell wide; box drawing stays plain text
    page = shot.screen_html(_screen("\u2502\u28e4\u2022x"))
    assert '\u2502<i class="c">\u28e4</i><i class="c">\u2022</i>x' in page
    wide = shot.screen_html(_screen("\u4e2dz"))  # a wide character: one box two cells wide, z right after it
    assert '<i class="w">\u4e2d</i>z' in wide


def test_reverse_video_swaps_the_colours(shot):
    page = shot.screen_html(_screen("\x1b[7mR"))
    assert f'<span style="color:{shot.BG};background:{shot.FG}">R</span>' in page
