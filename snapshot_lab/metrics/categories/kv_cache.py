"""How a KV cache grows, decode step by decode step.

A growing cache (transformers' ``DynamicCache``) replaces every layer's keys and values at each
forward with a tensor one step longer (``torch.cat``): the allocations of one forward all have
the same size, and the next forward's are larger. The steps are therefore the runs of equal-sized
cache allocations, in trace order; the cache's size after a step is the ``kv_cache`` level just
before the next step's first allocation (and at the end of the trace for the last one). A
preallocated cache (``StaticCache``, vLLM's blocks) does not grow: one step, no growth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...frames import SnapshotFrames
from ..history.lifetimes import device_lifetimes
from .assign import categorize
from .rules import CODES


@dataclass(frozen=True)
class KvCacheGrowth:
    device: int
    steps: int  # forwards that allocated cache tensors (the prefill, then each decode step)
    bytes_per_step: int  # the median growth of the cache per decode step (requested bytes)
    bytes_after_first_step: int  # the cache after the first step (the prefill)
    bytes_at_end: int  # the cache at the end of the trace
    bytes_after_each_step: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "steps": self.steps,
            "bytes_per_step": self.bytes_per_step,
            "bytes_after_first_step": self.bytes_after_first_step,
            "bytes_at_end": self.bytes_at_end,
        }


def _kv_level(frames: SnapshotFrames, device: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The requested bytes of the kv_cache category after every event of the device's trace,
    and the positions and sizes of the cache's allocations, in trace order."""
    events = frames.device_events(device)
    lifetimes = device_lifetimes(frames, device)
    kv = categorize(frames).alloc_codes[device] == CODES["kv_cache"]
    base = int(events["event_index"].iloc[0])
    delta = np.zeros(len(events), dtype=np.int64)
    sizes = lifetimes["size_bytes"].to_numpy(dtype=np.int64)
    alloc_at = lifetimes["event_index"].to_numpy(dtype=np.int64) - base
    np.add.at(delta, alloc_at[kv], sizes[kv])
    free_at = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)
    freed = kv & (free_at >= 0)
    np.add.at(delta, free_at[freed] - base, -sizes[freed])
    return np.cumsum(delta), alloc_at[kv], sizes[kv]


def kv_cache_growth(frames: SnapshotFrames, device: int) -> KvCacheGrowth | None:
    """KV-cache bytes after each forward and the growth per decode step (see the module
    docstring); None when the device's trace allocated no KV cache. For the report and
    ``stats --json`` (``devices.<d>.kv_cache_growth``)."""
    if device not in categorize(frames).alloc_codes or frames.events.empty:
        return None
    level, positions, sizes = _kv_level(frames, device)
    if positions.size == 0:
        return None
    step_starts = np.flatnonzero(np.r_[True, sizes[1:] != sizes[:-1]])
    ends = np.r_[positions[step_starts[1:]] - 1, level.size - 1]
    after = level[ends]
    growth = np.diff(after)
    return KvCacheGrowth(
        device=device,
        steps=int(step_starts.size),
        bytes_per_step=int(np.median(growth)) if growth.size else 0,
        bytes_after_first_step=int(after[0]),
        bytes_at_end=int(level[-1]),
        bytes_after_each_step=tuple(int(v) for v in after),
    )
