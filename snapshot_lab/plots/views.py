"""What the trace figures draw, reduced from the trace to a few thousand points (no matplotlib
here): computed where the trace is, drawn wherever matplotlib is (issue #23: the report's
figures are drawn by a process that imported matplotlib while the snapshot was read, and what it
is sent must be small)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..metrics.history.timeline import Envelope, Timeline, envelope

TIMELINE_POINTS = 2000
CATEGORY_POINTS = 800


def _x_limits(x: np.ndarray) -> tuple[float, float]:
    return float(x[0]), float(x[-1]) if x[-1] > x[0] else float(x[0]) + 1


@dataclass(frozen=True)
class TimelineView:
    """Requested and reserved bytes over the trace, as min/max buckets, and what is marked on them."""

    device: int
    reserved: Envelope
    requested: Envelope
    peak_x: float
    peak_requested_bytes: int
    top: int
    x_limits: tuple[float, float]
    x_label: str
    n_events: int
    max_points: int
    markers: tuple[float, ...]
    marker_group: str
    ooms: tuple[float, ...]


def timeline_view(tl: Timeline, max_points: int = TIMELINE_POINTS) -> TimelineView:
    return TimelineView(
        device=tl.device,
        reserved=envelope(tl.x, tl.reserved_bytes, max_points),
        requested=envelope(tl.x, tl.requested_bytes, max_points),
        peak_x=tl.x[int(np.argmax(tl.requested_bytes))],
        peak_requested_bytes=tl.peak_requested_bytes,
        top=max(int(tl.reserved_bytes.max()), tl.peak_requested_bytes, 1),
        x_limits=_x_limits(tl.x),
        x_label=tl.x_label,
        n_events=tl.n_events,
        max_points=max_points,
        markers=tuple(m.x for m in tl.markers),
        marker_group=tl.marker_group or "",
        ooms=tuple(m.x for m in tl.ooms),
    )


@dataclass(frozen=True)
class CategoryView:
    """Bytes per category over the trace, each as the maximum of its buckets (short spikes stay visible)."""

    categories: list[str]
    x: np.ndarray
    highs: list[np.ndarray]
    x_limits: tuple[float, float]
    x_label: str


def category_view(
    levels: Iterable[tuple[str, np.ndarray]], x: np.ndarray, x_label: str, max_points: int = CATEGORY_POINTS
) -> CategoryView:
    """``levels``: (category, bytes after each event) one category at a time (a
    :class:`~snapshot_lab.metrics.categories.CategoryLevels`, or a table's ``items()``); each
    is reduced before the next is read; ``x``: event positions."""
    cols, series = [], []
    for name, level in levels:
        values = np.asarray(level)
        if values.max() > 0:
            cols.append(str(name))
            series.append(envelope(x, values, max_points))
    return CategoryView(
        categories=cols,
        x=series[0].x if series else x[:0],
        highs=[s.high for s in series],
        x_limits=_x_limits(x),
        x_label=x_label,
    )
