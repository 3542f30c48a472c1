"""Memory by compiled region (``_record_memory_history(compile_context=True)``, torch >= 2.8).

Each ``alloc`` entry made inside a ``torch.compile``'d region carries the region's context
(``'Torch-Compiled Region: 0/0'``: frame id / compile id; ``'N/A'`` outside, which the frames
leave out). As torch's memory viewer labels each allocation with the context it was made in,
an allocation belongs to the region its ``alloc`` ran in, whenever it is freed: per region, what
it allocated, the peak of its allocations live at once (replayed over the device's trace, from
zero: memory allocated before the trace belongs to no region) and what is still live at the end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .lifetimes import device_lifetimes


@dataclass(frozen=True)
class CompiledRegion:
    device: int
    compile_context: str  # as torch wrote it, e.g. 'Torch-Compiled Region: 0/0'
    allocations: int
    allocated_bytes: int  # every allocation made inside the region, summed
    peak_bytes: int  # the most of the region's allocations live at once
    live_at_end_bytes: int  # its allocations not freed by the end of the trace

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def has_compiled_regions(frames: SnapshotFrames) -> bool:
    """Whether any device trace entry records a compile_context."""
    details = frames.event_details
    return bool((~details["host"] & details["compile_context"].notna()).any())


def _region_of_allocations(frames: SnapshotFrames, device: int) -> pd.DataFrame:
    """The device's allocations (lifetimes) with the compile_context of their alloc entry."""
    details = frames.event_details
    mine = details[~details["host"] & (details["device"] == device) & details["compile_context"].notna()]
    contexts = mine.set_index("event_index")["compile_context"]
    lifetimes = device_lifetimes(frames, device)
    return lifetimes.assign(region=lifetimes["event_index"].map(contexts))


def _region(device: int, name: str, allocs: pd.DataFrame) -> CompiledRegion:
    """One region's totals: its peak from a replay of its allocations and frees in event order."""
    sizes = allocs["size_bytes"].to_numpy(dtype=np.int64)
    freed = allocs["free_index"].notna().to_numpy()
    at = np.concatenate(
        [allocs["event_index"].to_numpy(dtype=np.int64), allocs.loc[freed, "free_index"].to_numpy(dtype=np.int64)]
    )
    delta = np.concatenate([sizes, -sizes[freed]])
    order = np.argsort(at, kind="stable")
    level = np.cumsum(delta[order])
    return CompiledRegion(
        device=device,
        compile_context=name,
        allocations=len(allocs),
        allocated_bytes=int(sizes.sum()),
        peak_bytes=int(level.max()) if level.size else 0,
        live_at_end_bytes=int(sizes[~freed].sum()),
    )


def compiled_regions(frames: SnapshotFrames) -> list[CompiledRegion]:
    """Memory by compiled region, per device (device, then first allocation order); empty when
    the file records no compile_context."""
    if not has_compiled_regions(frames):
        return []
    out = []
    for device in sorted(int(d) for d in frames.events["device"].unique()):
        allocs = _region_of_allocations(frames, device)
        allocs = allocs[allocs["region"].notna()]
        for name, group in allocs.groupby("region", sort=False):
            out.append(_region(device, str(name), group))
    return out
