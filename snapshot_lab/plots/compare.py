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
    top = float(max(rows["reserved"].max(), 1))
    ax.set_ylim(0, top * 1.3)  # headroom for the legend
    ax.set_title("Memory per device at the dump", loc="left")
    ax.legend(loc="upper right", ncols=3)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig


@styled
def plot_ranks(rows: pd.DataFrame) -> Figure:
    """``rows``: columns rank (the row's label: a number, host/rank or a file name), peak (bytes
    or NaN), reserved, outlier (bool)."""
    n = len(rows)
    fig = new_figure(10.5, 2.8 if n <= 64 else 3.4)
    ax = fig.add_subplot()
    x = np.arange(n)
    color = np.where(rows["outlier"].to_numpy(dtype=bool), COLORS["oom"], COLORS["active_allocated"])
    ax.bar(x, rows["reserved"], 0.8, color=COLORS["reserved"], label="reserved at the dump")
    peak = rows["peak"].astype(float).fillna(0).to_numpy()
    ax.bar(x, peak, 0.45, color=color, label="peak in use (trace); red: flagged rank")
    ax.axhline(float(np.median(peak)) if peak.any() else 0, color="#555555", lw=0.8, ls="--", label="median peak")
    step = max(1, n // 32)
    ticks = [str(r) for r in rows["rank"].to_numpy()[::step]]
    long = any(len(t) > 4 for t in ticks)  # host/rank or file names: slanted so they do not overlap
    ax.set_xticks(
        x[::step], ticks, rotation=30 if long else 0, ha="right" if long else "center", fontsize=7 if long else None
    )
    ax.set_xlabel("rank")
    bytes_axis(ax.yaxis)
    ax.set_ylabel("GPU memory")
    top = float(max(rows["reserved"].max(), peak.max() if peak.size else 0, 1))
    ax.set_ylim(0, top * 1.3)  # headroom for the legend
    ax.set_title(f"Memory per rank ({n} ranks)", loc="left")
    ax.legend(loc="upper right", ncols=3)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig
