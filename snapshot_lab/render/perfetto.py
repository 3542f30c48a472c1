"""Memory over time as a Chrome trace: the Trace Event Format's JSON object form
(``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``), which Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open, so memory can sit beside a profiler trace.

One process per device (``pid`` = the device's index), named ``GPU <n> memory``; one thread per
CUDA stream the trace names (``tid`` 1, 2, ... in the order of the streams' ids, ``tid`` 0 for the
counters). In each process:

- counter tracks (``ph: "C"``): ``allocated`` (torch's ``allocated_bytes``: the blocks handed to
  tensors, rounded as the allocator rounds them), ``reserved`` (``reserved_bytes``),
  ``requested`` (``requested_bytes``: what the tensors asked for) and ``category`` (requested
  bytes by category, one series per category). One point per change of the value; a track of
  more than ``MAX_COUNTER_POINTS`` changes keeps, in each of ``MAX_COUNTER_POINTS / 2`` equal
  runs of changes, the lowest and the highest point, so its peak (and troughs) stay exact.
- one async slice (``ph: "b"``/``"e"``, ``cat: "allocation"``, named by the allocation's
  category, ``id`` = its trace event index) per allocation the trace made, from its ``alloc`` to
  its ``free_completed`` (or the end of the trace while still alive at the dump), with its size,
  address, stream, category and the top frames of its stack in ``args``. At most ``max_slices``
  per device: first every allocation alive at the requested peak, then the largest, largest
  first; ``otherData`` says how many were kept of how many.
- an instant (``ph: "i"``) at every out-of-memory error.

Time is in microseconds from the trace's first event (``time_us``; ``otherData.time_origin_unix_us``
is that event's wall-clock time). Entries of the same microsecond are spread evenly inside it, so a
level that lasted less than 1 µs (often the peak) still shows. A snapshot without ``time_us``
places its events 1 µs apart in trace order and says so in ``otherData.clock``.

Everything is read from metric results (the trace replays of :mod:`..metrics.history.timeline`
and :mod:`..metrics.history.allocated`, the lifetimes, the categories), not from the snapshot file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..frames import SnapshotFrames, event_positions
from ..limits import DEFAULT_MAX_SLICES
from ..metrics.attribution.sites import classify_frames, frame_label
from ..metrics.categories import CategoryRules, category_timeline
from ..metrics.categories.assign import categorize
from ..metrics.categories.rules import CODES
from ..metrics.history.allocated import allocated_levels
from ..metrics.history.lifetimes import device_lifetimes
from ..metrics.history.timeline import Timeline, device_timeline
from ..metrics.stats.torch_stats import compute_torch_stats
from ..units import format_bytes

MAX_COUNTER_POINTS = 20_000  # points per counter track before it is reduced to its extremes
STACK_FRAMES = 8  # frames of an allocation's stack in its slice's args, innermost first
COUNTER_TID = 0
EVENT_ORDER_CLOCK = "event order: 1 µs per allocator event (the snapshot has no time_us)"
WALL_CLOCK = "time_us: microseconds since the trace's first event (time_origin_unix_us)"


@dataclass(frozen=True)
class DeviceMemory:
    """What one device's trace says, from the metrics: everything aligned with its events."""

    device: int
    events: pd.DataFrame
    timeline: Timeline
    allocated_bytes: np.ndarray
    categories: pd.DataFrame | None
    lifetimes: pd.DataFrame
    lifetime_categories: np.ndarray  # category name per row of ``lifetimes``


# --------------------------------------------------------------------------- reading the metrics


def device_memory(frames: SnapshotFrames, device: int, rules: CategoryRules | None = None) -> DeviceMemory | None:
    """The metric results one device's tracks are drawn from (None: fewer than two trace
    entries); ``rules``: the user's categories first."""
    counters = compute_torch_stats(
        frames.segments[frames.segments["device"] == device], frames.blocks[frames.blocks["device"] == device]
    )
    timeline = device_timeline(
        frames, device, counters["requested_bytes.all.current"], counters["reserved_bytes.all.current"]
    )
    if timeline is None:
        return None
    lifetimes = device_lifetimes(frames, device)
    labels = categorize(frames, rules)
    codes = labels.alloc_codes[device]
    names = np.array(labels.names, dtype=object)[np.where(codes < 0, CODES["other"], codes)]
    return DeviceMemory(
        device=device,
        events=frames.device_events(device),
        timeline=timeline,
        allocated_bytes=allocated_levels(frames, device, counters["allocated_bytes.all.current"]),
        categories=category_timeline(frames, device, rules),
        lifetimes=lifetimes,
        lifetime_categories=names,
    )


# --------------------------------------------------------------------------- time and counters


def trace_clock(times: pd.Series, origin_us: int | None) -> np.ndarray:
    """Each event's ``ts`` in µs from ``origin_us`` (None: no wall clock, 1 µs per event).
    Entries of one microsecond are spread evenly inside it; a clock that stepped back is held."""
    if origin_us is None:
        return np.arange(len(times), dtype=np.float64)
    t = np.maximum.accumulate(times.to_numpy(dtype=np.int64)) - origin_us
    _, first, count = np.unique(t, return_index=True, return_counts=True)
    group = np.repeat(np.arange(count.size), count)
    rank = np.arange(t.size) - first[group]
    return np.round(t + rank / count[group], 3)


def counter_points(key: np.ndarray, changed: np.ndarray, limit: int = MAX_COUNTER_POINTS) -> np.ndarray:
    """Positions a counter track keeps: every change (``changed``, the first position always);
    beyond ``limit`` changes, per run of changes the lowest and the highest ``key`` (their first
    positions) and the last change, so the track's peak and troughs stay exact."""
    change = np.flatnonzero(changed)
    if change.size <= limit:
        return change
    values = key[change]
    starts = np.unique(np.linspace(0, change.size, limit // 2 + 1).astype(np.int64)[:-1])
    run = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, change.size]))
    kept = [change[-1:]]
    for extreme in (np.maximum.reduceat(values, starts), np.minimum.reduceat(values, starts)):
        hits = np.flatnonzero(values == extreme[run])
        _, first = np.unique(run[hits], return_index=True)
        kept.append(change[hits[first]])
    return np.unique(np.concatenate(kept))


def _changes(values: np.ndarray) -> np.ndarray:
    """True where a series differs from its previous value (the first position always)."""
    if values.ndim == 1:
        return np.r_[True, values[1:] != values[:-1]]
    return np.r_[True, np.any(values[1:] != values[:-1], axis=1)]


def _counter_events(name: str, pid: int, ts: np.ndarray, values: np.ndarray) -> tuple[list[dict[str, Any]], int]:
    keep = counter_points(values, _changes(values))
    events = [
        {"name": name, "ph": "C", "ts": float(ts[i]), "pid": pid, "tid": COUNTER_TID, "args": {"bytes": int(values[i])}}
        for i in keep
    ]
    return events, int(_changes(values).sum())


def _category_events(pid: int, ts: np.ndarray, levels: pd.DataFrame) -> tuple[list[dict[str, Any]], int]:
    """One ``category`` counter: requested bytes of every category that held any, as one
    stacked series each (reduced, beyond the bound, at the extremes of their total)."""
    used = [c for c in levels.columns if levels[c].to_numpy().any()]
    if not used:
        return [], 0
    matrix = levels[used].to_numpy(dtype=np.int64)
    changed = _changes(matrix)
    keep = counter_points(matrix.sum(axis=1), changed)
    events = [
        {
            "name": "category",
            "ph": "C",
            "ts": float(ts[i]),
            "pid": pid,
            "tid": COUNTER_TID,
            "args": {c: int(v) for c, v in zip(used, matrix[i], strict=True)},
        }
        for i in keep
    ]
    return events, int(changed.sum())


# --------------------------------------------------------------------------- allocation slices


def select_slices(
    size: np.ndarray, alloc_pos: np.ndarray, free_pos: np.ndarray, peak_pos: int, limit: int
) -> np.ndarray:
    """Rows of the lifetimes drawn as slices, in trace order: those alive at the peak first,
    then the largest (earlier first among equals), at most ``limit``. ``free_pos`` < 0: never
    freed in the trace."""
    alive_at_peak = (alloc_pos <= peak_pos) & ((free_pos < 0) | (free_pos > peak_pos))
    order = np.lexsort((alloc_pos, -size, ~alive_at_peak))
    return np.sort(order[: max(0, limit)])


def stack_frames_text(frames: SnapshotFrames, stack_ids: set[int]) -> dict[int, list[str]]:
    """The top frames (innermost first, interpreter and allocator internals left out) of each
    stack in ``stack_ids``, as ``file:line in function``."""
    stacks = frames.stacks[frames.stacks["stack_id"].isin(list(stack_ids))]
    if stacks.empty:
        return {}
    kinds = classify_frames(frames.stack_frames)
    table = frames.stack_frames.set_index("frame_id")
    shown = stacks[stacks["frame_id"].map(kinds).to_numpy() != "internal"].sort_values(["stack_id", "depth"])
    out: dict[int, list[str]] = {}
    for stack_id, frame_id in zip(shown["stack_id"], shown["frame_id"], strict=True):
        labels = out.setdefault(int(stack_id), [])
        if len(labels) < STACK_FRAMES:
            row = table.loc[frame_id]
            labels.append(frame_label(str(row["filename"]), int(row["line"]), str(row["name"])))
    return out


@dataclass(frozen=True)
class _Slices:
    events: list[dict[str, Any]]
    kept: int
    total: int


def _slice_events(
    frames: SnapshotFrames, mem: DeviceMemory, ts: np.ndarray, tids: dict[int, int], limit: int
) -> _Slices:
    lt = mem.lifetimes
    index = mem.events["event_index"].to_numpy()
    alloc_pos = event_positions(index, lt["event_index"].to_numpy())
    free_index = lt["free_index"].to_numpy(dtype=np.int64, na_value=-1)
    free_pos = np.where(free_index >= 0, event_positions(index, free_index), -1)
    peak_pos = int(np.searchsorted(index, mem.timeline.peak_index))
    sizes = lt["size_bytes"].to_numpy(dtype=np.int64)
    addresses = lt["address"].to_numpy(dtype=np.int64)
    rows = select_slices(sizes, alloc_pos, free_pos, peak_pos, limit)
    stack_ids = lt["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    stacks = stack_frames_text(frames, {int(s) for s in stack_ids[rows] if s >= 0})
    streams = mem.events["stream"].to_numpy()
    events: list[dict[str, Any]] = []
    for row in rows:
        start, end = int(alloc_pos[row]), int(free_pos[row])
        common = {"name": str(mem.lifetime_categories[row]), "cat": "allocation", "id": int(index[start])}
        common |= {"pid": mem.device, "tid": tids[int(streams[start])]}
        size = int(sizes[row])
        args = {
            "size_bytes": size,
            "size": format_bytes(size),
            "address": hex(int(addresses[row])),
            "stream": int(streams[start]),
            "category": common["name"],
            "alive_at_dump": end < 0,
            "stack": stacks.get(int(stack_ids[row]), []),
        }
        events.append({**common, "ph": "b", "ts": float(ts[start]), "args": args})
        events.append({**common, "ph": "e", "ts": float(ts[end] if end >= 0 else ts[-1])})
    return _Slices(events, int(rows.size), len(lt))


# --------------------------------------------------------------------------- the trace


def _names(device: int, source: str, tids: dict[int, int]) -> Iterator[dict[str, Any]]:
    """Metadata: the process named after the device, one thread per stream."""
    yield {
        "name": "process_name",
        "ph": "M",
        "ts": 0,
        "pid": device,
        "tid": 0,
        "args": {"name": f"GPU {device} memory"},
    }
    yield {"name": "process_labels", "ph": "M", "ts": 0, "pid": device, "tid": 0, "args": {"labels": source}}
    yield {"name": "thread_name", "ph": "M", "ts": 0, "pid": device, "tid": COUNTER_TID, "args": {"name": "counters"}}
    for stream, tid in tids.items():
        label = "stream 0 (default)" if stream == 0 else f"stream {hex(stream)}"
        yield {"name": "thread_name", "ph": "M", "ts": 0, "pid": device, "tid": tid, "args": {"name": label}}


def _oom_events(mem: DeviceMemory, ts: np.ndarray) -> list[dict[str, Any]]:
    return [
        {"name": marker.label, "ph": "i", "s": "p", "ts": float(ts[int(marker.x)]), "pid": mem.device, "tid": 0}
        for marker in mem.timeline.ooms
    ]


def device_trace(
    frames: SnapshotFrames, mem: DeviceMemory, origin_us: int | None, source: str, max_slices: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One device's events and what ``otherData`` says about them."""
    ts = trace_clock(mem.events["time_us"], origin_us)
    streams = sorted({int(s) for s in mem.events["stream"].unique()})
    tids = {stream: i + 1 for i, stream in enumerate(streams)}
    events = list(_names(mem.device, source, tids))
    changes: dict[str, int] = {}
    kept: dict[str, int] = {}
    series = {
        "allocated": mem.allocated_bytes,
        "reserved": mem.timeline.reserved_bytes,
        "requested": mem.timeline.requested_bytes,
    }
    for name, values in series.items():
        counter, changes[name] = _counter_events(name, mem.device, ts, values)
        events += counter
        kept[name] = len(counter)
    if mem.categories is not None:
        counter, changes["category"] = _category_events(mem.device, ts, mem.categories)
        events += counter
        kept["category"] = len(counter)
    slices = _slice_events(frames, mem, ts, tids, max_slices)
    events += slices.events + _oom_events(mem, ts)
    about = {
        "trace_covers_start": not mem.timeline.anchored_at_end,
        "peak_allocated_bytes": int(mem.allocated_bytes.max()),
        "peak_reserved_bytes": mem.timeline.peak_reserved_bytes,
        "peak_requested_bytes": mem.timeline.peak_requested_bytes,
        "counter_changes": changes,
        "counter_points": kept,
        "allocations_in_trace": slices.total,
        "allocation_slices": slices.kept,
    }
    return events, about


def build_perfetto_trace(
    frames: SnapshotFrames,
    *,
    source: str,
    version: str,
    max_slices: int = DEFAULT_MAX_SLICES,
    category_rules: CategoryRules | None = None,
) -> dict[str, Any]:
    """The whole trace (see the module docstring) as a JSON-ready dict; ``category_rules``: the
    user's categories, counted and named like the built-in ones."""
    times = frames.events["time_us"]
    origin = int(times.min()) if len(times) and times.notna().all() else None
    events: list[dict[str, Any]] = []
    devices: dict[str, Any] = {}
    for device in frames.info.trace_devices:
        mem = device_memory(frames, device, category_rules)
        if mem is None:
            devices[str(device)] = {"note": "fewer than two trace entries: nothing over time"}
            continue
        device_events, devices[str(device)] = device_trace(frames, mem, origin, source, max_slices)
        events += device_events
    other: dict[str, Any] = {
        "generator": f"snaplab {version}",
        "snapshot": source,
        "clock": WALL_CLOCK if origin is not None else EVENT_ORDER_CLOCK,
        "time_origin_unix_us": origin,
        "slices": f"per device at most {max_slices}: those alive at the requested peak, then the largest",
        "counters": f"one point per change; over {MAX_COUNTER_POINTS} changes, each run's lowest and highest",
        "devices": devices,
    }
    if category_rules is not None:  # only when asked for (export --category)
        other["category_rules"] = category_rules.to_dict()
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
