"""Declared schemas of the frames: every frame has these columns and dtypes, even when empty.

Units are in the column names (``*_bytes``, ``time_us``); nullable integer columns (``Int64``)
mean "unknown" with ``<NA>``, never with a sentinel value.
"""

from __future__ import annotations

import pandas as pd

BLOCK_STATES = ["active_allocated", "active_pending_free", "inactive"]
POOLS = ["small", "large"]
KNOWN_ACTIONS = [
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
    "user_defined",
    "annotate",
]

STATE_DTYPE = pd.CategoricalDtype(BLOCK_STATES)
POOL_DTYPE = pd.CategoricalDtype(POOLS)

SEGMENTS_SCHEMA: dict[str, object] = {
    "segment_id": "int64",
    "device": "int64",
    "address": "int64",
    "total_size_bytes": "int64",
    "allocated_bytes": "int64",
    "active_bytes": "int64",
    "requested_bytes": "int64",
    "n_blocks": "int64",
    "stream": "int64",
    "pool": POOL_DTYPE,
    "pool_id_0": "int64",
    "pool_id_1": "int64",
    "is_private_pool": "bool",
    "is_expandable": "bool",
    "stack_id": "Int64",
}

BLOCKS_SCHEMA: dict[str, object] = {
    "block_id": "int64",
    "segment_id": "int64",
    "device": "int64",
    "address": "int64",
    "offset_bytes": "int64",
    "size_bytes": "int64",
    "requested_size_bytes": "Int64",  # <NA> for inactive blocks: torch leaves a stale value there
    "state": STATE_DTYPE,
    "stream": "int64",
    "pool": POOL_DTYPE,
    "is_private_pool": "bool",
    "is_expandable": "bool",
    "stack_id": "Int64",
    "forward_stack_id": "Int64",  # autograd anomaly mode (torch >= 2.11): the forward pass's stack
}

EVENTS_SCHEMA: dict[str, object] = {
    "device": "int64",
    "event_index": "int64",  # position in that device's trace (chronological)
    "action": "category",
    "address": "Int64",  # <NA> for oom entries
    "size_bytes": "int64",
    "stream": "int64",
    "time_us": "Int64",  # microseconds since the Unix epoch; <NA> before torch 2.2
    "stack_id": "Int64",
    "forward_stack_id": "Int64",  # allocations by backward under anomaly mode: the forward's stack
    "device_free_bytes": "Int64",  # oom entries only
    "user_metadata": "category",  # torch >= 2.10: _set_memory_metadata's string ('' when none)
}

STACK_FRAMES_SCHEMA: dict[str, object] = {
    "frame_id": "int64",
    "filename": "object",
    "line": "int64",
    "name": "object",
}

STACKS_SCHEMA: dict[str, object] = {
    "stack_id": "int64",
    "depth": "int64",  # 0 = innermost frame (the allocation site)
    "frame_id": "int64",
}

# Sparse: one row per trace entry (device or host) whose memory pool is not the default (0, 0) or
# that ran inside a compiled region (torch >= 2.12 writes pool_id and >= 2.8 compile_context on
# every entry; 'N/A' and (0, 0) are left out). ``host`` marks pinned host memory's entries.
EVENT_DETAILS_SCHEMA: dict[str, object] = {
    "host": "bool",
    "device": "int64",
    "event_index": "int64",
    "pool_id_0": "Int64",
    "pool_id_1": "Int64",
    "compile_context": "object",  # None where the entry ran outside a compiled region
}

# FX graph provenance of frames (_snapshot(augment_with_fx_traces=True), torch >= 2.10): one row
# per frame that has any of the keys; None where a frame lacks one
FX_KEYS = ("fx_node_op", "fx_node_name", "fx_node_target", "fx_original_trace")
FRAME_FX_SCHEMA: dict[str, object] = {"frame_id": "int64", **{k: "object" for k in FX_KEYS}}

ANNOTATIONS_SCHEMA: dict[str, object] = {
    "device": "int64",
    "time_us": "Int64",
    "stage": "object",
    "name": "object",
}


def empty_frame(schema: dict[str, object]) -> pd.DataFrame:
    """An empty frame with the declared columns and dtypes."""
    return pd.DataFrame({col: pd.Series([], dtype=dtype) for col, dtype in schema.items()})  # type: ignore[call-overload]


def conform(df: pd.DataFrame, schema: dict[str, object]) -> pd.DataFrame:
    """Order columns as declared and cast each to its declared dtype."""
    return df.astype(dict(schema))[list(schema)]  # type: ignore[arg-type]
