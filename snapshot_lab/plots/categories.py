"""Memory by category over the trace, stacked."""

from __future__ import annotations

from matplotlib.figure import Figure

from .common import bytes_axis, new_figure, styled
from .palette import CATEGORY_COLORS
from .views import CategoryView


@styled
def plot_category_timeline(view: CategoryView) -> Figure:
    fig = new_figure(10.5, 3.2)
    ax = fig.add_subplot()
    if view.categories:
        ax.stackplot(
            view.x,
            view.highs,
            labels=view.categories,
            colors=[CATEGORY_COLORS[c] for c in view.categories],
            alpha=0.85,
            lw=0,
            step="post",
        )
    else:  # a trace of frees only (what it frees was allocated before recording began)
        ax.text(0.5, 0.5, "nothing allocated inside the trace", transform=ax.transAxes, ha="center", color="#777")
    bytes_axis(ax.yaxis)
    ax.set_xlabel(view.x_label)
    ax.set_ylabel("requested bytes")
    ax.set_xlim(*view.x_limits)
    ax.set_title("Memory requested by category (from allocation stacks)", loc="left")
    if view.categories:
        ax.legend(loc="upper left", ncols=len(view.categories))
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig
