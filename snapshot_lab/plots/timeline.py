"""Memory over time: requested (live tensors) and reserved (held from CUDA)."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ..metrics.history.timeline import Timeline, envelope
from ..units import format_bytes
from .common import COLORS, bytes_axis, literal, new_figure, styled


@styled
def plot_timeline(tl: Timeline, max_points: int = 2000) -> Figure:
    fig = new_figure(10.5, 3.6)
    ax = fig.add_subplot()
    res = envelope(tl.x, tl.reserved_bytes, max_points)
    req = envelope(tl.x, tl.requested_bytes, max_points)
    ax.fill_between(
        res.x, 0, res.high, step="post", color=COLORS["reserved"], alpha=0.35, lw=0, label="reserved (held from CUDA)"
    )
    ax.step(res.x, res.high, where="post", color=COLORS["reserved"], lw=1)
    ax.fill_between(req.x, req.low, req.high, step="post", color=COLORS["requested"], alpha=0.5, lw=0)
    ax.step(req.x, req.high, where="post", color=COLORS["requested"], lw=1.1, label="requested by live tensors")
    peak_x = tl.x[int(np.argmax(tl.requested_bytes))]
    ax.axhline(tl.peak_requested_bytes, color=COLORS["peak"], lw=0.8, ls=":")
    ax.annotate(
        f"peak {format_bytes(tl.peak_requested_bytes)}",
        xy=(peak_x, tl.peak_requested_bytes),
        xytext=(4, 4),
        textcoords="offset points",
        color=COLORS["peak"],
        fontsize=8,
    )
    ax.plot([peak_x], [tl.peak_requested_bytes], "o", color=COLORS["peak"], ms=4)
    for i, m in enumerate(tl.markers):
        ax.axvline(
            m.x,
            color=COLORS["marker"],
            lw=0.6,
            ls="--",
            alpha=0.6,
            label=f"start of '{literal(tl.marker_group or '')}'" if i == 0 else None,
        )
    for i, m in enumerate(tl.ooms):
        ax.axvline(m.x, color=COLORS["oom"], lw=1.6, label="out of memory" if i == 0 else None)
    top = max(int(tl.reserved_bytes.max()), tl.peak_requested_bytes, 1)
    ax.set_ylim(0, top * 1.12)
    ax.set_xlim(float(tl.x[0]), float(tl.x[-1]) if tl.x[-1] > tl.x[0] else float(tl.x[0]) + 1)
    bytes_axis(ax.yaxis)
    ax.set_xlabel(tl.x_label)
    ax.set_ylabel("GPU memory")
    title = f"Device {tl.device}: memory over the recorded trace ({tl.n_events:,} events"
    if tl.n_events > max_points:
        title += f", drawn as {max_points:,} min/max buckets"
    ax.set_title(title + ")", loc="left")
    ax.legend(loc="upper left", ncols=4)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig
