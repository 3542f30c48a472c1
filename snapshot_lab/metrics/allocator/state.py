"""The allocator's state at any moment of the trace, rebuilt from the snapshot.

The snapshot gives the state at the dump exactly; the trace gives every change before it. Two
steps rebuild any earlier moment:

1. :func:`start_state`: the state just before the trace's first event, undone backwards from
   the dump. Segments: the dump's, minus those the trace cudaMalloc'd, plus those it
   cudaFree'd (for expandable segments, mapped ranges unmapped and re-mapped page-wise). Blocks
   alive at that moment: those alive at the dump whose allocation is not in the trace, and those
   the trace frees without having allocated them. Everything else in a segment was free, and
   free blocks are always coalesced, so the gaps between live blocks are the free blocks.
   This is exact except for one thing the trace does not record: when a large-pool request
   took a cached block whose remainder was too small to split (<= 1 MiB), the block was that
   much bigger than the rounded request. A block of the start state that the trace frees is
   placed with its rounded size, and the sliver joins the free gap after it, unless the trace
   shows the block's real end: the first allocation it records just past the rounded size,
   while the block is still live, starts where the block ends (a wrapped trace often holds
   one). Without that, the allocator could only have used the sliver for a request it would
   not fit in reality if that request lands in that exact gap.
2. :func:`follow`: the trace replayed from that state through
   :class:`~snapshot_lab.metrics.allocator.model.CachingAllocatorModel` *as recorded*: every
   allocation placed at its recorded address and split by the allocator's rules, every segment
   cudaMalloc'd, mapped, unmapped and freed where the trace says. Nothing is decided, so no
   setting and no memory limit is needed. At the end the state must equal the dump's; the
   ``mismatches`` count says where it did not.

A trace whose buffer wrapped therefore replays like a complete one, and the state at an OOM
that happened before the dump (``except OutOfMemoryError: _dump_snapshot(...)``) is known.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from ...frames.schema import BLOCKS_SCHEMA, SEGMENTS_SCHEMA, conform, empty_frame
from .._memo import memo
from ..history.lifetimes import device_lifetimes, orphan_frees
from .model import SMALL_BUFFER, SMALL_SIZE, AllocatorSettings, Block, CachingAllocatorModel, round_size

MiB = 1 << 20


@dataclass
class SeedSegment:
    """A segment (or a mapped range of an expandable segment) of the start state."""

    address: int
    size: int
    stream: int
    small: bool
    expandable: bool
    pool_id: tuple[int, int] = (0, 0)
    live: dict[int, int] = field(default_factory=dict)  # address -> size of blocks allocated at start

    def blocks(self) -> list[tuple[int, int, bool]]:
        """(address, size, allocated) tiling the segment; free gaps coalesced."""
        out: list[tuple[int, int, bool]] = []
        pos, end = self.address, self.address + self.size
        for a in sorted(self.live):
            n = min(self.live[a], end - a)
            if a < pos or n <= 0:
                continue  # overlaps what is already placed (inconsistent input): leave it out
            if a > pos:
                out.append((pos, a - pos, False))
            out.append((a, n, True))
            pos = a + n
        if pos < end:
            out.append((pos, end - pos, False))
        return out


@dataclass
class StartState:
    segments: list[SeedSegment]
    unplaced_blocks: int  # blocks alive at the start that fit in no segment (inconsistent input)


@dataclass
class LiveBlock:
    block: Block
    stack_id: int | None
    requested: int


@dataclass
class Followed:
    """The model after following the trace; ``live``: recorded address -> live block."""

    model: CachingAllocatorModel
    live: dict[int, LiveBlock]
    last_event: int  # event_index of the last event applied (-1: none)
    mismatches: int  # events the state could not apply as recorded
    start: StartState


def _dump_segments(frames: SnapshotFrames, device: int) -> list[SeedSegment]:
    seg = frames.segments[frames.segments["device"] == device]
    return [
        SeedSegment(int(a), int(n), int(st), p == "small", bool(x), (int(p0), int(p1)))
        for a, n, st, p, x, p0, p1 in seg[
            ["address", "total_size_bytes", "stream", "pool", "is_expandable", "pool_id_0", "pool_id_1"]
        ].itertuples(index=False)
    ]


def _undo_segment_events(segments: list[SeedSegment], ev: pd.DataFrame) -> list[SeedSegment]:
    """Walk the trace's segment events backwards from the dump's segments."""
    by_addr = {s.address: s for s in segments}
    rows = ev[ev["action"].isin(["segment_alloc", "segment_free", "segment_map", "segment_unmap"])]
    for action, a, n, st in zip(
        rows["action"].astype(str).to_numpy()[::-1],
        rows["address"].to_numpy(dtype=np.int64, na_value=-1)[::-1],
        rows["size_bytes"].to_numpy()[::-1],
        rows["stream"].to_numpy()[::-1],
        strict=True,
    ):
        a, n, st = int(a), int(n), int(st)
        if action == "segment_alloc":
            by_addr.pop(a, None)
        elif action == "segment_free":
            by_addr[a] = SeedSegment(a, n, st, n == SMALL_BUFFER, False)
        elif action == "segment_map":  # before it, these pages were not mapped: carve them out
            host = next(
                (s for s in by_addr.values() if s.expandable and s.address <= a and a + n <= s.address + s.size), None
            )
            if host is None:
                continue
            del by_addr[host.address]
            if a > host.address:
                by_addr[host.address] = SeedSegment(host.address, a - host.address, host.stream, host.small, True)
            if a + n < host.address + host.size:
                rest = host.address + host.size - (a + n)
                by_addr[a + n] = SeedSegment(a + n, rest, host.stream, host.small, True)
        elif action == "segment_unmap":  # before it, these pages were mapped: put them back
            before = next((s for s in by_addr.values() if s.expandable and s.address + s.size == a), None)
            after = by_addr.get(a + n)
            after = after if after is not None and after.expandable else None
            small = before.small if before else after.small if after else n % (20 * MiB) != 0
            start, end = a, a + n
            if before is not None:
                start = before.address
                del by_addr[before.address]
            if after is not None:
                end = after.address + after.size
                del by_addr[after.address]
            by_addr[start] = SeedSegment(start, end - start, st, small, True)
    return sorted(by_addr.values(), key=lambda s: s.address)


def start_state(frames: SnapshotFrames, device: int, settings: AllocatorSettings) -> StartState:
    """The allocator's state just before the trace's first event (see the module docstring).
    Computed once per frames, device and settings (the what-if and the training structure both
    need it): callers read it and never change it."""
    return memo(frames, ("start_state", device, settings), lambda: _start_state(frames, device, settings))


def _start_state(frames: SnapshotFrames, device: int, settings: AllocatorSettings) -> StartState:
    ev = frames.device_events(device)
    segments = _undo_segment_events(_dump_segments(frames, device), ev)
    lt = device_lifetimes(frames, device)
    surviving = lt.loc[lt["free_index"].isna(), "address"].to_numpy(dtype=np.int64)
    blk = frames.blocks[(frames.blocks["device"] == device) & (frames.blocks["state"] != "inactive")]
    blk_addr = blk["address"].to_numpy(dtype=np.int64)
    keep = ~np.isin(blk_addr, surviving)
    blk_size = blk["size_bytes"].to_numpy(dtype=np.int64)
    live: dict[int, int] = dict(zip(blk_addr[keep].tolist(), blk_size[keep].tolist(), strict=True))
    orphan = orphan_frees(ev, lt)
    freed_at: dict[int, int] = {}  # blocks of the start state the trace frees: address -> free's event_index
    for a, n, i in zip(
        orphan["address"].to_numpy(dtype=np.int64).tolist(),
        orphan["size_bytes"].to_numpy(dtype=np.int64).tolist(),
        orphan["event_index"].to_numpy(dtype=np.int64).tolist(),
        strict=True,
    ):
        if a not in live:
            live[a] = round_size(n, settings)
            freed_at[a] = i
    starts = [s.address for s in segments]
    unplaced = 0
    for a, n in live.items():
        i = bisect.bisect_right(starts, a) - 1
        if i >= 0 and a < segments[i].address + segments[i].size:
            segments[i].live[a] = n
        else:
            unplaced += 1
    _restore_unsplit_remainders(segments, freed_at, ev, settings)
    return StartState(segments, unplaced)


def _restore_unsplit_remainders(
    segments: list[SeedSegment], freed_at: dict[int, int], ev: pd.DataFrame, settings: AllocatorSettings
) -> None:
    """Give a block of the start state that the trace frees the remainder it kept unsplit,
    where the trace shows it. Such a block is placed with its rounded request, but a large-pool
    block whose remainder was too small to split is longer (by <= 1 MiB; below
    ``max_non_split_rounding`` for a request >= ``max_split_size``). While it is live, the free
    block after it starts at its real end, and allocations take free blocks from their start:
    so the trace's first allocation in that window, before the block's free, is at its end."""
    windows = []  # (segment, block address, rounded size, slack, where the next live block starts)
    for seg in segments:
        if seg.small or seg.expandable:
            continue  # the small pool and expandable segments split every remainder >= 512 B
        taken = sorted(seg.live)
        for k, a in enumerate(taken):
            if a in freed_at:
                n = seg.live[a]
                slack = SMALL_SIZE if n < settings.max_split_size else settings.max_non_split_rounding - 1
                windows.append((seg, a, n, slack, taken[k + 1] if k + 1 < len(taken) else seg.address + seg.size))
    if not windows:
        return
    allocs = ev.loc[(ev["action"] == "alloc") & ev["address"].notna(), ["address", "event_index"]]
    order = np.argsort(allocs["address"].to_numpy(dtype=np.int64), kind="stable")
    addrs = allocs["address"].to_numpy(dtype=np.int64)[order]
    when = allocs["event_index"].to_numpy(dtype=np.int64)[order]
    for seg, a, n, slack, following in windows:
        lo, hi = np.searchsorted(addrs, a + n, "left"), np.searchsorted(addrs, a + n + slack, "right")
        earlier = np.flatnonzero(when[lo:hi] < freed_at[a])
        if earlier.size:  # the first allocation in the window, before the block's free
            end = int(addrs[lo + earlier[np.argmin(when[lo:hi][earlier])]])
            if a + n < end <= following:
                seg.live[a] = end - a


def seed(model: CachingAllocatorModel, state: StartState) -> dict[int, Block]:
    """Put the start state into a fresh model; returns its live blocks by address."""
    live: dict[int, Block] = {}
    groups: dict[tuple[int, bool], list[tuple[int, list[tuple[int, int, bool]]]]] = {}
    for s in state.segments:
        if s.expandable:
            groups.setdefault((s.stream, s.small), []).append((s.address, s.blocks()))
        else:
            for b in model.seed_segment(s.address, s.stream, s.small, s.blocks()):
                live[b.addr] = b
    for (stream, small), ranges in groups.items():
        for b in model.seed_expandable(stream, small, ranges):
            live[b.addr] = b
    return live


def live_at_start(state: StartState) -> list[tuple[int, int, int]]:
    """The blocks alive at the trace's start as (recorded address, size, stream), in address
    order (the closest the snapshot comes to the order they were allocated in: a cache grows
    upwards from empty, and the model's parameters, allocated first, sit lowest)."""
    return sorted((a, n, s.stream) for s in state.segments for a, n in s.live.items())


def place_from_empty(model: CachingAllocatorModel, blocks: list[tuple[int, int, int]]) -> dict[int, Block]:
    """Allocate ``blocks`` (:func:`live_at_start`) in a fresh model, each where the model's
    settings put it: the cache those blocks alone would have built under those settings.
    Returns the model's blocks by recorded address; raises OutOfMemory when they do not fit
    under the model's limit."""
    return {address: model.malloc(size, stream) for address, size, stream in blocks}


def next_alloc_small(actions: np.ndarray, sizes: np.ndarray, i: int) -> bool:
    """Whether the mapping at trace position ``i`` was made for the small pool: the pool of the
    allocation it was made for, the next ``alloc`` after it (within 64 entries; large when
    none). ``actions`` and ``sizes`` are the trace's columns, in trace order."""
    for j in range(i + 1, min(i + 64, actions.size)):
        if actions[j] == "alloc":
            return bool(sizes[j] <= SMALL_SIZE)
    return False


def follow(frames: SnapshotFrames, device: int, settings: AllocatorSettings, stop_after: int | None = None) -> Followed:
    """The trace applied as recorded from :func:`start_state`, through event ``stop_after``
    (inclusive; all events when None)."""
    state = start_state(frames, device, settings)
    model = CachingAllocatorModel(settings, None, follows_trace=True)
    blocks = seed(model, state)
    dump = frames.blocks[frames.blocks["device"] == device]
    dump_info = {
        int(a): (None if pd.isna(s) else int(s), int(r) if not pd.isna(r) else int(n))
        for a, s, r, n in zip(
            dump["address"], dump["stack_id"], dump["requested_size_bytes"], dump["size_bytes"], strict=True
        )
    }
    live = {a: LiveBlock(b, *dump_info.get(a, (None, b.size))) for a, b in blocks.items()}
    ev = frames.device_events(device)
    if stop_after is not None:
        ev = ev[ev["event_index"] <= stop_after]
    actions = ev["action"].astype(str).to_numpy()
    addr = ev["address"].to_numpy(dtype=np.int64, na_value=-1)
    size = ev["size_bytes"].to_numpy()
    stream = ev["stream"].to_numpy()
    sid = ev["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    mismatches = 0
    for i in range(actions.size):
        act, a = actions[i], int(addr[i])
        if act == "alloc":
            b = model.follow_alloc(a, int(size[i]))
            if b is None:
                mismatches += 1
            else:
                live[a] = LiveBlock(b, int(sid[i]) if sid[i] >= 0 else None, int(size[i]))
        elif act == "free_completed":
            lb = live.pop(a, None)
            if lb is None:
                mismatches += 1
            else:
                model.free(lb.block)
        elif act == "segment_alloc":
            model.follow_segment_alloc(a, int(size[i]), int(stream[i]), int(size[i]) == SMALL_BUFFER)
        elif act == "segment_free":
            mismatches += not model.follow_segment_free(a)
        elif act == "segment_map":
            small = next_alloc_small(actions, size, i)
            mismatches += not model.follow_map(a, int(size[i]), int(stream[i]), small)
        elif act == "segment_unmap":
            mismatches += not model.follow_unmap(a, int(size[i]))
    last = int(ev["event_index"].iloc[-1]) if len(ev) else -1
    return Followed(model, live, last, mismatches + state.unplaced_blocks, state)


def followed_tables(frames: SnapshotFrames, device: int, followed: Followed) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``segments`` and ``blocks`` frames (the snapshot's schemas) of a followed state, so the
    metrics that read a snapshot's layout read this moment's the same way."""
    dump = frames.segments[frames.segments["device"] == device]
    private = {
        int(a): (int(p0), int(p1))
        for a, p0, p1 in zip(dump["address"], dump["pool_id_0"], dump["pool_id_1"], strict=True)
        if (int(p0), int(p1)) != (0, 0)
    }
    by_block = {id(lb.block): lb for lb in followed.live.values()}
    seg_rows: dict[str, list[object]] = {k: [] for k in SEGMENTS_SCHEMA}
    blk_rows: dict[str, list[object]] = {k: [] for k in BLOCKS_SCHEMA}
    chains = sorted(followed.model.segments([lb.block for lb in followed.live.values()]), key=lambda c: c[0].addr)
    for sid, chain in enumerate(chains):
        head = chain[0]
        pid = private.get(head.addr, (0, 0))
        expandable = head.segment in followed.model._expandable_base
        alloc = requested = 0
        for b in chain:
            lb = by_block.get(id(b)) if b.allocated else None
            if lb is not None:
                alloc += b.size
                requested += lb.requested
            blk_rows["block_id"].append(len(blk_rows["block_id"]))
            blk_rows["segment_id"].append(sid)
            blk_rows["device"].append(device)
            blk_rows["address"].append(b.addr)
            blk_rows["offset_bytes"].append(b.addr - head.addr)
            blk_rows["size_bytes"].append(b.size)
            blk_rows["requested_size_bytes"].append(lb.requested if lb is not None else None)
            blk_rows["state"].append("active_allocated" if lb is not None else "inactive")
            blk_rows["stream"].append(b.stream)
            blk_rows["pool"].append("small" if b.small else "large")
            blk_rows["is_private_pool"].append(pid != (0, 0))
            blk_rows["is_expandable"].append(expandable)
            blk_rows["stack_id"].append(lb.stack_id if lb is not None else None)
            blk_rows["forward_stack_id"].append(None)  # a replayed state: the trace's entries carry no forward stack
        seg_rows["segment_id"].append(sid)
        seg_rows["device"].append(device)
        seg_rows["address"].append(head.addr)
        seg_rows["total_size_bytes"].append(sum(b.size for b in chain))
        seg_rows["allocated_bytes"].append(alloc)
        seg_rows["active_bytes"].append(alloc)
        seg_rows["requested_bytes"].append(requested)
        seg_rows["n_blocks"].append(len(chain))
        seg_rows["stream"].append(head.stream)
        seg_rows["pool"].append("small" if head.small else "large")
        seg_rows["pool_id_0"].append(pid[0])
        seg_rows["pool_id_1"].append(pid[1])
        seg_rows["is_private_pool"].append(pid != (0, 0))
        seg_rows["is_expandable"].append(expandable)
        seg_rows["stack_id"].append(None)
    segments = conform(pd.DataFrame(seg_rows), SEGMENTS_SCHEMA) if chains else empty_frame(SEGMENTS_SCHEMA)
    blocks = conform(pd.DataFrame(blk_rows), BLOCKS_SCHEMA) if blk_rows["block_id"] else empty_frame(BLOCKS_SCHEMA)
    return segments, blocks


def layout_of(frames: SnapshotFrames, device: int) -> list[list[tuple[int, bool]]]:
    """The dump's own layout as (block size, allocated) per segment (pending frees count as
    allocated: their blocks are still held)."""
    seg = frames.segments[frames.segments["device"] == device]
    blk = frames.blocks[frames.blocks["segment_id"].isin(seg["segment_id"])]
    out = []
    for _, g in blk.groupby("segment_id", sort=False):
        out.append([(int(s), st != "inactive") for s, st in zip(g["size_bytes"], g["state"].astype(str), strict=True)])
    return out


def same_layout(a: list[list[tuple[int, bool]]], b: list[list[tuple[int, bool]]]) -> bool:
    return sorted(tuple(s) for s in a) == sorted(tuple(s) for s in b)
