"""Devices side by side: reserved, allocated and free-in-reserved bars."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .common import COLORS, bytes_axis, new_figure, styled


@styled
def plot_device_comparison(rows: pd.DataFrame) -> Figure:
    """``rows``: columns device, reserved, allocated, free (bytes)."""
    fig = new_figure(10.5, 2.6)
    ax = fig.add_subplot()
    x = np.arange(len(rows))
    w = 0.26
    ax.bar(x - w, rows["reserved"], w, label="reserved", color=COLORS["reserved"])
    ax.bar(x, rows["allocated"], w, label="allocated", color=COLORS["active_allocated"])
    ax.bar(x + w, rows["free"], w, label="free in reserved", color=COLORS["inactive"], edgecolor="#8c8c8c", lw=0.5)
    ax.set_xticks(x, [f"device {d}" for d in rows["device"]])
    bytes_axis(ax.yaxis)
    ax.set_ylabel("GPU memory")
    ax.set_title("Memory per device at the dump", loc="left")
    ax.legend(loc="upper right", ncols=3)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig
