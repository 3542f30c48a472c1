"""Memory over time, rebuilt from the trace.

Two exact series per device:

- ``requested_bytes``: bytes requested by live tensors — ``+size`` at ``alloc``, ``-size`` at
  ``free_completed`` (the trace records the request before rounding, so this is torch's
  ``requested_bytes`` counter; its maximum equals ``requested_bytes.all.peak`` when the trace
  covers the whole run).
- ``reserved_bytes``: bytes held from CUDA — ``segment_alloc``/``segment_map`` add,
  ``segment_free``/``segment_unmap`` subtract.

When the trace does not start at the start of the job (ring buffer wrapped, recording started
late), the level before the first event is unknown; we anchor each series at its end, where the
snapshot's segments give the exact value, and walk back (the changes inside the trace are
exact, so every point is exact too, as long as the snapshot was dumped right after the trace).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames, device_rows
from .._memo import memo
from .ooms import fatal_rows

NEW_SEGMENT = ("segment_alloc", "segment_map")  # the events that reserve memory
SEGMENT_GONE = ("segment_free", "segment_unmap")  # those that give it back


@dataclass(frozen=True)
class Marker:
    x: float
    label: str


@dataclass(frozen=True)
class Envelope:
    """A series reduced to at most ``n`` buckets: per bucket, the first x, and min/max of y."""

    x: np.ndarray
    low: np.ndarray
    high: np.ndarray


@dataclass(frozen=True)
class Timeline:
    device: int
    # seconds since the first event, or the event index when there is no time
    x: np.ndarray
    x_label: str
    requested_bytes: np.ndarray
    reserved_bytes: np.ndarray
    peak_requested_bytes: int
    peak_index: int  # event index of the (first) requested peak
    peak_reserved_bytes: int
    # True when the start level had to be inferred from the end
    anchored_at_end: bool
    ooms: tuple[Marker, ...] = ()
    markers: tuple[Marker, ...] = ()
    marker_group: str | None = None
    start_time_us: int | None = None

    @property
    def n_events(self) -> int:
        return int(self.x.size)


def _step_markers(
    annotations: pd.DataFrame, times: np.ndarray | None, limit: int
) -> tuple[tuple[Marker, ...], str | None]:
    """Iteration boundaries from ``external_annotations``: START entries of the most frequent
    annotation name family (names with their digits folded, e.g. ``ProfilerStep#N``), placed at
    the first trace event at or after their time."""
    if times is None or annotations.empty:
        return (), None
    starts = annotations[(annotations["stage"] == "START") & annotations["time_us"].notna()]
    if starts.empty:
        return (), None
    family = starts["name"].map(lambda name: re.sub(r"\d+", "N", str(name)))
    counts = family.value_counts()
    repeated = counts[counts >= 2]
    if repeated.empty:
        return (), None
    # prefer names that look like iterations
    stepish = [
        family_name
        for family_name in repeated.index
        if re.search(
            r"step|iter|epoch|batch",
            family_name,
            re.I,
        )
    ]
    group = stepish[0] if stepish else repeated.index[0]
    rows = starts[family == group].head(limit)
    pos = np.searchsorted(times, rows["time_us"].to_numpy(dtype=np.int64), side="left")
    markers = tuple(
        Marker(x=float(position), label=str(name))
        for position, name in zip(pos, rows["name"], strict=True)
        if position < times.size
    )
    return markers, str(group)


def compute_timeline(
    events: pd.DataFrame,
    device: int,
    requested_at_end: int,
    reserved_at_end: int,
    annotations: pd.DataFrame | None = None,
    max_markers: int = 200,
) -> Timeline | None:
    """The timeline of one device (None when its trace has fewer than two entries)."""
    device_events = device_rows(events, device)
    if len(device_events) < 2:
        return None
    action = device_events["action"]
    size = device_events["size_bytes"].to_numpy()
    d_req = np.where(action == "alloc", size, 0) - np.where(action == "free_completed", size, 0)
    req = np.cumsum(d_req)
    req_offset = requested_at_end - int(req[-1])
    req += req_offset
    steps = reserved_steps(device_events, reserved_at_end)
    res_offset = int(steps.level[0])
    res = steps.after_each(len(device_events))
    # positions in the trace, not times: time is dominated by idle stretches (start-up, data
    # loading) while the allocator's activity is what the picture is about
    positions = np.arange(len(device_events), dtype=np.float64)
    x_label = "allocator events, in trace order"
    times = device_events["time_us"]
    times_us = times.to_numpy(dtype=np.int64) if times.notna().all() else None
    start_time = int(times_us[0]) if times_us is not None else None
    peak_pos = int(np.argmax(req))
    oom_rows = np.flatnonzero(fatal_rows(device_events))  # the job's end
    ooms = tuple(
        Marker(
            x=float(positions[row]),
            label=f"OOM: request of {int(size[row])} bytes",
        )
        for row in oom_rows
    )
    markers, group = _step_markers(annotations, times_us, max_markers) if annotations is not None else ((), None)
    return Timeline(
        device=device,
        x=positions,
        x_label=x_label,
        requested_bytes=req,
        reserved_bytes=res,
        peak_requested_bytes=int(req[peak_pos]),
        peak_index=int(device_events["event_index"].iloc[peak_pos]),
        peak_reserved_bytes=int(res.max()),
        anchored_at_end=bool(req_offset != 0 or res_offset != 0),
        ooms=ooms,
        markers=markers,
        marker_group=group,
        start_time_us=start_time,
    )


@dataclass(frozen=True)
class ReservedSteps:
    """One device's reserved memory at its segment events, anchored at the dump (what the dump
    holds less what the events after each row added)."""

    rows: np.ndarray  # the trace's rows that make or give back a segment, in order
    adds: np.ndarray  # whether each of those makes one (NEW_SEGMENT)
    level: np.ndarray  # reserved bytes before each of ``rows``, then at the trace's end

    def before(self, row: int) -> int:
        """Reserved bytes just before trace row ``row``."""
        return int(self.level[np.searchsorted(self.rows, row)])

    def after_each(self, n: int) -> np.ndarray:
        """Reserved bytes after each of the trace's ``n`` rows."""
        at = np.zeros(n, dtype=bool)
        at[self.rows] = True
        return self.level[np.cumsum(at)]


def reserved_steps(device_events: pd.DataFrame, reserved_at_end: int) -> ReservedSteps:
    """:class:`ReservedSteps` of one device's events (``reserved_at_end``: the dump's segments)."""
    action = device_events["action"]
    rows = np.flatnonzero(action.isin(NEW_SEGMENT + SEGMENT_GONE).to_numpy())
    adds = action.iloc[rows].isin(NEW_SEGMENT).to_numpy()
    size = device_events["size_bytes"].to_numpy(dtype=np.int64)[rows]
    delta = np.where(adds, size, -size)
    level = reserved_at_end - int(delta.sum()) + np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(delta)])
    return ReservedSteps(rows, adds, level)


def peak_reserved(events: pd.DataFrame, device: int, reserved_at_end: int) -> int | None:
    """:func:`compute_timeline`'s ``peak_reserved_bytes`` (None where it gives no timeline), from
    the segment events alone: a caller that needs only the peak (fit's limit) does not build the
    timeline's columns over every event (200 MiB at once at 5M entries)."""
    device_events = device_rows(events, device)
    if len(device_events) < 2:
        return None
    steps = reserved_steps(device_events, reserved_at_end)
    # the level before the first segment event shows only where some row comes before it
    shown = steps.level[1:] if steps.rows.size and steps.rows[0] == 0 else steps.level
    return int(shown.max())


def envelope(x: np.ndarray, y: np.ndarray, max_points: int = 2000) -> Envelope:
    """Reduce a long series to ``max_points`` buckets keeping each bucket's min and max, so peaks
    survive downsampling."""
    count = y.size
    if count <= max_points:
        return Envelope(x=x, low=y, high=y)
    edges = np.linspace(0, count, max_points + 1).astype(np.int64)
    starts = edges[:-1]
    return Envelope(
        x=x[starts],
        low=np.minimum.reduceat(y, starts),
        high=np.maximum.reduceat(y, starts),
    )


def device_timeline(
    frames: SnapshotFrames, device: int, requested_at_end: int, reserved_at_end: int
) -> Timeline | None:
    """:func:`compute_timeline` of one device of ``frames``, with its annotations, computed once
    (the diagnostics, the module view, the what-if and the pytest plugin all start from it)."""
    return memo(
        frames,
        ("timeline", device, requested_at_end, reserved_at_end),
        lambda: compute_timeline(
            frames.events,
            device,
            requested_at_end,
            reserved_at_end,
            frames.annotations,
        ),
    )
