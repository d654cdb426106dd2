"""What both HTML reports share: the page, tables, figures as PNG (files or inline), line charts.

The live-run report (:mod:`diag.reports.run`) and the checkpoint report
(:mod:`diag.reports.checkpoints`) are built from these, so they look and read alike. Figures use
:func:`diag.outputs.figures.figure` (matplotlib, Agg canvas); step axes get integer ticks.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["STYLE", "LEVEL_COLOURS", "page", "table", "png_bytes", "inline_img", "integer_steps", "docs_link"]

STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:auto;padding:0 1em;color:#222}"
         "table{border-collapse:collapse}td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;"
         "vertical-align:top}th{background:#f4f4f4}img{max-width:100%}figure{margin:1em 0}"
         "figcaption{color:#555;font-size:90%}.critical{color:#b00020;font-weight:bold}.warning{color:#a05a00}"
         ".info{color:#2a5db0}")
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


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def inline_img(fig, caption: str) -> str:
    """A figure embedded in the page (base64 PNG), with its caption."""
    data = base64.b64encode(png_bytes(fig)).decode("ascii")
    alt = html.escape(caption, quote=True)
    return (f"<figure><img src='data:image/png;base64,{data}' alt='{alt}'>"
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


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
