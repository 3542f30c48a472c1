"""Which segments the block-layout plot draws, and what it aggregates.

A job can hold thousands of segments; drawing them all makes an unreadable picture. Per pool
(large, small) we draw the ``max_rows`` largest segments, one bar each, and summarise the rest.
Segments that are alike (the same size, flags and blocks at the same offsets in the same states,
such as the 75 20-MiB segments of ``oom_fragmentation``) are one row that says how many it
stands for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


@dataclass(frozen=True)
class PoolLayout:
    pool: str  # 'large' or 'small'
    segments: pd.DataFrame  # the drawn segments, largest first (columns of the segments frame)
    blocks: pd.DataFrame  # blocks of the drawn segments
    hidden_segments: int
    hidden_reserved_bytes: int
    hidden_allocated_bytes: int
    hidden_free_bytes: int
    repeats: dict[int, int] = field(default_factory=dict)  # segment_id -> the alike segments its row stands for


def _shapes(segments: pd.DataFrame, blocks: pd.DataFrame) -> pd.Series:
    """Per segment (indexed like ``segments``), a key equal for segments that draw alike."""
    ordered = blocks.sort_values(["segment_id", "offset_bytes"])
    cells = (
        ordered["offset_bytes"].astype(str)
        + ":"
        + ordered["size_bytes"].astype(str)
        + ":"
        + ordered["state"].astype(str)
    )
    by_segment = cells.groupby(ordered["segment_id"], sort=False).agg(",".join)
    flags = (
        segments["total_size_bytes"].astype(str)
        + segments["is_private_pool"].astype(str)
        + segments["is_expandable"].astype(str)
    )
    return flags + "|" + segments["segment_id"].map(by_segment).fillna("")


def select_layout(segments: pd.DataFrame, blocks: pd.DataFrame, max_rows: int = 40) -> list[PoolLayout]:
    """The drawn and hidden segments of each pool that has segments (large pool first)."""
    out = []
    for pool in ("large", "small"):
        segs = segments[segments["pool"] == pool]
        if segs.empty:
            continue
        segs = segs.sort_values(["total_size_bytes", "address"], ascending=[False, True])
        shape = _shapes(segs, blocks)
        rows = segs[~shape.duplicated()]
        shown = rows.head(max_rows)
        drawn_shapes = set(shape[shown.index])
        counts = shape.value_counts()
        hidden = segs[~shape.isin(drawn_shapes)]
        hidden_blocks = blocks[blocks["segment_id"].isin(hidden["segment_id"])]
        out.append(
            PoolLayout(
                pool=pool,
                segments=shown,
                blocks=blocks[blocks["segment_id"].isin(shown["segment_id"])],
                hidden_segments=len(hidden),
                hidden_reserved_bytes=int(hidden["total_size_bytes"].sum()),
                hidden_allocated_bytes=int(hidden["allocated_bytes"].sum()),
                hidden_free_bytes=int(hidden_blocks.loc[hidden_blocks["state"] == "inactive", "size_bytes"].sum()),
                repeats={
                    int(sid): int(counts[shape[i]]) for i, sid in zip(shown.index, shown["segment_id"], strict=True)
                },
            )
        )
    return out
