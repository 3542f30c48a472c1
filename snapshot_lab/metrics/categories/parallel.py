"""What parallel-training libraries allocate: FSDP (FSDP2 ``fully_shard`` and FSDP1
``FullyShardedDataParallel``), tensor parallelism (DTensor) and pipeline parallelism
(``torch.distributed.pipelining``). Their allocations are recognised by the library frames on
their stacks (Python frames, recorded in both stack modes):

- ``parameter``: FSDP2's sharded parameters (``_fsdp_param.py: _init_sharded_param``), FSDP1's
  sharded flat parameters (``_flat_param.py: _get_shard``; ``flatten_tensors`` while it builds
  them), DTensor shards made by ``distribute_tensor`` (``placement_types.py: _shard_tensor``);
- ``fsdp_unsharded_params``: the all-gathered, unsharded parameters, alive from a unit's
  all-gather until it reshards (FSDP2 ``alloc_all_gather_outputs``/``init_all_gather_outputs``,
  FSDP1 ``_alloc_padded_unsharded_flat_param``/``init_flat_param_attributes``);
- ``comm_buffer``: buffers of collectives: FSDP2's all-gather and reduce-scatter inputs and
  outputs (``_fsdp_collectives.py``), FSDP1's reduce-scatter tensors
  (``_runtime_utils.py: _get_reduce_scatter_tensors``), DTensor's redistributions and functional
  collectives, pipelining's send/receive buffers (``stage.py: _make_tensor_from_meta`` and the
  ``_create_*_recv_info`` helpers). A reduce-scatter output that outlives the backward pass is
  the sharded gradient (``gradient``);
- ``inflight_activation``: activations a pipeline stage's forward (``stage.py:
  forward_one_chunk``) saved for a microbatch whose backward had not run yet: freed by that
  backward, not by the forward itself.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .stacks import stacks_where

# (path suffix, function names or None for any) -> category
_RULES: tuple[tuple[str, frozenset[str] | None, str], ...] = (
    ("fsdp/_fully_shard/_fsdp_param.py", frozenset({"_init_sharded_param", "reset_sharded_param"}), "parameter"),
    (
        "fsdp/_fully_shard/_fsdp_param.py",
        frozenset({"alloc_all_gather_outputs", "init_all_gather_outputs", "alloc_storage", "init_unsharded_param"}),
        "fsdp_unsharded_params",
    ),
    ("fsdp/_fully_shard/_fsdp_collectives.py", None, "comm_buffer"),
    ("fsdp/_flat_param.py", frozenset({"_get_shard", "shard", "flatten_tensors"}), "parameter"),
    (
        "fsdp/_flat_param.py",
        frozenset({"_alloc_padded_unsharded_flat_param", "init_flat_param_attributes"}),
        "fsdp_unsharded_params",
    ),
    ("fsdp/_runtime_utils.py", frozenset({"_get_reduce_scatter_tensors"}), "comm_buffer"),
    ("distributed/tensor/placement_types.py", frozenset({"_shard_tensor"}), "parameter"),
    ("distributed/tensor/_redistribute.py", None, "comm_buffer"),
    ("distributed/_functional_collectives.py", None, "comm_buffer"),
    (
        "distributed/pipelining/stage.py",
        frozenset(
            {
                "_make_tensor_from_meta",
                "_create_grad_recv_info",
                "_create_act_recv_info",
                "_retrieve_recv_activations",
                "_retrieve_recv_grads",
                "get_fwd_recv_ops",
                "get_bwd_recv_ops",
            }
        ),
        "comm_buffer",
    ),
)
# a reduce-scatter whose output outlives backward: the sharded gradient
_REDUCE_SCATTER = (
    ("fsdp/_fully_shard/_fsdp_collectives.py", "foreach_reduce"),
    ("fsdp/_runtime_utils.py", "_get_reduce_scatter_tensors"),
)
_PP_FORWARD = ("distributed/pipelining/stage.py", "forward_one_chunk")


def _innermost_library_match(frames: SnapshotFrames) -> pd.Series:
    """For every stack with a parallel library's frame: the category of its innermost match."""
    sf = frames.stack_frames
    fn = sf["filename"].astype(str).str.replace("\\", "/", regex=False)
    nm = sf["name"].astype(str)
    cat = pd.Series(None, index=sf["frame_id"].to_numpy(), dtype=object)
    for suffix, names, category in reversed(_RULES):  # earlier rules win
        hit = fn.str.endswith(suffix) & (nm.isin(names) if names is not None else True)
        cat[hit.to_numpy()] = category
    frame_cat = cat.dropna()
    if frame_cat.empty or frames.stacks.empty:
        return pd.Series([], dtype=object)
    st = frames.stacks[frames.stacks["frame_id"].isin(frame_cat.index)].sort_values(["stack_id", "depth"])
    st = st.drop_duplicates("stack_id")
    return pd.Series(frame_cat.reindex(st["frame_id"]).to_numpy(), index=st["stack_id"].to_numpy(), dtype=object)


def stacks_with(frames: SnapshotFrames, pairs: tuple[tuple[str, str], ...]) -> set[int]:
    """stack_ids with a frame of one of these (path suffix, function name) pairs."""
    if frames.stacks.empty:
        return set()
    sf = frames.stack_frames
    fn = sf["filename"].astype(str).str.replace("\\", "/", regex=False)
    nm = sf["name"].astype(str)
    hit = pd.Series(False, index=sf.index)
    for suffix, name in pairs:
        hit |= fn.str.endswith(suffix) & (nm == name)
    return stacks_where(frames, hit)


def parallel_stack_categories(frames: SnapshotFrames) -> pd.Series:
    """Category of every stack a parallel library made (they override the generic rules)."""
    return _innermost_library_match(frames)


def reduce_scatter_stacks(frames: SnapshotFrames) -> set[int]:
    return stacks_with(frames, _REDUCE_SCATTER)


def pipeline_forward_stacks(frames: SnapshotFrames) -> set[int]:
    return stacks_with(frames, (_PP_FORWARD,))


def inflight_mask(sid: np.ndarray, freed_by_backward: np.ndarray, forward_stacks: set[int]) -> np.ndarray:
    """Allocations made in a pipeline stage's forward and freed by the backward pass (on
    autograd's thread): saved for a microbatch until its backward ran. Forward outputs the
    schedule keeps to merge the step's outputs (the last stage's logits, ``pp_1f1b_*_rank1``)
    are freed by the program's own thread at the end of the step, and are the stage's own."""
    if not forward_stacks:
        return np.zeros(sid.size, dtype=bool)
    fwd = np.fromiter(forward_stacks, dtype=np.int64, count=len(forward_stacks))
    return np.isin(sid, fwd) & freed_by_backward


def sharded_parameter_stacks(frames: SnapshotFrames) -> set[int]:
    """Stacks of DTensor shards made by ``distribute_tensor`` (tensor-parallel parameters)."""
    return stacks_with(frames, (("distributed/tensor/placement_types.py", "_shard_tensor"),))
