"""Files side by side: devices' bars, ranks' bars, and two files' timelines overlaid (``diff``)."""

from __future__ import annotations

from typing import Any

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
    ax.bar(x, peak, 0.45, color=color, label="peak requested (trace); red: flagged rank")
    if n > 2:  # the median of two is their mean: the flags compare a pair with each other
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


DIFF_COLORS = ("#8c8c8c", "#c2571a")  # the first file grey, the second orange


@styled
def plot_diff_timelines(before: list[dict[str, Any]], after: list[dict[str, Any]], names: tuple[str, str]) -> Figure:
    """The two files' memory over their traces, overlaid: requested (solid) and reserved
    (dashed) per device, each file on its own axis from 0. ``before``/``after``: the series of
    ``SnapshotSummary.timelines``; x in seconds when both have times, else the event index."""
    fig = new_figure(10.5, 3.0)
    ax = fig.add_subplot()
    timed = all(series["x_label"] == "seconds" for series in [*before, *after])
    several = len({series["device"] for series in [*before, *after]}) > 1
    files = zip(names, (before, after), DIFF_COLORS, (3, 2), strict=True)  # the first file drawn on top
    for name, file_series, color, zorder in files:
        for series in file_series:
            x = np.asarray(series["x"] if timed else series["index"], dtype=float)
            device = series["device"]
            label = f"{name} (device {device})" if several else name
            ax.step(
                x, series["requested"], where="post", color=color, lw=1.2, zorder=zorder, label=f"{label}: requested"
            )
            reserved = series["reserved"]
            ax.step(x, reserved, where="post", color=color, lw=0.9, ls="--", zorder=zorder, label=f"{label}: reserved")
    ax.set_xlabel("seconds since the file's first event" if timed else "allocator events, in trace order")
    ax.set_xlim(left=0)
    bytes_axis(ax.yaxis)
    ax.set_ylabel("GPU memory")
    top = max([max([*series["reserved"], *series["requested"]], default=0) for series in [*before, *after]] or [1])
    ax.set_ylim(0, max(top, 1) * 1.35)  # headroom for the legend
    ax.set_title("Memory over the trace, both files overlaid", loc="left")
    ax.legend(loc="upper left", ncols=2, fontsize=7)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig
