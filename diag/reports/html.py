"""What both HTML reports share: the page, tables, figures as PNG (files or inline) in a grid, line charts.

The live-run report (:mod:`diag.reports.run`) and the checkpoint report
(:mod:`diag.reports.checkpoints`) are built from these, so they look and read alike. Figures use
:func:`diag.outputs.figures.figure` (matplotlib, Agg canvas), are saved at :data:`DPI` and shown in a
:func:`grid` of small multiples as wide as the page (each figure fills its cell); step axes get integer ticks.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["STYLE", "DPI", "LEVEL_COLOURS", "page", "table", "grid", "png_bytes", "save_png", "inline_img",
           "file_img", "integer_steps", "docs_link"]

# The page uses the window's width; a grid's figures fill it, two or more side by side where each keeps at least
# 520 px (one per row on a narrow window).
STYLE = ("body{font-family:sans-serif;margin:0 auto;padding:0 1.5em;color:#222}"
         "table{border-collapse:collapse}td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;"
         "vertical-align:top}th{background:#f4f4f4}img{max-width:100%}figure{margin:1em 0}"
         ".grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,520px),1fr));gap:0.5em 1.5em}"
         ".grid figure{margin:0.5em 0}.grid img{width:100%;height:auto}"
         ".wide{grid-column:1/-1}"
         "figcaption{color:#555;font-size:90%}.critical{color:#b00020;font-weight:bold}.warning{color:#a05a00}"
         ".info{color:#2a5db0}")
DPI = 110  # the figures' pixels per inch in the reports: sharp at a grid cell's width on a wide window
# alert level -> colour of its markers and of its table cell
LEVEL_COLOURS = {"critical": "#b00020", "warning": "#e08000", "info": "#2a5db0"}


def page(title: str, body: Iterable[str]) -> str:
    """A whole HTML document: no script, no external resource."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>\n" + "\n".join(body)
            + "\n</body></html>\n")


def table(header: Sequence[str], rows: Iterable[Sequence[object]], raw: Sequence[int] = (),
          classes: Sequence[str | None] | None = None) -> str:
    """An HTML table; the columns in ``raw`` hold HTML already, the others are escaped. ``classes``:
    a CSS class per row (or None)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = classes[i] if classes is not None else None
        cells = "".join(f"<td>{c if j in raw else html.escape(str(c))}</td>" for j, c in enumerate(row))
        body.append(f"<tr{f' class={cls!r}' if cls else ''}>{cells}</tr>")
    return f"<table><tr>{head}</tr>\n" + "\n".join(body) + "</table>"


def grid(figures: Iterable[str]) -> str:
    """The figures (from :func:`inline_img` or :func:`file_img`) as a grid of small multiples at the page's
    width; nothing when there is none."""
    shown = [f for f in figures if f]
    return "<div class='grid'>\n" + "\n".join(shown) + "\n</div>" if shown else ""


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def save_png(fig, path: Path) -> None:
    path.write_bytes(png_bytes(fig))


def _figure(src: str, caption: str, wide: bool) -> str:
    alt, cls = html.escape(caption, quote=True), " class='wide'" if wide else ""
    return (f"<figure{cls}><img src='{src}' alt='{alt}'>"
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def inline_img(fig, caption: str, wide: bool = False) -> str:
    """A figure embedded in the page (base64 PNG), with its caption; ``wide``: across the whole grid."""
    return _figure("data:image/png;base64," + base64.b64encode(png_bytes(fig)).decode("ascii"), caption, wide)


def file_img(name: str, caption: str, wide: bool = False) -> str:
    """A figure saved beside the page as ``name``, with its caption."""
    return _figure(html.escape(name, quote=True), caption, wide)


def integer_steps(ax) -> None:
    """Whole-number ticks on the step (x) axis."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def docs_link(page_name: str, anchor: str, text: str) -> str:
    """A link to a page of the docs: the repository's ``docs/<page_name>`` when this is a checkout,
    else the page's name only (the docs are not installed with the package)."""
    local = Path(__file__).resolve().parents[2] / "docs" / page_name
    label = html.escape(text)
    if local.is_file():
        return f"<a href='{local.as_uri()}#{html.escape(anchor)}'>{label}</a>"
    return f"{label} (docs/{html.escape(page_name)})"
