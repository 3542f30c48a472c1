"""Releases: runs of segment frees (or unmaps) in a trace, and who made each one.

Memory goes back to CUDA when the program calls ``torch.cuda.empty_cache()``, or when the
allocator makes room inside an allocation (garbage collection, freeing oversize blocks, or
freeing its whole cache to retry a cudaMalloc that failed). The free events record the stack
of the moment: a Python ``empty_cache`` frame says the program did it; the stack of some other
operation says it happened inside that operation's allocation. Events recorded without a stack
(the autograd thread with Python stacks, or ``context`` not recording frees) leave the cause to
the allocator model (:mod:`.whatif`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..frames import SnapshotFrames
from ._memo import memo
from .allocator_model import UNLIMITED, recorded_settings
from .categories.stacks import stacks_with_frame

CAUSES = ("empty_cache", "oom", "allocator", "unknown")


@dataclass(frozen=True)
class Release:
    start: int  # position of its first event in the device's trace
    end: int  # position after its last event
    segments: int
    bytes: int
    cause: str  # one of CAUSES: 'oom' = the allocator freed its cache to retry a request that then failed
    reserved_again_bytes: int  # segments reserved after it, before the next release
    followed_by: str  # the first action after it ('' at the end of the trace)


def _find(frames: SnapshotFrames, device: int) -> list[Release]:
    ev = frames.events[frames.events["device"] == device]
    action = ev["action"].astype(str).to_numpy()
    size = ev["size_bytes"].to_numpy()
    sid = ev["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    empty_cache = stacks_with_frame(frames, "empty_cache")
    settings = recorded_settings(frames.info.allocator_settings)
    # with these, the allocator gives memory back inside allocations by itself
    self_releasing = settings.garbage_collection_threshold > 0 or settings.max_split_size != UNLIMITED
    gone = np.isin(action, ["segment_free", "segment_unmap"])
    new = np.isin(action, ["segment_alloc", "segment_map"])
    idx = np.flatnonzero(gone)
    if idx.size == 0:
        return []
    starts = idx[np.r_[True, np.diff(idx) > 1]]
    ends = idx[np.r_[np.diff(idx) > 1, True]] + 1
    out = []
    for k, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        nxt_start = int(starts[k + 1]) if k + 1 < starts.size else action.size
        following = [a for a in action[e:nxt_start] if a != "snapshot"]
        first = following[0] if following else ""
        stacks = set(sid[s:e].tolist()) - {-1}
        if stacks & empty_cache:
            cause = "empty_cache"
        elif first == "oom":
            cause = "oom"
        elif stacks or (self_releasing and first in ("segment_alloc", "segment_map")):
            cause = "allocator"
        else:
            cause = "unknown"
        out.append(
            Release(
                start=s,
                end=e,
                segments=e - s,
                bytes=int(size[s:e].sum()),
                cause=cause,
                reserved_again_bytes=int(size[e:nxt_start][new[e:nxt_start]].sum()),
                followed_by=first,
            )
        )
    return out


def find_releases(frames: SnapshotFrames, device: int) -> list[Release]:
    """The device's releases in trace order (computed once per snapshot)."""
    return memo(frames, ("releases", device), lambda: _find(frames, device))
