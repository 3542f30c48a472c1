"""Memory by the user's own stages: the ``record_function`` ranges of ``external_annotations``.

Each range (a START and its END, per device) gets, replayed from the trace: the peak of the
requested level between them (the same series as :mod:`.timeline`, anchored at the dump), the
level live at its start and at its end, what it allocated and what it kept (allocated inside,
alive at its end), the last two by category.

What the file cannot say is said, not guessed:

- torch writes no thread on an annotation: ranges recorded on other threads
  (``global_record_annotations=True``) cannot be told apart. A range that starts inside another
  and ends after it cannot be nested on one thread, so it is flagged ``crosses``.
- a START with no END runs until the trace's end (``unclosed``); an END with no START began
  before the recording (``before_trace``: from the trace's first event); a START before the
  trace's first event starts where the trace does (``starts_before_trace``).
- an event at the same microsecond as a START or an END counts as inside the range.

Ranges are matched in Python (one step per annotation, at most :data:`MAX_ANNOTATIONS`); the
figures of each range are numpy reductions over its slice of the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo
from ..categories import CategoryRules, categorize
from ..stats.torch_stats import compute_torch_stats
from .lifetimes import device_lifetimes
from .timeline import device_timeline

MAX_ANNOTATIONS = 20_000  # START/END entries read per device; the rest are counted and said
THREAD_NOTE = (
    "torch records no thread on a range: ranges from other threads cannot be told apart "
    "(one that starts inside another and ends after it is flagged 'crosses')"
)
# name prefix -> kind (a range's kind says what recorded it)
_KIND_PREFIXES = (
    ("nccl:", "nccl"),
    ("ProfilerStep#", "profiler_step"),
    ("Optimizer.", "optimizer"),
    ("aten::", "op"),
    ("CompiledFunction", "compiled"),
    ("Torch-Compiled Region", "compiled"),
    ("## Call CompiledFxGraph", "compiled"),
    ("CompiledFxGraph", "compiled"),
    ("cudagraph", "compiled"),
)


def range_kind(name: str) -> str:
    """``nccl`` (a collective), ``compiled`` (a compiled-graph call), ``op`` (an aten op, with
    ``global_record_annotations``), ``optimizer``, ``profiler_step`` or ``record_function``."""
    for prefix, kind in _KIND_PREFIXES:
        if name.startswith(prefix):
            return kind
    return "record_function"


@dataclass(frozen=True)
class StageRange:
    """One range. Times are the annotations' own (None where the file has no START or END)."""

    name: str
    kind: str
    depth: int  # 0: outermost
    parent: int | None  # index in Stages.ranges of the innermost range around this one
    start_time_us: int | None
    end_time_us: int | None
    n_events: int  # trace events inside
    peak_requested_bytes: int
    peak_event_index: int | None  # the event that reached the peak (None: the level at its start)
    live_at_start_bytes: int
    live_at_end_bytes: int
    allocated_bytes: int
    kept_bytes: int
    allocated_by_category: dict[str, int]
    kept_by_category: dict[str, int]
    flags: tuple[str, ...] = ()  # unclosed, before_trace, starts_before_trace, crosses

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "depth": self.depth,
            "parent": self.parent,
            "start_time_us": self.start_time_us,
            "end_time_us": self.end_time_us,
            "n_events": self.n_events,
            "peak_requested_bytes": self.peak_requested_bytes,
            "peak_event_index": self.peak_event_index,
            "live_at_start_bytes": self.live_at_start_bytes,
            "live_at_end_bytes": self.live_at_end_bytes,
            "allocated_bytes": self.allocated_bytes,
            "kept_bytes": self.kept_bytes,
            "allocated_by_category": self.allocated_by_category,
            "kept_by_category": self.kept_by_category,
            "flags": list(self.flags),
        }


@dataclass(frozen=True)
class Stages:
    """The ranges of one device, in order of their start (outer before inner)."""

    device: int
    ranges: tuple[StageRange, ...]
    notes: tuple[str, ...] = ()  # what could not be decided, in words
    annotations_dropped: int = 0  # entries past MAX_ANNOTATIONS
    anchored_at_end: bool = False  # levels anchored at the dump (the trace misses the job's start)
    threads: str = THREAD_NOTE

    def by_name(self) -> dict[str, dict[str, int]]:
        """Per name: how many ranges, and the largest peak, allocation and kept bytes of them."""
        out: dict[str, dict[str, int]] = {}
        for r in self.ranges:
            row = out.setdefault(r.name, {"count": 0, "peak_requested_bytes": 0, "allocated_bytes": 0, "kept_bytes": 0})
            row["count"] += 1
            row["peak_requested_bytes"] = max(row["peak_requested_bytes"], r.peak_requested_bytes)
            row["allocated_bytes"] = max(row["allocated_bytes"], r.allocated_bytes)
            row["kept_bytes"] = max(row["kept_bytes"], r.kept_bytes)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "ranges": [r.to_dict() for r in self.ranges],
            "notes": list(self.notes),
            "annotations_dropped": self.annotations_dropped,
            "anchored_at_end": self.anchored_at_end,
            "threads": self.threads,
        }


@dataclass
class _Matched:
    """Ranges as matched from the annotations: parallel lists, one item per range."""

    names: list[str] = field(default_factory=list)
    start_us: list[int | None] = field(default_factory=list)
    end_us: list[int | None] = field(default_factory=list)


def _match(annotations: pd.DataFrame) -> _Matched:
    """Pair each END with the latest open START of its name (a name may nest in itself)."""
    matched = _Matched()
    open_by_name: dict[str, list[int]] = {}
    rows = zip(annotations["stage"].astype(str), annotations["name"].astype(str), annotations["time_us"], strict=True)
    for stage, name, time_us in rows:
        t = None if pd.isna(time_us) else int(time_us)
        if stage == "START":
            open_by_name.setdefault(name, []).append(len(matched.names))
            matched.names.append(name)
            matched.start_us.append(t)
            matched.end_us.append(None)
        elif stage == "END":
            opened = open_by_name.get(name)
            if opened:
                matched.end_us[opened.pop()] = t
            else:  # began before the recording
                matched.names.append(name)
                matched.start_us.append(None)
                matched.end_us.append(t)
    return matched


def _nest(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Depth, parent (-1: none) and 'crosses' of ranges sorted by (start, -end), given as times
    (both ends inside the range)."""
    n = start.size
    depth, parent, crosses = np.zeros(n, np.int64), np.full(n, -1, np.int64), np.zeros(n, bool)
    stack: list[int] = []
    for i in range(n):
        # a range that ended when this one starts holds it only if this one ends then too
        while stack and end[stack[-1]] <= start[i] and end[i] > end[stack[-1]]:
            stack.pop()
        k = len(stack) - 1
        while k >= 0 and end[stack[k]] < end[i]:
            k -= 1
        crosses[i] = k < len(stack) - 1
        if k >= 0:
            parent[i], depth[i] = stack[k], depth[stack[k]] + 1
        stack.append(i)
    return depth, parent, crosses


def _range_max(level: np.ndarray, start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Max of ``level[start:stop]`` and its first position, per range (-1 for an empty one)."""
    peak = np.full(start.size, np.iinfo(np.int64).min, np.int64)
    where = np.full(start.size, -1, np.int64)
    for i in np.flatnonzero(stop > start):
        part = level[start[i] : stop[i]]
        j = int(np.argmax(part))
        peak[i], where[i] = part[j], start[i] + j
    return peak, where


@dataclass(frozen=True)
class _Trace:
    """One device's trace, as the stage figures read it."""

    times_us: np.ndarray
    after: np.ndarray  # requested level after each event
    before: np.ndarray  # ... before it
    event_index: np.ndarray
    alloc_pos: np.ndarray  # lifetimes: position of each allocation
    free_pos: np.ndarray  # ... of its free (max int64: never freed)
    size: np.ndarray
    code: np.ndarray  # category code (index into ``names``)
    anchored: bool
    names: tuple[str, ...]  # the categories: the built-in ones, then the user's rules' (if any)


def _trace(frames: SnapshotFrames, device: int, rules: CategoryRules | None = None) -> _Trace | None:
    ev = frames.device_events(device)
    if len(ev) < 2 or ev["time_us"].isna().any():
        return None
    ts = compute_torch_stats(
        frames.segments[frames.segments["device"] == device], frames.blocks[frames.blocks["device"] == device]
    )
    tl = device_timeline(frames, device, ts["requested_bytes.all.current"], ts["reserved_bytes.all.current"])
    if tl is None:
        return None
    action = ev["action"].astype(str).to_numpy()
    size = ev["size_bytes"].to_numpy(dtype=np.int64, na_value=0)
    delta = np.where(action == "alloc", size, 0) - np.where(action == "free_completed", size, 0)
    lt = device_lifetimes(frames, device)
    base = int(ev["event_index"].iloc[0])
    labels = categorize(frames, rules)
    code = labels.alloc_codes[device]
    return _Trace(
        times_us=ev["time_us"].to_numpy(dtype=np.int64),
        after=tl.requested_bytes,
        before=tl.requested_bytes - delta,
        event_index=ev["event_index"].to_numpy(dtype=np.int64),
        alloc_pos=lt["event_index"].to_numpy(dtype=np.int64) - base,
        free_pos=lt["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max) - base,
        size=lt["size_bytes"].to_numpy(dtype=np.int64),
        code=np.where(code < 0, labels.names.index("other"), code),
        anchored=tl.anchored_at_end,
        names=labels.names,
    )


def _by_category(code: np.ndarray, size: np.ndarray, names: tuple[str, ...]) -> dict[str, int]:
    sums = np.bincount(code, weights=size, minlength=len(names)).astype(np.int64)
    return {c: int(sums[i]) for i, c in enumerate(names) if sums[i]}


def _figures(trace: _Trace, start: int, stop: int) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """Allocated and kept bytes of the events at positions [start, stop), and by category."""
    lo, hi = np.searchsorted(trace.alloc_pos, [start, stop], side="left")
    size, code = trace.size[lo:hi], trace.code[lo:hi]
    kept = trace.free_pos[lo:hi] >= stop
    return (
        int(size.sum()),
        int(size[kept].sum()),
        _by_category(code, size, trace.names),
        _by_category(code[kept], size[kept], trace.names),
    )


def _flags(start_us: int | None, end_us: int | None, first_us: int, crosses: bool) -> tuple[str, ...]:
    flags = []
    if end_us is None:
        flags.append("unclosed")
    if start_us is None:
        flags.append("before_trace")
    elif start_us < first_us:
        flags.append("starts_before_trace")
    if crosses:
        flags.append("crosses")
    return tuple(flags)


def _ranges(trace: _Trace, matched: _Matched) -> tuple[StageRange, ...]:
    big = np.iinfo(np.int64).max
    # unknown ends nest outside every known one
    start_us = np.array([-big if t is None else t for t in matched.start_us], np.int64)
    end_us = np.array([big if t is None else t for t in matched.end_us], np.int64)
    order = np.lexsort((-end_us, start_us))
    depth, parent, crosses = _nest(start_us[order], end_us[order])
    start = np.searchsorted(trace.times_us, start_us[order], side="left")
    stop = np.maximum(np.searchsorted(trace.times_us, end_us[order], side="right"), start)
    peak_inside, where = _range_max(trace.after, start, stop)
    level = np.r_[trace.before, trace.after[-1]]  # level before position p (p == n: after the last event)
    at_start, at_end = level[start], level[stop]
    out = []
    for i, src in enumerate(order):
        allocated, kept, alloc_cat, kept_cat = _figures(trace, int(start[i]), int(stop[i]))
        inside = bool(where[i] >= 0 and peak_inside[i] > at_start[i])
        out.append(
            StageRange(
                name=matched.names[src],
                kind=range_kind(matched.names[src]),
                depth=int(depth[i]),
                parent=None if parent[i] < 0 else int(parent[i]),
                start_time_us=matched.start_us[src],
                end_time_us=matched.end_us[src],
                n_events=int(stop[i] - start[i]),
                peak_requested_bytes=int(peak_inside[i]) if inside else int(at_start[i]),
                peak_event_index=int(trace.event_index[where[i]]) if inside else None,
                live_at_start_bytes=int(at_start[i]),
                live_at_end_bytes=int(at_end[i]),
                allocated_bytes=allocated,
                kept_bytes=kept,
                allocated_by_category=alloc_cat,
                kept_by_category=kept_cat,
                flags=_flags(matched.start_us[src], matched.end_us[src], int(trace.times_us[0]), bool(crosses[i])),
            )
        )
    return tuple(out)


def compute_stages(frames: SnapshotFrames, device: int, rules: CategoryRules | None = None) -> Stages:
    """The ranges of ``external_annotations`` recorded on ``device``, with what each held (by
    category: the user's ``rules`` first, when given)."""
    ann = frames.annotations
    ann = ann[(ann["device"] == device) & ann["stage"].isin(["START", "END"])]
    if ann.empty:
        return Stages(device, (), ("no record_function ranges on this device",))
    trace = _trace(frames, device, rules)
    if trace is None:
        return Stages(device, (), ("the trace has no times (or fewer than two events): ranges cannot be placed",))
    ann = ann.sort_values("time_us", kind="stable")
    dropped = max(len(ann) - MAX_ANNOTATIONS, 0)
    notes = []
    if dropped:
        notes.append(f"only the first {MAX_ANNOTATIONS} annotations were read; {dropped} later ones were not")
    ranges = _ranges(trace, _match(ann.head(MAX_ANNOTATIONS)))
    for flag, words in (
        ("unclosed", "ranges with no END run until the trace's end"),
        ("before_trace", "ranges with no START began before the recording: taken from the trace's first event"),
        ("starts_before_trace", "ranges that started before the trace's first event start where the trace does"),
        ("crosses", "ranges that cross others (likely recorded on another thread)"),
    ):
        count = sum(flag in r.flags for r in ranges)
        if count:
            notes.append(f"{count} {words}")
    if trace.anchored:
        notes.append("the trace misses the job's start: levels are anchored at the dump")
    return Stages(device, ranges, tuple(notes), dropped, trace.anchored)


def device_stages(frames: SnapshotFrames, device: int, rules: CategoryRules | None = None) -> Stages:
    """:func:`compute_stages`, computed once per frames, device (and rules)."""
    key = ("stages", device) if rules is None else ("stages", device, rules)
    return memo(frames, key, lambda: compute_stages(frames, device, rules))


def has_stages(frames: SnapshotFrames) -> bool:
    """Whether the file records any START/END range."""
    return bool(frames.annotations["stage"].isin(["START", "END"]).any())


def file_stages(frames: SnapshotFrames, rules: CategoryRules | None = None) -> dict[int, Stages]:
    """:func:`device_stages` of every device that has a trace or ranges, in device order (by
    category: the user's ``rules`` first, when given)."""
    named = {int(d) for d in frames.annotations["device"].unique()}
    devices = sorted(set(frames.info.trace_devices) | (named & set(frames.info.devices)))
    return {d: device_stages(frames, d, rules) for d in devices}
