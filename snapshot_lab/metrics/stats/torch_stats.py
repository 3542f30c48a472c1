"""``torch.cuda.memory_stats()`` counters recomputed from the snapshot's segments and blocks.

The snapshot is the allocator's state at dump time, so every ``.current`` counter of the
caching allocator can be recomputed from it exactly (tests compare with the counters torch
itself returned right before the dump). How torch counts, from ``CUDACachingAllocator.cpp``:

- ``reserved_bytes`` / ``segment``: sum / count of segments. Each segment is charged to the pool
  it belongs to (``segment_type`` small or large), private (CUDA graph) pools included.
- ``allocated_bytes`` / ``allocation``: blocks handed to a tensor (``active_allocated``).
- ``active_bytes`` / ``active``: allocated blocks plus blocks freed by their tensor but still
  awaiting the completion of work on another stream (``active_pending_free``).
- ``requested_bytes``: the sizes originally requested (before rounding) of *active* blocks:
  torch subtracts a block's request only when the block is really freed, so blocks awaiting
  another stream still count here although they no longer count as allocated.
- ``inactive_split_bytes`` / ``inactive_split``: free (inactive) blocks that are part of a split,
  i.e. share their segment with other blocks. Expandable segments never count here.
- Expandable segments are not counted in ``segment`` (torch counts cudaMalloc'd segments; an
  expandable segment maps pages into one reserved range instead) but their mapped bytes are
  reserved bytes.
"""

from __future__ import annotations

import pandas as pd

POOL_KEYS = ("all", "large_pool", "small_pool")

# Counter names exactly as torch.cuda.memory_stats() spells them (".current" values only).
STAT_NAMES = (
    "reserved_bytes",
    "allocated_bytes",
    "active_bytes",
    "requested_bytes",
    "inactive_split_bytes",
    "segment",
    "inactive_split",
    "active",
    "allocation",
)


def _pool_stats(segments: pd.DataFrame, blocks: pd.DataFrame) -> dict[str, int]:
    state = blocks["state"]
    allocated = state == "active_allocated"
    active = allocated | (state == "active_pending_free")
    seg_nblocks = segments.set_index("segment_id")["n_blocks"]
    split = blocks["segment_id"].map(seg_nblocks).fillna(0).to_numpy() > 1
    inactive_split = (state == "inactive").to_numpy() & split & ~blocks["is_expandable"].to_numpy()
    size = blocks["size_bytes"]
    return {
        "reserved_bytes": int(segments["total_size_bytes"].sum()),
        "allocated_bytes": int(size[allocated].sum()),
        "active_bytes": int(size[active].sum()),
        "requested_bytes": int(blocks.loc[active, "requested_size_bytes"].sum()),
        "inactive_split_bytes": int(size[inactive_split].sum()),
        "segment": int((~segments["is_expandable"]).sum()),
        "inactive_split": int(inactive_split.sum()),
        "active": int(active.sum()),
        "allocation": int(allocated.sum()),
    }


def compute_torch_stats(segments: pd.DataFrame, blocks: pd.DataFrame) -> dict[str, int]:
    """Flat dict ``{"reserved_bytes.all.current": ..., ...}`` for the given segments/blocks.

    Pass the frames of one device to get ``torch.cuda.memory_stats(device)``; pass all devices
    to get their sum.
    """
    out: dict[str, int] = {}
    for key, pool in (("all", None), ("large_pool", "large"), ("small_pool", "small")):
        segs = segments if pool is None else segments[segments["pool"] == pool]
        blks = blocks if pool is None else blocks[blocks["pool"] == pool]
        for name, value in _pool_stats(segs, blks).items():
            out[f"{name}.{key}.current"] = value
    return out
