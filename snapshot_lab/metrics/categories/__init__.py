"""Memory categories: parameter, gradient, optimizer_state, activation, ddp_bucket,
cuda_graph_pool, other.

One module per question: :mod:`.stacks` (what a stack says, and on which thread it was
recorded), :mod:`.gradients` (the lifetime rule that finds gradients in both stack modes),
:mod:`.assign` (one category per allocation and per block). This module sums them up: bytes per
category at the dump and over the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from ..lifetimes import device_lifetimes
from .assign import CATEGORIES, CODES, Categorization, categorize
from .stacks import stack_categories, stack_threads


@dataclass(frozen=True)
class CategoryBreakdown:
    device: int
    live_bytes: dict[str, int]  # allocated blocks at the dump, by category (they add up to allocated_bytes)
    live_requested_bytes: dict[str, int]  # what those blocks' tensors asked for, before rounding
    live_blocks: dict[str, int]
    # requested bytes over the trace per category (aligned with the device's event order)
    timeline: pd.DataFrame | None


def categorize_blocks(frames: SnapshotFrames) -> pd.Series:
    """Category of every row of ``frames.blocks`` (index aligned)."""
    return categorize(frames).block_category


def category_timeline(frames: SnapshotFrames, device: int) -> pd.DataFrame | None:
    """Requested bytes per category after every event of the device (columns = categories);
    each free counts against the category of the allocation it releases."""
    ev = frames.events[frames.events["device"] == device]
    if len(ev) < 2:
        return None
    lifetimes = device_lifetimes(frames, device)
    code = categorize(frames).alloc_codes[device]
    base = int(ev["event_index"].iloc[0])
    size = lifetimes["size_bytes"].to_numpy()
    mat = np.zeros((len(ev), len(CATEGORIES)), dtype=np.int64, order="F")  # column-major: no copy into pandas
    mat[lifetimes["event_index"].to_numpy() - base, code] = size
    free_at = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)
    freed = free_at >= 0
    mat[free_at[freed] - base, code[freed]] = -size[freed]
    levels = np.cumsum(mat, axis=0, out=mat)
    # allocations older than the trace are not in it: anchor each category at zero
    levels -= np.minimum(levels.min(axis=0), 0)
    return pd.DataFrame(levels, columns=list(CATEGORIES), copy=False)


def category_levels_at(frames: SnapshotFrames, device: int, event_index: int) -> dict[str, int]:
    """Requested bytes per category just after event ``event_index`` of ``device``: the row of
    :func:`category_timeline` at that event, from the allocations alive then, without building
    the whole timeline (``ranks`` wants one row, at the peak, of every rank's file)."""
    lifetimes = device_lifetimes(frames, device)
    alive = (lifetimes["event_index"] <= event_index) & (
        lifetimes["free_index"].isna() | (lifetimes["free_index"] > event_index)
    )
    mask = alive.to_numpy(dtype=bool)
    code = categorize(frames).alloc_codes[device][mask]
    code = np.where(code < 0, len(CATEGORIES) - 1, code)  # as the timeline indexes it
    sums = np.zeros(len(CATEGORIES), dtype=np.int64)
    np.add.at(sums, code, lifetimes["size_bytes"].to_numpy(dtype=np.int64)[mask])
    return {c: int(sums[i]) for i, c in enumerate(CATEGORIES)}


def compute_categories(frames: SnapshotFrames, device: int, with_timeline: bool = True) -> CategoryBreakdown:
    """Live bytes per category at the dump and, with ``with_timeline``, over the trace."""
    cats = categorize(frames).block_category
    b = frames.blocks
    live = (b["device"] == device) & (b["state"] == "active_allocated")
    grouped = b.loc[live, ["size_bytes", "requested_size_bytes"]].groupby(cats[live])
    by = grouped.agg(
        size=("size_bytes", "sum"), requested=("requested_size_bytes", "sum"), count=("size_bytes", "size")
    )
    return CategoryBreakdown(
        device=device,
        live_bytes={c: int(by["size"].get(c, 0)) for c in CATEGORIES},
        live_requested_bytes={c: int(by["requested"].get(c, 0)) for c in CATEGORIES},
        live_blocks={c: int(by["count"].get(c, 0)) for c in CATEGORIES},
        timeline=category_timeline(frames, device) if with_timeline else None,
    )


__all__ = [
    "CATEGORIES",
    "CODES",
    "Categorization",
    "CategoryBreakdown",
    "categorize",
    "categorize_blocks",
    "category_levels_at",
    "category_timeline",
    "compute_categories",
    "stack_categories",
    "stack_threads",
]
