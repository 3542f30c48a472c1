"""Figure style and deterministic embedding (same input, same bytes)."""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Callable
from typing import Any, TypeVar

import matplotlib
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, Locator, MaxNLocator

from ..units import format_bytes

COLORS = {
    "active_allocated": "#3b6fb6",
    "active_pending_free": "#f28e2b",
    "inactive": "#d9d9d9",
    "requested": "#3b6fb6",
    "reserved": "#9aa9bd",
    "peak": "#c23b22",
    "oom": "#c23b22",
    "marker": "#8c8c8c",
    "private": "#8e44ad",
    "expandable": "#16a085",
}

STYLE: dict[str, Any] = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.labelsize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "svg.hashsalt": "snaplab",
    "svg.fonttype": "none",
}


F = TypeVar("F", bound=Callable[..., Any])


def styled(fn: F) -> F:
    """Run a plot or export function under snaplab's style without touching global rcParams."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with matplotlib.rc_context(STYLE):  # type: ignore[arg-type]
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


class BinaryLocator(Locator):
    """Ticks at round numbers of KiB/MiB/GiB (1, 2, 2.5, 5, 10 steps of the unit that fits)."""

    def __init__(self, nbins: int = 6) -> None:
        self._inner = MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10])

    def __call__(self) -> list[float]:  # type: ignore[override]
        lo, hi = self.axis.get_view_interval()  # type: ignore[union-attr]
        return self.tick_values(lo, hi)

    def tick_values(self, vmin: float, vmax: float) -> list[float]:  # type: ignore[override]
        unit = 1.0
        while max(abs(vmin), abs(vmax)) / unit >= 1024:
            unit *= 1024
        return [v * unit for v in self._inner.tick_values(vmin / unit, vmax / unit)]


def literal(text: str, limit: int = 60) -> str:
    """Text from a snapshot, made safe for matplotlib: no mathtext, bounded length."""
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("$", r"\$")


def _tick_label(v: float) -> str:
    text = format_bytes(v, 2)
    num, _, unit = text.partition(" ")
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return f"{num} {unit}"


def bytes_axis(axis: object) -> None:
    """Ticks at round binary sizes, labelled in human units."""
    axis.set_major_locator(BinaryLocator())  # type: ignore[attr-defined]
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: _tick_label(v)))  # type: ignore[attr-defined]


@styled
def figure_svg(fig: Figure) -> str:
    """Inline SVG text (no XML prolog, no metadata, fixed ids)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = buf.getvalue()
    start = svg.find("<svg")
    return svg[start:]


@styled
def figure_png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    """PNG bytes (no software tag, so the same figure gives the same bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def figure_png_data_uri(fig: Figure, dpi: int = 110) -> str:
    return "data:image/png;base64," + base64.b64encode(figure_png_bytes(fig, dpi)).decode("ascii")
