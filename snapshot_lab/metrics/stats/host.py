"""Pinned host memory (torch >= 2.14, ``record_pinned_host_memory=True``): totals and sites.

torch's host caching allocator never splits a block, so each host segment is one allocation:
allocated (a tensor holds it), pending (freed, waiting on a CUDA event) or cached (free for
reuse). These are totalled beside device memory, never added to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ...frames import SnapshotFrames


@dataclass(frozen=True)
class HostSite:
    stack_id: int | None
    frame: str  # the innermost frame, 'file:line:name', or '<no stack>'
    allocated_bytes: int
    blocks: int


@dataclass(frozen=True)
class HostMemory:
    segments: int
    reserved_bytes: int  # every pinned block the allocator holds
    allocated_bytes: int  # held by tensors
    pending_free_bytes: int  # freed, waiting on a CUDA event
    cached_bytes: int  # free for reuse
    private_pool_bytes: int  # in a private pool (CUDA graphs, MemPool)
    events: int
    peak_allocated_in_trace_bytes: int | None  # replayed from host_traces, anchored at the dump
    sites: tuple[HostSite, ...]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _frame_text(frames: SnapshotFrames, stack_id: int | None) -> str:
    stack = frames.stack(stack_id)
    return f"{stack[0]['filename']}:{stack[0]['line']}:{stack[0]['name']}" if stack else "<no stack>"


def _peak(frames: SnapshotFrames, allocated_now: int) -> int | None:
    ev = frames.host_events
    if not len(ev):
        return None
    sign = np.where(ev["action"] == "alloc", 1, np.where(ev["action"] == "free_completed", -1, 0))
    running = np.cumsum(sign * ev["size_bytes"].to_numpy())
    start = allocated_now - int(running[-1])  # what was allocated before the first host event
    return max(allocated_now, start + int(running.max()))


def compute_host_memory(frames: SnapshotFrames, top: int = 10) -> HostMemory | None:
    """Pinned host memory's totals and top allocation sites, or None when the file has none."""
    if not frames.has_host_memory:
        return None
    seg = frames.host_segments
    allocated = int(seg["allocated_bytes"].sum())
    active = int(seg["active_bytes"].sum())
    live = seg[seg["allocated_bytes"] > 0]
    grouped = live.groupby(live["stack_id"].fillna(-1), sort=False)["allocated_bytes"].agg(["sum", "size"])
    grouped = grouped.sort_values("sum", ascending=False, kind="stable").head(top)
    sites = tuple(
        HostSite(
            stack_id=None if sid < 0 else int(sid),
            frame=_frame_text(frames, None if sid < 0 else int(sid)),
            allocated_bytes=int(total),
            blocks=int(n),
        )
        for sid, total, n in grouped.itertuples()
    )
    return HostMemory(
        segments=len(seg),
        reserved_bytes=int(seg["total_size_bytes"].sum()),
        allocated_bytes=allocated,
        pending_free_bytes=active - allocated,
        cached_bytes=int(seg["total_size_bytes"].sum()) - active,
        private_pool_bytes=int(seg.loc[seg["is_private_pool"], "total_size_bytes"].sum()),
        events=len(frames.host_events),
        peak_allocated_in_trace_bytes=_peak(frames, allocated),
        sites=sites,
    )
