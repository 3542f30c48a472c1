"""Private memory pools: which were made by a CUDA graph, and which by someone the file does not name.

A segment whose ``segment_pool_id`` is not ``(0, 0)`` belongs to a private pool. CUDA graphs make
them, and so do ``torch.cuda.MemPool`` with ``use_mem_pool`` (vLLM's sleep mode keeps weights and
KV cache there, RL frameworks offload a model through one, NCCL's symmetric memory and custom
allocators place buffers in them). The evidence, strongest first:

- the pool id: the allocator numbers a pool a graph makes for itself ``(n, 0)``
  (``MemPool(..., is_user_created=false)``, or the capture id of older releases), and a
  user's ``MemPool`` ``(0, n)``; but ``graph_pool_handle()`` (a pool graphs share: torch.compile's
  CUDA-graph trees, ``make_graphed_callables``) gives ``(0, n)`` as well, so ``(0, n)`` alone
  names no owner;
- the stacks of what was allocated in the pool: graph-capture code (``torch/cuda/graphs.py``,
  inductor's ``cudagraph_trees.py``, a serving engine's CUDA-graph runner, C++ ``CUDAGraph``)
  makes it a graph's pool.

A pool with neither is ``private_pool``: "private pool, owner unknown". Its allocations keep what
their own stacks say (vLLM's weights are parameters); only those their stacks do not decide are
labelled ``private_pool``. A graph's pool is ``cuda_graph_pool`` whole.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo
from .stacks import stack_filenames, stacks_where

# graph-capture code: files and C++ functions
_GRAPH_FILE = r"cuda_?graph|cudagraph|/torch/cuda/graphs\.py$"
_GRAPH_NAME = r"CUDAGraph|capture_begin|make_graphed_callables|capture_model|_capture_cudagraphs"


def graph_capture_stacks(frames: SnapshotFrames) -> set[int]:
    """stack_ids with a frame of graph-capture code."""
    if frames.stacks.empty:
        return set()
    files = stack_filenames(frames)
    names = frames.stack_frames["name"].astype(str)
    hit = files.str.contains(_GRAPH_FILE, case=False, regex=True) | names.str.contains(_GRAPH_NAME, regex=True)
    return stacks_where(frames, hit)


def pool_of(addresses: np.ndarray, segments: pd.DataFrame) -> np.ndarray:
    """Row position in ``segments`` (one device's private-pool segments, sorted by address) of
    the segment holding each address; -1 outside every one."""
    out = np.full(addresses.size, -1, dtype=np.int64)
    if segments.empty or addresses.size == 0:
        return out
    starts = segments["address"].to_numpy(dtype=np.int64)
    ends = starts + segments["total_size_bytes"].to_numpy(dtype=np.int64)
    i = np.searchsorted(starts, addresses, side="right") - 1
    ok = i >= 0
    ok[ok] = addresses[ok] < ends[i[ok]]
    out[ok] = i[ok]
    return out


def _private_segments(frames: SnapshotFrames, device: int) -> pd.DataFrame:
    seg = frames.segments
    mine = seg[(seg["device"] == device) & seg["is_private_pool"]]
    return mine.sort_values("address").reset_index(drop=True)


def _graph_pools_by_stack(frames: SnapshotFrames, device: int, segs: pd.DataFrame) -> set[tuple[int, int]]:
    """Pool ids of the device's private pools in which graph-capture code allocated."""
    capture = graph_capture_stacks(frames)
    if not capture:
        return set()
    codes = np.fromiter(capture, dtype=np.int64, count=len(capture))
    ev, b = frames.events, frames.blocks
    ev = ev.loc[(ev["device"] == device) & ev["address"].notna(), ["address", "stack_id"]]
    b = b[b["device"] == device]
    hits = []
    for address, sid in ((ev["address"], ev["stack_id"]), (b["address"], b["stack_id"])):
        graph = np.isin(sid.to_numpy(dtype=np.int64, na_value=-1), codes)
        hits.append(pool_of(address.to_numpy(dtype=np.int64)[graph], segs))
    where = np.unique(np.concatenate(hits))
    where = where[where >= 0]
    pools = zip(segs["pool_id_0"].to_numpy()[where].tolist(), segs["pool_id_1"].to_numpy()[where].tolist(), strict=True)
    return set(pools)


def pool_owners(frames: SnapshotFrames) -> pd.DataFrame:
    """One row per private pool: device, pool_id_0, pool_id_1, owner (``cuda_graph`` or
    ``unknown``), rule (the evidence: ``graph_pool_id``, ``graph_capture_stack`` or
    ``private_pool``), reserved_bytes, allocated_bytes."""
    return memo(frames, "pool_owners", lambda: _pool_owners(frames))


def _pool_owners(frames: SnapshotFrames) -> pd.DataFrame:
    rows = []
    for device in sorted(frames.segments.loc[frames.segments["is_private_pool"], "device"].unique().tolist()):
        segs = _private_segments(frames, device)
        by_stack = _graph_pools_by_stack(frames, device, segs)
        for _, group in segs.groupby(["pool_id_0", "pool_id_1"], sort=True):
            pool = (int(group["pool_id_0"].iloc[0]), int(group["pool_id_1"].iloc[0]))
            rule = "graph_pool_id" if pool[0] > 0 and pool[1] == 0 else "private_pool"
            if rule == "private_pool" and pool in by_stack:
                rule = "graph_capture_stack"
            rows.append(
                {
                    "device": int(device),
                    "pool_id_0": pool[0],
                    "pool_id_1": pool[1],
                    "owner": "unknown" if rule == "private_pool" else "cuda_graph",
                    "rule": rule,
                    "reserved_bytes": int(group["total_size_bytes"].sum()),
                    "allocated_bytes": int(group["allocated_bytes"].sum()),
                }
            )
    columns = ["device", "pool_id_0", "pool_id_1", "owner", "rule", "reserved_bytes", "allocated_bytes"]
    return pd.DataFrame(rows, columns=columns)


def pool_rules(frames: SnapshotFrames, device: int, addresses: np.ndarray) -> np.ndarray:
    """For each address of the device: the rule of the private pool holding it (see
    :func:`pool_owners`), or None outside every private pool."""
    segs = _private_segments(frames, device)
    where = pool_of(addresses, segs)
    out = np.full(addresses.size, None, dtype=object)
    if segs.empty:
        return out
    owners = pool_owners(frames)
    owners = owners[owners["device"] == device].set_index(["pool_id_0", "pool_id_1"])["rule"]
    seg_rule = owners.reindex(list(zip(segs["pool_id_0"], segs["pool_id_1"], strict=True))).to_numpy(dtype=object)
    inside = where >= 0
    out[inside] = seg_rule[where[inside]]
    return out


__all__ = ["graph_capture_stacks", "pool_of", "pool_owners", "pool_rules"]
