"""Fragmentation: where the free bytes inside reserved memory are, and whether they are usable.

Definitions (per pool: all, large_pool, small_pool):

- ``free_bytes``: bytes of inactive (cached, free) blocks inside reserved segments.
- ``largest_free_block_bytes``: the biggest single free block; a request larger than this
  needs a new segment even when ``free_bytes`` is far larger.
- ``external_fragmentation``: ``1 - largest_free_block / free_bytes`` (0 when nothing is free):
  0 means all free memory is one block, values near 1 mean it is shattered into small holes.
- ``internal_waste_bytes``: ``size - requested_size`` over allocated blocks (rounding waste).
- ``stranded_bytes``: free bytes in segments that also hold live blocks: ``empty_cache()``
  cannot give them back to CUDA (only whole free segments are released).
- ``releasable_bytes``: bytes ``empty_cache()`` would return — whole free segments, and for
  expandable segments the whole pages (2 MiB small / 20 MiB large) inside free blocks.

Free memory splits in two parts that mean different things:

- *stranded* (``stranded_bytes``): holes inside segments that still hold live blocks. Only a
  request that fits a hole can use them, and nothing can give them back while the segment's
  live blocks stay: this is what fragmentation costs. ``stranded_share`` is their share of
  reserved memory, the number the report and ``stats`` call "fragmentation".
- *cached-releasable* (``cached_releasable_bytes``, the same bytes as ``releasable_bytes``):
  whole free segments (and whole free pages of expandable segments). Any request can reuse
  them, and ``empty_cache()`` returns them to CUDA: a cache, not a loss.

What is left (``free_bytes - stranded_bytes - cached_releasable_bytes``) is the part of free
blocks in expandable segments that does not fill a whole page.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

SMALL_PAGE_BYTES = 2 * 1024 * 1024  # expandable segments map pages of this size (small pool)
LARGE_PAGE_BYTES = 20 * 1024 * 1024  # ... and of this size (large pool)


@dataclass(frozen=True)
class HistogramBin:
    lower_bytes: int  # inclusive
    upper_bytes: int  # exclusive
    count: int
    bytes: int


@dataclass(frozen=True)
class PoolFragmentation:
    reserved_bytes: int
    free_bytes: int
    free_blocks: int
    largest_free_block_bytes: int
    external_fragmentation: float
    internal_waste_bytes: int
    stranded_bytes: int
    releasable_bytes: int
    free_block_histogram: tuple[HistogramBin, ...]
    cached_releasable_bytes: int = 0  # whole free segments / pages: reusable by anything, empty_cache() frees them
    stranded_share: float = 0.0  # stranded_bytes / reserved_bytes: "fragmentation"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def free_block_histogram(sizes: np.ndarray) -> tuple[HistogramBin, ...]:
    """Power-of-two bins ``[2^k, 2^(k+1))`` from the smallest to the largest non-empty bin."""
    sizes = sizes[sizes > 0]
    if sizes.size == 0:
        return ()
    k = np.floor(np.log2(sizes.astype(np.float64))).astype(np.int64)
    # float log2 can be off by one right at powers of two; fix with exact integer checks
    k = np.where((np.int64(1) << k) > sizes, k - 1, k)
    k = np.where((np.int64(1) << (k + 1)) <= sizes, k + 1, k)
    lo, hi = int(k.min()), int(k.max())
    counts = np.bincount(k - lo, minlength=hi - lo + 1)
    by_bin = pd.Series(sizes).groupby(k - lo).sum()  # exact int64 sums, unlike float weights
    return tuple(
        HistogramBin(1 << (lo + i), 1 << (lo + i + 1), int(counts[i]), int(by_bin.get(i, 0)))
        for i in range(len(counts))
    )


def _releasable(free: pd.DataFrame, segments: pd.DataFrame) -> int:
    seg = segments.set_index("segment_id")
    whole_free = seg[(seg["active_bytes"] == 0) & ~seg["is_expandable"]]
    total = int(whole_free["total_size_bytes"].sum())
    exp = free[free["is_expandable"]]
    if not exp.empty:
        page = np.where(exp["pool"].astype(str) == "small", SMALL_PAGE_BYTES, LARGE_PAGE_BYTES)
        start = exp["address"].to_numpy()
        end = start + exp["size_bytes"].to_numpy()
        first = -(-start // page) * page
        last = (end // page) * page
        total += int(np.clip(last - first, 0, None).sum())
    return total


def pool_fragmentation(segments: pd.DataFrame, blocks: pd.DataFrame) -> PoolFragmentation:
    """Fragmentation figures for the given segments and their blocks."""
    free = blocks[blocks["state"] == "inactive"]
    allocated = blocks[blocks["state"] == "active_allocated"]
    free_sizes = free["size_bytes"].to_numpy()
    free_bytes = int(free_sizes.sum())
    largest = int(free_sizes.max()) if free_sizes.size else 0
    live_seg = segments.loc[segments["active_bytes"] > 0, "segment_id"]
    stranded = int(free.loc[free["segment_id"].isin(live_seg) & ~free["is_expandable"], "size_bytes"].sum())
    waste = int((allocated["size_bytes"] - allocated["requested_size_bytes"]).sum())
    reserved = int(segments["total_size_bytes"].sum())
    releasable = _releasable(free, segments)
    return PoolFragmentation(
        reserved_bytes=reserved,
        free_bytes=free_bytes,
        free_blocks=int(free_sizes.size),
        largest_free_block_bytes=largest,
        external_fragmentation=round(1.0 - largest / free_bytes, 6) if free_bytes else 0.0,
        internal_waste_bytes=waste,
        stranded_bytes=stranded,
        releasable_bytes=releasable,
        free_block_histogram=free_block_histogram(free_sizes),
        cached_releasable_bytes=releasable,
        stranded_share=round(stranded / reserved, 6) if reserved else 0.0,
    )


def compute_fragmentation(segments: pd.DataFrame, blocks: pd.DataFrame) -> dict[str, PoolFragmentation]:
    """Fragmentation for ``all``, ``large_pool`` and ``small_pool``."""
    out = {"all": pool_fragmentation(segments, blocks)}
    for key, pool in (("large_pool", "large"), ("small_pool", "small")):
        out[key] = pool_fragmentation(segments[segments["pool"] == pool], blocks[blocks["pool"] == pool])
    return out
