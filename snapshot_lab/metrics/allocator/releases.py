"""Releases: runs of segment frees (or unmaps) in a trace, and who made each one.

Memory goes back to CUDA when the program calls ``torch.cuda.empty_cache()``, or when the
allocator makes room inside an allocation (garbage collection, freeing oversize blocks, or
freeing its whole cache to retry a cudaMalloc that failed). The free events record the stack
of the moment: a Python ``empty_cache`` frame says the program did it; the stack of some other
operation says it happened inside that operation's allocation. Events recorded without a stack
(the autograd thread with Python stacks, or ``context`` not recording frees) leave the cause to
the allocator model (:mod:`.whatif`), unless the trace records stacks on its other frees: then
a release without one ran on a thread with no Python stack, which is not the program calling
``empty_cache()``.

A *flush* is ``release_cached_blocks`` inside ``malloc``: cudaMalloc failed, the allocator
freed every unsplit cached segment of both pools and retried, and the retry got its segment
(torch counts it in ``memory_stats()['num_alloc_retries']``). It sits right before the new
segment of the allocation that needed it (its position), and no ``empty_cache`` frame is in its
stack. Under PyTorch's default settings nothing else gives memory back inside an allocation;
with garbage collection or ``max_split_size`` on, those release large-pool segments only, so a
release inside an allocation that frees a small-pool segment (2 MiB) is a flush.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo
from ..categories.stacks import stacks_with_frame
from ..history.timeline import NEW_SEGMENT, SEGMENT_GONE, ReservedSteps, reserved_steps
from .model import SMALL_BUFFER, UNLIMITED, recorded_settings

# 'flush': the allocator freed its cache to retry a cudaMalloc that then succeeded
# 'oom': the same, but the retry failed (an OOM follows)
CAUSES = ("empty_cache", "oom", "flush", "allocator", "unknown")
_FREES = ("free_requested", "free_completed")
# C++ frames (stacks='all') of the allocator's own flush
_RELEASE_FRAMES = ("release_cached_blocks",)


@dataclass(frozen=True)
class Release:
    start: int  # position of its first event in the device's trace
    end: int  # position after its last event
    segments: int
    bytes: int
    cause: str  # one of CAUSES
    # segments reserved after it, before the next release
    reserved_again_bytes: int
    followed_by: str  # the first action after it ('' at the end of the trace)
    # reserved memory just before it (the trace anchored at the dump)
    reserved_before_bytes: int = 0
    next_segment_bytes: int = 0  # the new segment right after it (0: none)
    time_us: int | None = None  # of its first event
    # from its first event to the new segment right after it
    duration_us: int | None = None


@dataclass(frozen=True)
class _TraceColumns:
    """The trace at its segment events: every column is kept whole only where it is a view of
    the events frame (the action codes, the sizes); the rest is taken at the rows a release
    reads, so finding the releases costs a few bytes per event (at 5M entries a column per
    event in int64 or objects was 40 MB each, 230 MB at once)."""

    codes: np.ndarray  # each event's action code (a view of the categorical's codes)
    names: list[str]  # action name of each code
    size: np.ndarray
    reserved: ReservedSteps  # reserved memory at the segment events
    gone: np.ndarray  # rows that give a segment back (SEGMENT_GONE), in order
    gone_stack: np.ndarray  # the stack of each of those (-1: none)
    new: np.ndarray  # rows that make a segment (NEW_SEGMENT), in order
    new_reserved: np.ndarray  # bytes reserved by new segments before each of ``new``, then the total
    time: Any  # the time column (microseconds, nullable), read at a few rows
    frees_have_stacks: bool  # the trace records stacks on frees (context='all')

    def code(self, name: str) -> int:
        """The code of action ``name`` (-2, which no event has, where the trace has none)."""
        return self.names.index(name) if name in self.names else -2

    def name(self, row: int) -> str:
        return self.names[int(self.codes[row])]


def _columns(frames: SnapshotFrames, device: int) -> _TraceColumns:
    events = frames.device_events(device)
    # the action column is categorical: names and tests come from its few categories, not from
    # a string per event (a million str conversions and string searches at 1M entries)
    codes = events["action"].cat.codes.to_numpy()
    names = [str(name) for name in events["action"].cat.categories]

    size = events["size_bytes"].to_numpy(dtype=np.int64)
    at_dump = int(frames.segments.loc[frames.segments["device"] == device, "total_size_bytes"].sum())
    reserved = reserved_steps(events, at_dump)
    new, gone = reserved.rows[reserved.adds], reserved.rows[~reserved.adds]
    stack = events["stack_id"]
    frees = np.isin(codes, [code for code, name in enumerate(names) if name in (*_FREES, *SEGMENT_GONE)])
    return _TraceColumns(
        codes=codes,
        names=names,
        size=size,
        reserved=reserved,
        gone=gone,
        gone_stack=stack.iloc[gone].to_numpy(dtype=np.int64, na_value=-1),
        new=new,
        new_reserved=np.concatenate([[0], np.cumsum(size[new])]),
        time=events["time_us"].array,
        frees_have_stacks=bool((stack.notna().to_numpy() & frees).any()),
    )


def _is_flush(cols: _TraceColumns, rows: slice, stacks: set[int], self_releasing: bool) -> bool:
    """Whether the release of ``cols.gone[rows]``, followed by a new segment, is the allocator's
    flush."""
    inside_allocation = bool(stacks) or cols.frees_have_stacks
    if not inside_allocation:
        return False
    if not self_releasing:
        return True
    at = cols.gone[rows]
    freed_small = (cols.codes[at] == cols.code("segment_free")) & (cols.size[at] == SMALL_BUFFER)
    return bool(freed_small.any())


@dataclass(frozen=True)
class _Signs:
    """What tells who made a release: the stacks that mark the program's ``empty_cache()`` and
    the allocator's own flush, and whether the allocator releases inside allocations by itself."""

    empty_cache: set[int]
    flush_frames: set[int]
    self_releasing: bool


def _signs(frames: SnapshotFrames) -> _Signs:
    settings = recorded_settings(frames.info.allocator_settings)
    return _Signs(
        empty_cache=stacks_with_frame(frames, "empty_cache"),
        flush_frames=set().union(*(stacks_with_frame(frames, name) for name in _RELEASE_FRAMES)),
        # with these, the allocator gives memory back inside allocations by itself
        self_releasing=settings.garbage_collection_threshold > 0 or settings.max_split_size != UNLIMITED,
    )


def _cause(cols: _TraceColumns, signs: _Signs, rows: slice, first: str) -> str:
    stacks = set(cols.gone_stack[rows].tolist()) - {-1}
    if stacks & signs.empty_cache:
        return "empty_cache"
    if first == "oom":
        return "oom"
    if first in NEW_SEGMENT and (stacks & signs.flush_frames or _is_flush(cols, rows, stacks, signs.self_releasing)):
        return "flush"
    if stacks or (signs.self_releasing and first in NEW_SEGMENT):
        return "allocator"
    return "unknown"


def _time(cols: _TraceColumns, row: int) -> int | None:
    value = cols.time[row]
    return None if pd.isna(value) else int(value)


def _span_us(cols: _TraceColumns, start: int, end: int) -> int | None:
    start_us, end_us = _time(cols, start), _time(cols, end)
    return None if start_us is None or end_us is None else end_us - start_us


def _first_not(cols: _TraceColumns, start: int, stop: int, code: int) -> int:
    """The first row in [start, stop) whose action is not ``code`` (-1: none)."""
    if start < stop and cols.codes[start] != code:  # the usual case: no snapshot marker there
        return start
    other = np.flatnonzero(cols.codes[start:stop] != code)
    return start + int(other[0]) if other.size else -1


def _runs(gone: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of consecutive rows in ``gone`` begins and ends (indices into it)."""
    breaks = np.flatnonzero(np.diff(gone) > 1) + 1
    return np.r_[0, breaks], np.r_[breaks, gone.size]


def _find(frames: SnapshotFrames, device: int) -> list[Release]:
    cols = _columns(frames, device)
    if cols.gone.size == 0:
        return []
    signs = _signs(frames)
    snapshot = cols.code("snapshot")
    lows, highs = _runs(cols.gone)
    starts, stops = cols.gone[lows], cols.gone[highs - 1] + 1
    # the bytes of new segments between each release and the next (or the end of the trace)
    next_starts = np.r_[starts[1:], cols.codes.size]
    new_between = (
        cols.new_reserved[np.searchsorted(cols.new, next_starts)] - cols.new_reserved[np.searchsorted(cols.new, stops)]
    )
    out = []
    for index, (low, high) in enumerate(zip(lows.tolist(), highs.tolist(), strict=True)):
        start, stop, rows = int(starts[index]), int(stops[index]), slice(low, high)
        after = _first_not(cols, stop, int(next_starts[index]), snapshot)
        first = cols.name(after) if after >= 0 else ""
        out.append(
            Release(
                start=start,
                end=stop,
                segments=stop - start,
                bytes=int(cols.size[start:stop].sum()),
                cause=_cause(cols, signs, rows, first),
                reserved_again_bytes=int(new_between[index]),
                followed_by=first,
                reserved_before_bytes=cols.reserved.before(start),
                next_segment_bytes=int(cols.size[after]) if first in NEW_SEGMENT else 0,
                time_us=_time(cols, start),
                duration_us=_span_us(cols, start, after) if first in NEW_SEGMENT else None,
            )
        )
    return out


def find_releases(frames: SnapshotFrames, device: int) -> list[Release]:
    """The device's releases in trace order (computed once per snapshot)."""
    return memo(frames, ("releases", device), lambda: _find(frames, device))
