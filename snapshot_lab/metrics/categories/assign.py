"""One category for every allocation of the trace and every block of the snapshot.

Allocations in the trace get their stack's category (:mod:`.stacks`), then the gradient
lifetime rule (:mod:`.gradients`) and the private-pool rule. A block alive at the dump takes
the category of the allocation that made it, so the dump and the timeline agree; blocks
allocated before the trace began (a ring buffer that wrapped, or recording started late) take
their own stack's category, and the stackless ones are judged by :func:`_before_trace`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo
from ..lifetimes import device_lifetimes
from .gradients import THREAD_CODES, free_stack_ids, gradient_mask, thread_codes
from .parallel import inflight_mask, parallel_stack_categories, pipeline_forward_stacks, reduce_scatter_stacks
from .stacks import cache_stacks, stack_categories, stack_threads, stacks_with_frame

CATEGORIES = (
    "parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "kv_cache",
    "inflight_activation",
    "fsdp_unsharded_params",
    "comm_buffer",
    "ddp_bucket",
    "cuda_graph_pool",
    "other",
)
CODES = {c: i for i, c in enumerate(CATEGORIES)}
_NONE = -1


@dataclass(frozen=True)
class Categorization:
    """``block_category``: aligned with ``frames.blocks`` (None for free blocks without a
    stack); ``alloc_codes``: per device, the code (index into CATEGORIES) of every row of
    :func:`~snapshot_lab.metrics.lifetimes.device_lifetimes`."""

    block_category: pd.Series
    alloc_codes: dict[int, np.ndarray]
    param_sizes: dict[int, frozenset[int]]


def _codes(stack_ids: np.ndarray, stack_cat: pd.Series) -> np.ndarray:
    size = max(int(stack_ids.max(initial=-1)), int(stack_cat.index.max()) if len(stack_cat) else -1) + 2
    table = np.full(size, _NONE, dtype=np.int64)
    if len(stack_cat):
        table[stack_cat.index.to_numpy(dtype=np.int64)] = stack_cat.map(CODES).to_numpy(dtype=np.int64)
    return table[stack_ids]  # stack id -1 reads the last slot: no stack


def in_private_pool(addresses: np.ndarray, segments: pd.DataFrame) -> np.ndarray:
    """Addresses that fall inside a private pool's segment (CUDA graphs, MemPool)."""
    priv = segments[segments["is_private_pool"]].sort_values("address")
    if priv.empty or addresses.size == 0:
        return np.zeros(addresses.size, dtype=bool)
    starts = priv["address"].to_numpy()
    ends = starts + priv["total_size_bytes"].to_numpy()
    i = np.searchsorted(starts, addresses, side="right") - 1
    ok = i >= 0
    inside = np.zeros(addresses.size, dtype=bool)
    inside[ok] = addresses[ok] < ends[i[ok]]
    return inside


def _before_trace(sizes: np.ndarray, param_sizes: frozenset[int], params_have_stacks: bool) -> np.ndarray:
    """Stackless blocks alive at the dump that were allocated before the trace began.

    A parameter-sized one is a parameter when no parameter has a stack: recording started after
    the model was built, and the optimizer state of the exact same sizes is the evidence
    (``late_gpt2_python``: with the simpler rule "parameter-sized and stackless = gradient",
    every parameter was called a gradient). When parameters do have stacks, recording began
    before the model and these are gradients of a backward pass that fell out of the ring buffer.
    """
    shaped = np.isin(sizes, np.fromiter(param_sizes, dtype=np.int64, count=len(param_sizes)))
    out = np.full(sizes.size, CODES["other"], dtype=np.int64)
    out[shaped] = CODES["gradient"] if params_have_stacks else CODES["parameter"]
    return out


@dataclass(frozen=True)
class _StackFacts:
    """What the stacks say, computed once per snapshot."""

    category: pd.Series  # stack_id -> category (the parallel libraries' rules over the generic ones)
    threads: pd.Series  # stack_id -> main / autograd / other
    eligible: set[int]  # stacks whose category the gradient rule may override
    zero_grad: set[int]  # stacks of zero_grad()
    reduce_scatter: set[int]  # FSDP reduce-scatters: their outputs are sharded gradients
    pipeline_forward: set[int]  # a pipeline stage's forward


def _device(
    frames: SnapshotFrames,
    device: int,
    facts: _StackFacts,
    block_codes: np.ndarray,
) -> tuple[np.ndarray, frozenset[int]]:
    stack_cat = facts.category
    lt = device_lifetimes(frames, device)
    ev = frames.events[frames.events["device"] == device]
    seg = frames.segments[frames.segments["device"] == device]
    blk_mask = (frames.blocks["device"] == device).to_numpy()
    b = frames.blocks[blk_mask]
    b_sid = b["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    b_base = _codes(b_sid, stack_cat)
    live = (b["state"] != "inactive").to_numpy()
    b_req = b["requested_size_bytes"].to_numpy(dtype=np.int64, na_value=-1)

    sid = lt["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    code = _codes(sid, stack_cat)
    sizes = lt["size_bytes"].to_numpy(dtype=np.int64)
    surviving = lt["free_index"].isna().to_numpy()
    # parameter sizes: parameters still alive (FSDP frees the unsharded originals once it has
    # sharded them: their sizes are no parameter's any more), and the optimizer state that
    # mirrors them (its temporaries excluded)
    param_sizes = frozenset(
        set(sizes[(code == CODES["parameter"]) & surviving].tolist())
        | set(b_req[live & (b_base == CODES["parameter"])].tolist())
        | set(sizes[(code == CODES["optimizer_state"]) & surviving].tolist())
        | set(b_req[live & (b_base == CODES["optimizer_state"])].tolist())
    ) - {-1}
    grad = gradient_mask(lt, ev, facts.threads, facts.eligible, set(param_sizes), facts.zero_grad)
    if facts.reduce_scatter:
        grad |= gradient_mask(lt, ev, facts.threads, facts.reduce_scatter, None, set())
    code[grad] = CODES["gradient"]
    if facts.pipeline_forward:
        free_thread = thread_codes(free_stack_ids(lt, ev), facts.threads)
        freed = lt["free_index"].notna().to_numpy()
        by_backward = freed & ((free_thread == THREAD_CODES["autograd"]) | (free_thread == THREAD_CODES["none"]))
        inflight = inflight_mask(sid, by_backward, facts.pipeline_forward)
        code[inflight & (code == CODES["activation"])] = CODES["inflight_activation"]
    stackless = (code == _NONE) & ~grad
    code[stackless & ~surviving] = CODES["activation"]  # backward temporaries: made and freed again
    code[stackless & surviving] = CODES["other"]
    code[in_private_pool(lt["address"].to_numpy(dtype=np.int64), seg)] = CODES["cuda_graph_pool"]

    # blocks alive at the dump: the category of the allocation that made them
    out = b_base.copy()
    by_addr = pd.Series(np.arange(len(lt))[surviving], index=lt["address"].to_numpy()[surviving])
    by_addr = by_addr[~by_addr.index.duplicated(keep="last")]
    pos = by_addr.reindex(b["address"].to_numpy()).to_numpy()
    matched = live & ~np.isnan(pos)
    out[matched] = code[pos[matched].astype(np.int64)]
    before = live & ~matched & (b_sid < 0)
    if before.any():
        params_have_stacks = bool((code == CODES["parameter"]).any() or (live & (b_base == CODES["parameter"])).any())
        out[before] = _before_trace(b_req[before], param_sizes, params_have_stacks)
    out[b["is_private_pool"].to_numpy()] = CODES["cuda_graph_pool"]
    block_codes[blk_mask] = out
    return code, param_sizes


def categorize(frames: SnapshotFrames) -> Categorization:
    """Categories of every allocation and block (computed once per snapshot)."""
    return memo(frames, "categories", lambda: _categorize(frames))


def _stack_facts(frames: SnapshotFrames) -> _StackFacts:
    generic = stack_categories(frames)
    library = parallel_stack_categories(frames)
    stack_cat = generic.copy()
    if len(library):
        stack_cat.loc[library.index] = library.to_numpy()
    caches = cache_stacks(frames)
    eligible = set(stack_cat.index[stack_cat.isin(["activation", "other", "gradient"])].astype(int)) - caches
    return _StackFacts(
        category=stack_cat,
        threads=stack_threads(frames),
        eligible=eligible,
        zero_grad=stacks_with_frame(frames, "zero_grad"),
        reduce_scatter=reduce_scatter_stacks(frames),
        pipeline_forward=pipeline_forward_stacks(frames),
    )


def _categorize(frames: SnapshotFrames) -> Categorization:
    facts = _stack_facts(frames)
    block_codes = np.full(len(frames.blocks), _NONE, dtype=np.int64)
    alloc_codes: dict[int, np.ndarray] = {}
    param_sizes: dict[int, frozenset[int]] = {}
    devices = sorted(set(frames.info.devices) | set(frames.blocks["device"].unique().tolist()))
    for d in devices:
        alloc_codes[d], param_sizes[d] = _device(frames, d, facts, block_codes)
    names = np.array([*CATEGORIES, None], dtype=object)
    block_category = pd.Series(names[block_codes], index=frames.blocks.index, name="category")
    return Categorization(block_category, alloc_codes, param_sizes)
