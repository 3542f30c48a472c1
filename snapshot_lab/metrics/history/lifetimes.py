"""Allocation lifetimes: each ``alloc`` event matched with the ``free_completed`` that ends it.

The match is the first ``free_completed`` at the same address after the allocation (the
allocator cannot hand out an address again before it was freed). Leak detection, sites at the
peak and the categories all start from this table, so it is computed once per device and
snapshot (:func:`device_lifetimes` keeps it for as long as the frames live).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames, device_rows, event_positions
from .._memo import memo


def allocation_lifetimes(events: pd.DataFrame, device: int) -> pd.DataFrame:
    """Columns: event_index, address, size_bytes (requested), stack_id, time_us, free_index
    (``<NA>`` when the allocation is still live at the end of the trace); in event order."""
    device_events = device_rows(events, device)
    allocs = device_events.loc[
        device_events["action"] == "alloc", ["event_index", "address", "size_bytes", "stack_id", "time_us"]
    ]
    allocs = allocs[allocs["address"].notna()].astype({"address": "int64"})
    frees = device_events.loc[
        (device_events["action"] == "free_completed") & device_events["address"].notna(), ["event_index", "address"]
    ]
    frees = frees.astype({"address": "int64"})
    if allocs.empty:
        return allocs.assign(free_index=pd.array([], dtype="Int64"))
    matched = pd.merge_asof(
        allocs,
        frees.assign(free_index=frees["event_index"]),
        on="event_index",
        by="address",
        direction="forward",
        allow_exact_matches=False,
    )
    matched["free_index"] = matched["free_index"].astype("Int64")
    return matched


def device_lifetimes(frames: SnapshotFrames, device: int) -> pd.DataFrame:
    """:func:`allocation_lifetimes` of one device of ``frames``, computed once."""
    return memo(frames, ("lifetimes", device), lambda: allocation_lifetimes(frames.events, device))


def orphan_frees(events: pd.DataFrame, lifetimes: pd.DataFrame) -> pd.DataFrame:
    """``free_completed`` events of one device's trace (``events``) that no allocation of its
    ``lifetimes`` matched, their block being older than the trace: event_index, address,
    size_bytes, stack_id (the free's own stack), in event order."""
    index = events["event_index"].to_numpy()
    freed = np.flatnonzero(((events["action"] == "free_completed") & events["address"].notna()).to_numpy())
    matched = np.zeros(index.size, dtype=bool)
    matched[event_positions(index, lifetimes["free_index"].dropna().to_numpy(dtype=np.int64))] = True
    orphan = freed[~matched[freed]]
    columns = events.columns.get_indexer(pd.Index(["event_index", "address", "size_bytes", "stack_id"]))
    out = events.iloc[orphan, columns]  # the few rows and columns it returns
    assert isinstance(out, pd.DataFrame)
    return out.reset_index(drop=True).astype({"address": "int64"})
