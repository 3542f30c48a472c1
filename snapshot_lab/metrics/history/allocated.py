"""torch's ``allocated_bytes.all.current`` after every trace event, rebuilt from the trace.

The trace records requests before rounding, but the allocator counts whole blocks. Almost every
block is the request rounded by :func:`~snapshot_lab.metrics.allocator.model.round_size`; two
kinds are larger:

- blocks alive before the trace began: their size is the start state's
  (:func:`~snapshot_lab.metrics.allocator.state.start_state`), read where the trace frees them;
- large-pool blocks the allocator did not split (a non-expandable segment, and a remainder
  <= 1 MiB, or a request >= ``max_split_size``): the block runs to the next allocated block or
  to the segment's end. Only those allocations need the state at their moment, so only the
  large pool's allocations, frees and segments are stepped through, as address intervals;
  everything else is a numpy pass over the whole trace.

A block counts from its ``alloc`` to its ``free_requested`` (torch subtracts it there, not when a
stream's use ends), or its ``free_completed`` when no ``free_requested`` came first. The series
is anchored at the dump's exact value. A trace the interval pass cannot follow (expandable
segments recorded under settings that say otherwise) is replayed through the allocator model
(:func:`replay_block_sizes`), the reference both give the same result as.
"""

from __future__ import annotations

import bisect

import numpy as np

from ...frames import SnapshotFrames
from ..allocator.model import (
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorSettings,
    CachingAllocatorModel,
    recorded_settings,
    round_size,
)
from ..allocator.state import StartState, next_alloc_small, seed, start_state

_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED, _SEGMENT_ALLOC, _SEGMENT_FREE, _MAPPING, _OTHER = range(7)
_CODES = {
    "alloc": _ALLOC,
    "free_requested": _FREE_REQUESTED,
    "free_completed": _FREE_COMPLETED,
    "segment_alloc": _SEGMENT_ALLOC,
    "segment_free": _SEGMENT_FREE,
    "segment_map": _MAPPING,
    "segment_unmap": _MAPPING,
}


def allocated_levels(frames: SnapshotFrames, device: int, allocated_at_end: int) -> np.ndarray:
    """torch's ``allocated_bytes.all.current`` after every trace event of ``device`` (int64, one
    value per event, in trace order), anchored so its last value is ``allocated_at_end`` (the
    dump's ``allocated_bytes.all.current``). See the module docstring for how each block's size
    is known."""
    settings = recorded_settings(frames.info.allocator_settings)
    ev = frames.device_events(device)
    actions = ev["action"].astype(str).to_numpy()
    kind = np.array([_CODES.get(a, _OTHER) for a in actions], dtype=np.int8) if actions.size else np.zeros(0, np.int8)
    address = ev["address"].to_numpy(dtype=np.int64, na_value=-1)
    size = ev["size_bytes"].to_numpy(dtype=np.int64)
    state = start_state(frames, device, settings)
    if np.any(kind == _MAPPING) and not settings.expandable_segments:
        block = replay_block_sizes(state, settings, actions, address, size, ev["stream"].to_numpy(dtype=np.int64))
    else:
        block = _block_sizes(state, settings, kind, address, size)
    series = np.cumsum(_changes(kind, address, block))
    if series.size:
        series += allocated_at_end - int(series[-1])
    return series


def _rounded(size: np.ndarray, settings: AllocatorSettings) -> np.ndarray:
    """:func:`round_size` of every element (the trace holds few distinct sizes)."""
    if size.size == 0:
        return size.copy()
    distinct, where = np.unique(size, return_inverse=True)
    return np.array([round_size(int(n), settings) for n in distinct], dtype=np.int64)[where.reshape(-1)]


def _block_sizes(
    state: StartState, settings: AllocatorSettings, kind: np.ndarray, address: np.ndarray, size: np.ndarray
) -> np.ndarray:
    """The size of the block each ``alloc`` made and each free released (0 elsewhere)."""
    block = np.where(np.isin(kind, (_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED)), _rounded(size, settings), 0)
    if not settings.expandable_segments:  # expandable segments split every remainder: no slack
        _add_unsplit_remainders(state, settings, kind, address, size, block)
    _frees_take_their_blocks(state, kind, address, size, block)
    return block


def _add_unsplit_remainders(
    state: StartState,
    settings: AllocatorSettings,
    kind: np.ndarray,
    address: np.ndarray,
    size: np.ndarray,
    block: np.ndarray,
) -> None:
    """Large-pool allocations the allocator did not split: their block runs to the next allocated
    block or the segment's end. Only the large pool's allocations, the frees of its blocks and
    its segments are stepped through."""
    seeded = [s for s in state.segments if not s.small and not s.expandable]
    seg_starts = sorted(s.address for s in seeded)
    seg_end = {s.address: s.address + s.size for s in seeded}
    taken = sorted(a for s in seeded for a, _, allocated in s.blocks() if allocated)
    large_alloc = (kind == _ALLOC) & (block > SMALL_SIZE)
    new_segment = (kind == _SEGMENT_ALLOC) & (size != SMALL_BUFFER)
    held = np.union1d(address[large_alloc], np.array(taken, dtype=np.int64))
    steps = large_alloc | new_segment | (kind == _SEGMENT_FREE) | ((kind == _FREE_COMPLETED) & np.isin(address, held))
    _step_large_pool(settings, kind, address, size, block, np.flatnonzero(steps), seg_starts, seg_end, taken)


def _step_large_pool(
    settings: AllocatorSettings,
    kind: np.ndarray,
    address: np.ndarray,
    size: np.ndarray,
    block: np.ndarray,
    steps: np.ndarray,
    seg_starts: list[int],
    seg_end: dict[int, int],
    taken: list[int],
) -> None:
    """The large pool's allocated blocks and its segments as sorted addresses, stepped through
    ``steps``; each allocation takes the free space up to the next of them when the allocator
    would not have split it."""
    for i in steps.tolist():
        k, a = kind[i], int(address[i])
        if k == _ALLOC:
            n = int(block[i])
            s = bisect.bisect_right(seg_starts, a) - 1
            end = seg_end[seg_starts[s]] if s >= 0 and a < seg_end[seg_starts[s]] else a + n
            j = bisect.bisect_right(taken, a)
            if j < len(taken) and taken[j] < end:
                end = taken[j]
            if n <= end - a and (n >= settings.max_split_size or end - a - n <= SMALL_SIZE):
                block[i] = end - a
            bisect.insort(taken, a)
        elif k == _FREE_COMPLETED:
            j = bisect.bisect_left(taken, a)
            if j < len(taken) and taken[j] == a:
                del taken[j]
        elif k == _SEGMENT_ALLOC:
            bisect.insort(seg_starts, a)
            seg_end[a] = a + int(size[i])
        elif k == _SEGMENT_FREE and a in seg_end:
            del seg_end[a]
            seg_starts.remove(a)


def _groups(address: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` ordered by (address, trace position), and where each one's address group starts
    in that order."""
    order = rows[np.lexsort((rows, address[rows]))]
    addr = address[order]
    first = np.r_[True, addr[1:] != addr[:-1]] if order.size else np.zeros(0, dtype=bool)
    return order, np.maximum.accumulate(np.where(first, np.arange(order.size), 0))


def _last_before(flag: np.ndarray, group_start: np.ndarray, inclusive: bool) -> np.ndarray:
    """Per row (in address order), the last row of its group at or before it (``inclusive``)
    or strictly before it where ``flag`` holds; -1 when none."""
    marks = np.where(flag, np.arange(flag.size), -1)
    if not inclusive:
        marks = np.r_[-1, marks[:-1]]
    last = np.maximum.accumulate(marks) if marks.size else marks
    return np.where(last >= group_start, last, -1)


def _frees_take_their_blocks(
    state: StartState, kind: np.ndarray, address: np.ndarray, size: np.ndarray, block: np.ndarray
) -> None:
    """A free releases the block of the last ``alloc`` at its address (when it records the same
    request: otherwise the trace lost the pairing and the free's own rounded request is taken, as
    the model does); before any, a block alive when the trace began (the start state's size,
    until a ``free_completed`` retired it)."""
    rows = np.flatnonzero(np.isin(kind, (_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED)))
    order, group_start = _groups(address, rows)
    k = kind[order]
    owner = _last_before(k == _ALLOC, group_start, inclusive=True)
    retired = _last_before(k == _FREE_COMPLETED, group_start, inclusive=False)
    frees = k != _ALLOC
    by_alloc = frees & (owner >= 0)
    by_alloc[by_alloc] = size[order[by_alloc]] == size[order[owner[by_alloc]]]
    block[order[by_alloc]] = block[order[owner[by_alloc]]]
    at_start = {a: n for s in state.segments for a, n, allocated in s.blocks() if allocated}
    for j in np.flatnonzero(frees & (owner < 0) & (retired < 0)).tolist():
        n = at_start.get(int(address[order[j]]))
        if n is not None:
            block[order[j]] = n


def _changes(kind: np.ndarray, address: np.ndarray, block: np.ndarray) -> np.ndarray:
    """How much each event changed the allocated bytes: ``+block`` at ``alloc``, ``-block`` at
    ``free_requested``, and at ``free_completed`` unless a ``free_requested`` already did."""
    out = np.where(kind == _ALLOC, block, 0) - np.where(kind == _FREE_REQUESTED, block, 0)
    rows = np.flatnonzero((kind == _FREE_REQUESTED) | (kind == _FREE_COMPLETED))
    order, group_start = _groups(address, rows)
    requested = kind[order] == _FREE_REQUESTED
    previous = _last_before(np.ones(order.size, dtype=bool), group_start, inclusive=False)
    already = np.zeros(order.size, dtype=bool)
    has_previous = previous >= 0
    already[has_previous] = requested[previous[has_previous]]
    completed = order[~requested & ~already]
    out[completed] -= block[completed]
    return out.astype(np.int64)


def replay_block_sizes(
    state: StartState,
    settings: AllocatorSettings,
    actions: np.ndarray,
    address: np.ndarray,
    size: np.ndarray,
    stream: np.ndarray,
) -> np.ndarray:
    """The size of the block each ``alloc`` made and each free released (0 elsewhere), by
    replaying the trace through the allocator model as recorded (about 25 µs an event): the
    reference the interval pass of :func:`allocated_levels` matches."""
    model = CachingAllocatorModel(settings, None, follows_trace=True)
    live = dict(seed(model, state))
    out = np.zeros(actions.size, dtype=np.int64)
    for i in range(actions.size):
        act, a, n = actions[i], int(address[i]), int(size[i])
        if act == "alloc":
            made = model.follow_alloc(a, n)
            if made is not None:
                live[a] = made
            out[i] = made.size if made is not None else round_size(n, settings)
        elif act in ("free_requested", "free_completed"):
            held = live.get(a)
            out[i] = held.size if held is not None else round_size(n, settings)
            if act == "free_completed" and held is not None:
                model.free(live.pop(a))
        elif act == "segment_alloc":
            model.follow_segment_alloc(a, n, int(stream[i]), n == SMALL_BUFFER)
        elif act == "segment_free":
            model.follow_segment_free(a)
        elif act == "segment_map":
            model.follow_map(a, n, int(stream[i]), next_alloc_small(actions, size, i))
        elif act == "segment_unmap":
            model.follow_unmap(a, n)
    return out
