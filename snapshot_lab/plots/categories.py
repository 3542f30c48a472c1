"""Memory by category over the trace, stacked."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..metrics.history.timeline import envelope
from .common import bytes_axis, new_figure, styled
from .palette import CATEGORY_COLORS


@styled
def plot_category_timeline(levels: pd.DataFrame, x: np.ndarray, x_label: str, max_points: int = 800) -> Figure:
    """``levels``: one column per category (bytes after each event); ``x``: event positions."""
    fig = new_figure(10.5, 3.2)
    ax = fig.add_subplot()
    cols = [c for c in levels.columns if levels[c].max() > 0]
    # downsample each series by its per-bucket maximum, so short spikes stay visible
    series = [envelope(x, levels[c].to_numpy(), max_points) for c in cols]
    if series:
        ax.stackplot(
            series[0].x,
            [s.high for s in series],
            labels=cols,
            colors=[CATEGORY_COLORS[c] for c in cols],
            alpha=0.85,
            lw=0,
            step="post",
        )
    else:  # a trace of frees only (what it frees was allocated before recording began)
        ax.text(0.5, 0.5, "nothing allocated inside the trace", transform=ax.transAxes, ha="center", color="#777")
    bytes_axis(ax.yaxis)
    ax.set_xlabel(x_label)
    ax.set_ylabel("requested bytes")
    ax.set_xlim(float(x[0]), float(x[-1]) if x[-1] > x[0] else float(x[0]) + 1)
    ax.set_title("Memory requested by category (from allocation stacks)", loc="left")
    if cols:
        ax.legend(loc="upper left", ncols=len(cols))
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig
