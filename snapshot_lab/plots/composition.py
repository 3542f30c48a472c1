"""The first screen's chart: one horizontal bar, the peak split by category."""

from __future__ import annotations

from matplotlib.figure import Figure

from ..metrics.attribution.composition import Composition
from ..units import format_bytes
from .common import new_figure, styled
from .palette import CATEGORY_COLORS

MIN_LABELLED_SHARE = 0.07  # a segment narrower than this carries no text inside the bar


@styled
def plot_composition(comp: Composition, width: float = 5.6) -> Figure:
    """The categories of ``comp`` side by side in one bar, labelled with their share."""
    fig = new_figure(width, 0.95)
    ax = fig.add_subplot()
    left = 0.0
    for part in comp.by_category:
        ax.barh(0, part.share, left=left, height=0.6, color=CATEGORY_COLORS.get(part.label, "#bab0ac"), lw=0)
        if part.share >= MIN_LABELLED_SHARE:
            ax.text(left + part.share / 2, 0, f"{part.share:.0%}", ha="center", va="center", color="white")
        left += part.share
    handles = [
        ax.barh(0, 0, color=CATEGORY_COLORS.get(p.label, "#bab0ac"), label=f"{p.label} {format_bytes(p.bytes)}")
        for p in comp.by_category
    ]
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.4, 0.4)
    ax.axis("off")
    if handles:
        fig.legend(handles=handles, loc="outside lower left", ncols=min(len(handles), 3), handlelength=1, fontsize=8.5)
    return fig
