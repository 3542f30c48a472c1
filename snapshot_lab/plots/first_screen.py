"""The report's first screen as one image (``snaplab report --format png``): drawn by matplotlib,
so no browser is needed to attach the answer to a ticket or a chat."""

from __future__ import annotations

import textwrap

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..metrics.attribution.composition import Composition
from ..units import format_bytes
from .common import literal, new_figure, styled
from .palette import CATEGORY_COLORS

STATUS_COLORS = {"critical": "#c23b22", "warning": "#b7791f", "ok": "#2f855a"}
WIDTH_IN = 12.0
HEIGHT_IN = 5.4
LINE = 0.21 / HEIGHT_IN  # one line of 10-point text, as a fraction of the figure's height
MAX_LEVERS = 3


def _wrap(text: str, width: int, lines: int) -> list[str]:
    out = textwrap.wrap(literal(text, 2000), width) or [""]
    return out[:lines] if len(out) <= lines else [*out[: lines - 1], out[lines - 1][: width - 1] + "…"]


class _Cursor:
    """Writes lines top to bottom in figure coordinates."""

    def __init__(self, fig: Figure, x: float, y: float, line_height: float) -> None:
        self.fig, self.x, self.y, self.lh = fig, x, y, line_height

    def text(self, s: str, size: float = 10, gap: float = 1.0, **kw: object) -> None:
        self.fig.text(self.x, self.y, s, fontsize=size, va="top", ha="left", **kw)  # type: ignore[arg-type]
        self.y -= self.lh * gap * size / 10


def _bar(fig: Figure, comp: Composition, rect: tuple[float, float, float, float]) -> None:
    ax = fig.add_axes(rect)
    left = 0.0
    for p in comp.by_category:
        ax.barh(0, p.share, left=left, height=0.8, color=CATEGORY_COLORS.get(p.label, "#bab0ac"), lw=0)
        if p.share >= 0.08:
            ax.text(left + p.share / 2, 0, f"{p.label} {p.share:.0%}", ha="center", va="center", color="white")
        left += p.share
    ax.set_xlim(0, 1)
    ax.axis("off")


@styled
def plot_first_screen(
    provenance: str,
    status: str,
    verdict: str,
    cause: str,
    made_of: list[tuple[str, str]],
    levers: list[tuple[str, str]],
    comp: Composition | None,
    made_of_title: str = "",
) -> Figure:
    """What happened, what the memory was, what to change: the text of the report's first screen."""
    fig = new_figure(WIDTH_IN, HEIGHT_IN)
    fig.set_layout_engine(None)
    fig.add_artist(Rectangle((0, 0.97), 1, 0.03, transform=fig.transFigure, color=STATUS_COLORS.get(status, "#59636e")))
    left = _Cursor(fig, 0.03, 0.94, LINE * 1.05)
    left.text(literal(provenance, 160), 8.5, color="#59636e", gap=1.3)
    for line in _wrap(verdict, 85, 2):
        left.text(line, 15, weight="bold", color=STATUS_COLORS.get(status, "#1f2328"), gap=0.85)
    for line in _wrap(cause, 120, 3):
        left.text(line, 10.5)
    left.y -= 0.02
    top = left.y
    col = _Cursor(fig, 0.03, top, LINE)
    col.text(("WHAT THE MEMORY WAS: " + made_of_title).upper(), 9, color="#59636e", weight="bold", gap=1.4)
    for key, value in made_of:
        keys, lines = _wrap(key, 20, 3), _wrap(value, 56, 3)
        for i in range(max(len(keys), len(lines))):
            if i < len(keys):
                fig.text(0.03, col.y, keys[i], fontsize=9, va="top", color="#59636e")
            if i < len(lines):
                fig.text(0.16, col.y, lines[i], fontsize=9, va="top")
            col.y -= LINE * 0.95
        col.y -= LINE * 0.3
    if comp is not None and comp.by_category:
        _bar(fig, comp, (0.03, max(col.y - 0.1, 0.08), 0.45, 0.08))
        if comp.total_bytes:
            fig.text(
                0.03,
                max(col.y - 0.11, 0.07),
                f"by category, of {format_bytes(comp.total_bytes)}",
                fontsize=8,
                va="top",
                color="#59636e",
            )
    right = _Cursor(fig, 0.52, top, LINE)
    right.text("WHAT TO CHANGE", 9, color="#59636e", weight="bold", gap=1.4)
    if not levers:
        right.text("Nothing to change: no finding calls for it.", 9.5, color="#59636e")
    for i, (title, detail) in enumerate(levers[:MAX_LEVERS], start=1):
        for j, line in enumerate(_wrap(title, 62, 3)):
            right.text((f"{i}. " if j == 0 else "    ") + line, 9.5, weight="bold", gap=0.95)
        for line in _wrap(detail, 74, 2):
            right.text("    " + line, 8.5, color="#59636e", gap=0.9)
        right.y -= LINE * 0.4
    fig.text(
        0.03,
        0.015,
        "snaplab report --format png · the HTML report has the evidence, timeline and stacks",
        fontsize=7.5,
        color="#8c8c8c",
    )
    return fig
