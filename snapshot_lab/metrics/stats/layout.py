"""Which segments the block-layout plot draws, and what it aggregates.

A job can hold thousands of segments; drawing them all makes an unreadable picture. Per pool
(large, small) we draw the ``max_rows`` largest segments, one bar each, and summarise the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def select_layout(segments: pd.DataFrame, blocks: pd.DataFrame, max_rows: int = 40) -> list[PoolLayout]:
    """The drawn and hidden segments of each pool that has segments (large pool first)."""
    out = []
    for pool in ("large", "small"):
        segs = segments[segments["pool"] == pool]
        if segs.empty:
            continue
        segs = segs.sort_values(["total_size_bytes", "address"], ascending=[False, True])
        shown, hidden = segs.head(max_rows), segs.iloc[max_rows:]
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
            )
        )
    return out
