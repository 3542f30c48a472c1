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

import numpy as np

from ...frames import SnapshotFrames
from .._memo import memo
from ..categories.stacks import stacks_with_frame
from .model import SMALL_BUFFER, UNLIMITED, recorded_settings

# 'flush': the allocator freed its cache to retry a cudaMalloc that then succeeded
# 'oom': the same, but the retry failed (an OOM follows)
CAUSES = ("empty_cache", "oom", "flush", "allocator", "unknown")
_NEW_SEGMENT = ("segment_alloc", "segment_map")
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
    action: np.ndarray  # each event's action name (str objects)
    new_segment: np.ndarray  # the event makes a segment (segment_alloc / segment_map)
    segment_gone: np.ndarray  # the event gives one back (segment_free / segment_unmap)
    size: np.ndarray
    stack: np.ndarray
    time: np.ndarray
    reserved_before: np.ndarray  # reserved memory before each event
    frees_have_stacks: bool  # the trace records stacks on frees (context='all')


def _columns(frames: SnapshotFrames, device: int) -> _TraceColumns:
    events = frames.device_events(device)
    # the action column is categorical: names and tests come from its few categories, not from
    # a string per event (a million str conversions and string searches at 1M entries)
    codes = events["action"].cat.codes.to_numpy()
    categories = list(events["action"].cat.categories)
    action = np.asarray(categories, dtype=object)[codes]

    def among(names: list[str]) -> np.ndarray:
        return np.isin(codes, [code for code, name in enumerate(categories) if name in names])

    size = events["size_bytes"].to_numpy(dtype=np.int64)
    sid = events["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    new_segment, segment_gone = among(list(_NEW_SEGMENT)), among(["segment_free", "segment_unmap"])
    delta = np.where(new_segment, size, 0) - np.where(segment_gone, size, 0)
    at_dump = int(frames.segments.loc[frames.segments["device"] == device, "total_size_bytes"].sum())
    # reserved after each event
    after = at_dump - (int(delta.sum()) - np.cumsum(delta))
    frees = among(["free_requested", "free_completed", "segment_free", "segment_unmap"])
    return _TraceColumns(
        action=action,
        new_segment=new_segment,
        segment_gone=segment_gone,
        size=size,
        stack=sid,
        time=events["time_us"].to_numpy(dtype=np.float64, na_value=np.nan),
        reserved_before=after - delta,
        frees_have_stacks=bool((sid[frees] >= 0).any()),
    )


def _is_flush(
    cols: _TraceColumns,
    start: int,
    stop: int,
    stacks: set[int],
    self_releasing: bool,
) -> bool:
    """Whether the release at [s, e), followed by a new segment, is the allocator's flush."""
    inside_allocation = bool(stacks) or cols.frees_have_stacks
    if not inside_allocation:
        return False
    if not self_releasing:
        return True
    freed_small = (cols.action[start:stop] == "segment_free") & (cols.size[start:stop] == SMALL_BUFFER)
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


def _cause(cols: _TraceColumns, signs: _Signs, start: int, stop: int, first: str) -> str:
    stacks = set(cols.stack[start:stop].tolist()) - {-1}
    if stacks & signs.empty_cache:
        return "empty_cache"
    if first == "oom":
        return "oom"
    if first in _NEW_SEGMENT and (
        stacks & signs.flush_frames
        or _is_flush(
            cols,
            start,
            stop,
            stacks,
            signs.self_releasing,
        )
    ):
        return "flush"
    if stacks or (signs.self_releasing and first in _NEW_SEGMENT):
        return "allocator"
    return "unknown"


def _time(cols: _TraceColumns, row: int) -> int | None:
    return None if np.isnan(cols.time[row]) else int(cols.time[row])


def _span_us(cols: _TraceColumns, start: int, end: int) -> int | None:
    start_us, end_us = _time(cols, start), _time(cols, end)
    return None if start_us is None or end_us is None else end_us - start_us


def _find(frames: SnapshotFrames, device: int) -> list[Release]:
    cols = _columns(frames, device)
    action, size = cols.action, cols.size
    signs = _signs(frames)
    new = cols.new_segment
    idx = np.flatnonzero(cols.segment_gone)
    if idx.size == 0:
        return []
    starts = idx[np.r_[True, np.diff(idx) > 1]]
    ends = idx[np.r_[np.diff(idx) > 1, True]] + 1
    out = []
    for index, (start, stop) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        next_start = int(starts[index + 1]) if index + 1 < starts.size else action.size
        following = np.flatnonzero(action[stop:next_start] != "snapshot")
        after = stop + int(following[0]) if following.size else -1
        first = str(action[after]) if after >= 0 else ""
        out.append(
            Release(
                start=start,
                end=stop,
                segments=stop - start,
                bytes=int(size[start:stop].sum()),
                cause=_cause(cols, signs, start, stop, first),
                reserved_again_bytes=int(size[stop:next_start][new[stop:next_start]].sum()),
                followed_by=first,
                reserved_before_bytes=int(cols.reserved_before[start]),
                next_segment_bytes=int(size[after]) if first in _NEW_SEGMENT else 0,
                time_us=_time(cols, start),
                duration_us=_span_us(cols, start, after) if first in _NEW_SEGMENT else None,
            )
        )
    return out


def find_releases(frames: SnapshotFrames, device: int) -> list[Release]:
    """The device's releases in trace order (computed once per snapshot)."""
    return memo(frames, ("releases", device), lambda: _find(frames, device))
