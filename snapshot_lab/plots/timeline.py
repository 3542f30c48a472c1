"""Memory over time: requested (live tensors) and reserved (held from CUDA)."""

from __future__ import annotations

from matplotlib.figure import Figure

from ..units import format_bytes
from .common import COLORS, bytes_axis, literal, new_figure, styled
from .views import TimelineView


@styled
def plot_timeline(view: TimelineView) -> Figure:
    fig = new_figure(10.5, 3.6)
    ax = fig.add_subplot()
    res, req = view.reserved, view.requested
    ax.fill_between(
        res.x, 0, res.high, step="post", color=COLORS["reserved"], alpha=0.35, lw=0, label="reserved (held from CUDA)"
    )
    ax.step(res.x, res.high, where="post", color=COLORS["reserved"], lw=1)
    ax.fill_between(req.x, req.low, req.high, step="post", color=COLORS["requested"], alpha=0.5, lw=0)
    ax.step(req.x, req.high, where="post", color=COLORS["requested"], lw=1.1, label="requested by live tensors")
    ax.axhline(view.peak_requested_bytes, color=COLORS["peak"], lw=0.8, ls=":")
    ax.annotate(
        f"peak {format_bytes(view.peak_requested_bytes)}",
        xy=(view.peak_x, view.peak_requested_bytes),
        xytext=(4, 4),
        textcoords="offset points",
        color=COLORS["peak"],
        fontsize=8,
    )
    ax.plot([view.peak_x], [view.peak_requested_bytes], "o", color=COLORS["peak"], ms=4)
    for i, x in enumerate(view.markers):
        ax.axvline(
            x,
            color=COLORS["marker"],
            lw=0.6,
            ls="--",
            alpha=0.6,
            label=f"start of '{literal(view.marker_group)}'" if i == 0 else None,
        )
    for i, x in enumerate(view.ooms):
        ax.axvline(x, color=COLORS["oom"], lw=1.6, label="out of memory" if i == 0 else None)
    ax.set_ylim(0, view.top * 1.12)
    ax.set_xlim(*view.x_limits)
    bytes_axis(ax.yaxis)
    ax.set_xlabel(view.x_label)
    ax.set_ylabel("GPU memory")
    title = f"Device {view.device}: memory over the recorded trace ({view.n_events:,} events"
    if view.n_events > view.max_points:
        title += f", drawn as {view.max_points:,} min/max buckets"
    ax.set_title(title + ")", loc="left")
    ax.legend(loc="upper left", ncols=4)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig
