"""Tensor parallelism (Megatron-style column/row pairs, as ``ColwiseParallel`` /
``RowwiseParallel`` do): which layers are sharded and which activations shrink.

Which Linear layers: those whose forward allocates inside the repeated blocks (the stacks show
a module from a ``linear.py``, as ``torch.nn.Linear`` and Transformer Engine's are, or
Hugging Face's ``Conv1D``, GPT-2's Linear), by default; ``layers="all"`` also shards the model's
other matrices (embeddings, head) and the activations after a Linear outside the blocks (a
vocabulary-parallel head and loss). Norms, biases and every other vector stay replicated.

Pairs: the Linear layers one module calls (a block's attention calls q, k, v, o; its MLP fc1,
fc2) are column-parallel but the last, which is row-parallel; Linear layers alone in their
module (an MLP stack of Linear+GELU blocks) alternate column, row. Activations from a
column-parallel output up to the next row-parallel output are sharded (1/t: the heads, the
MLP's hidden units); the row-parallel output is all-reduced (its partial sums are one more
full-size buffer while that happens) and everything else (norms, residual adds, the embedding,
head and loss) is replicated. The backward's temporaries are gradients of those activations:
one of the same size as a block's forward tensors scales like them (on average, when several
such tensors scale differently), others like the block's activations overall. Parameters,
gradients and optimizer state of sharded matrices are 1/t.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...frames import SnapshotFrames
from ..categories import CODES
from .messages import (
    RULE_BACKWARD_TEMPORARIES,
    RULE_COLUMN_CHUNKS,
    RULE_GRADIENTS,
    RULE_OPTIMIZER_STATE,
    RULE_PARAMETERS,
    RULE_PARTIAL_SUMS,
    RULE_ROW_OUTPUTS,
    RULE_SHARDED_ACTIVATIONS,
)
from .rewrite import Rewrite
from .structure import StackInfo, TrainingStructure, stack_info

TP_LAYERS = ("blocks", "all")
# where Linear-like modules are defined: torch.nn.Linear, Transformer Engine / apex (linear.py),
# Hugging Face's Conv1D (pytorch_utils.py)
LINEAR_FILES = ("/linear.py", "transformers/pytorch_utils.py")


@dataclass(frozen=True)
class TensorParallel:
    degree: int
    # per recorded allocation: its size on one rank / recorded size
    row_scale: np.ndarray
    param_scale: np.ndarray  # per parameter
    # rows that are row-parallel outputs (all-reduced)
    partials: tuple[int, ...]
    column_layers: int  # Linear calls per pass taken as column-parallel
    row_layers: int
    # parameters of row-parallel layers (sharded along columns)
    row_params: frozenset[int] = frozenset()


COLUMN, ROW = "col", "row"  # a Linear layer's role in its column/row pair


@dataclass(frozen=True)
class _Allocations:
    """The columns of the recorded allocations that the tensor-parallel rules read."""

    code: np.ndarray
    part: np.ndarray
    block: np.ndarray
    phase: np.ndarray
    pass_id: np.ndarray
    size: np.ndarray
    stack_id: np.ndarray
    param: np.ndarray
    is_linear: np.ndarray  # made inside a Linear-like module's forward
    # a Linear layer's output in a block's forward (one per call)
    linear_call: np.ndarray
    activation_like: np.ndarray
    stacks: StackInfo

    @classmethod
    def of(cls, frames: SnapshotFrames, structure: TrainingStructure) -> _Allocations:
        allocs = structure.allocs
        stacks = stack_info(frames)
        stack_id = allocs["sid"].to_numpy()
        phase = allocs["phase"].to_numpy()
        part = allocs["part"].to_numpy()
        code = allocs["code"].to_numpy()
        sids, of_row = np.unique(stack_id, return_inverse=True)  # each stack's module file once
        module_files = [stacks.module_file.get(int(sid), "").replace("\\", "/") for sid in sids.tolist()]
        is_linear = np.array([file.endswith(LINEAR_FILES) for file in module_files], dtype=bool)[of_row.reshape(-1)]
        # a tensor the Linear returns is freed some time; what its first call keeps for good is
        # cuBLAS's workspace
        in_block_forward = (phase == "forward") & (part == "block")
        freed = allocs["free_pos"].to_numpy() >= 0
        linear_call = is_linear & allocs["main"].to_numpy() & in_block_forward & freed
        return cls(
            code=code,
            part=part,
            block=allocs["block"].to_numpy(),
            phase=phase,
            pass_id=allocs["pass_id"].to_numpy(),
            size=allocs["size"].to_numpy(),
            stack_id=stack_id,
            param=allocs["param"].to_numpy(),
            is_linear=is_linear,
            linear_call=linear_call,
            activation_like=np.isin(code, [CODES["activation"], CODES["unknown"], CODES["other"]]),
            stacks=stacks,
        )


def plan_tensor_parallel(
    frames: SnapshotFrames, structure: TrainingStructure, degree: int, layers: str = "blocks"
) -> TensorParallel:
    """Which recorded allocations shrink to 1/``degree`` on each rank, per pass: the Linear
    layers' roles, the activations between them, the backward's temporaries like them; the
    parameters, gradients and optimizer state of the sharded matrices."""
    allocs = _Allocations.of(frames, structure)
    scale = np.ones(len(structure.allocs))
    partials: list[int] = []
    column_layers = row_layers = 0
    last_roles: list[tuple[int, str]] = []
    for pass_rows in _rows_per_pass(allocs.pass_id, structure):
        forward = pass_rows[allocs.phase[pass_rows] == "forward"]
        calls = forward[allocs.linear_call[forward]]
        roles = _layer_roles(calls, allocs)
        # the last pass's counts: a steady iteration
        column_layers = sum(1 for role in roles.values() if role == COLUMN)
        row_layers = len(roles) - column_layers
        last_roles = [(int(allocs.block[row]), roles[row]) for row in calls.tolist()]
        _scale_forward(forward, roles, allocs, layers == "all", 1.0 / degree, scale, partials)
        _scale_backward(pass_rows, forward, allocs, scale)
    param_scale = np.ones(len(structure.params))
    matrix = structure.params["matrix"].to_numpy()
    param_block = structure.params["block"].to_numpy()
    row_params = _row_parallel_params(structure, last_roles)
    param_scale[matrix & ((param_block >= 0) | (layers == "all"))] = 1.0 / degree
    # gradients and optimizer state: like the parameter they mirror
    state = np.isin(allocs.code, [CODES["gradient"], CODES["optimizer_state"]])
    mirrors = np.flatnonzero(state & (allocs.param >= 0))
    scale[mirrors] = param_scale[allocs.param[mirrors]]
    return TensorParallel(
        degree,
        scale,
        param_scale,
        tuple(partials),
        column_layers,
        row_layers,
        frozenset(row_params),
    )


def _rows_per_pass(pass_id: np.ndarray, structure: TrainingStructure) -> list[np.ndarray]:
    """The allocation rows of every pass, in event order."""
    # rows are in event order already
    order = np.argsort(pass_id, kind="stable")
    passes = [training_pass.index for training_pass in structure.passes]
    bounds = np.searchsorted(pass_id[order], [*passes, len(structure.passes)])
    return [np.sort(order[bounds[i] : bounds[i + 1]]) for i in range(len(structure.passes))]


def _layer_roles(calls: np.ndarray, allocs: _Allocations) -> dict[int, str]:
    """Column or row, per Linear call: those one module calls are column-parallel but the last;
    those alone in their module alternate column, row."""
    roles: dict[int, str] = {}
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for row in calls.tolist():
        parent = allocs.stacks.call_path.get(int(allocs.stack_id[row]), ())[:-1]
        groups.setdefault((int(allocs.block[row]), parent), []).append(row)
    alone = 0
    for rows in groups.values():
        if len(rows) >= 2:
            for row in rows[:-1]:
                roles[row] = COLUMN
            roles[rows[-1]] = ROW
        else:
            roles[rows[0]] = COLUMN if alone % 2 == 0 else ROW
            alone += 1
    return roles


def _scale_forward(
    forward: np.ndarray,
    roles: dict[int, str],
    allocs: _Allocations,
    shard_post: bool,
    shard: float,
    scale: np.ndarray,
    partials: list[int],
) -> None:
    """The forward's activations from a column-parallel output up to the next row-parallel
    output shrink to ``shard``; the row-parallel outputs are all-reduced (``partials``).
    ``shard_post``: also after a Linear outside the blocks (a vocabulary-parallel head)."""
    sharded = False
    for row in forward.tolist():
        if not allocs.activation_like[row]:
            continue
        if allocs.part[row] == "block":
            role = roles.get(row)
            if role == COLUMN:
                sharded = True
                scale[row] = shard
            elif role == ROW:
                sharded = False
                partials.append(row)
            elif sharded:
                scale[row] = shard
        elif allocs.part[row] == "post" and shard_post:
            if allocs.is_linear[row]:
                sharded = True
                scale[row] = shard
            elif sharded:
                scale[row] = shard
        else:
            sharded = False


def _scale_backward(
    pass_rows: np.ndarray,
    forward: np.ndarray,
    allocs: _Allocations,
    scale: np.ndarray,
) -> None:
    """The backward's temporaries in a block: like the block's forward tensors of the same size
    (their mean scale), others like the block's forward tensors overall."""
    block, size = allocs.block, allocs.size
    forward_in_blocks = forward[allocs.part[forward] == "block"]
    in_block = allocs.part[pass_rows] == "block"
    is_activation = allocs.code[pass_rows] == CODES["activation"]
    backward = pass_rows[(allocs.phase[pass_rows] == "backward") & in_block & is_activation]
    for j in np.unique(block[forward_in_blocks]).tolist():
        forward_rows = forward_in_blocks[block[forward_in_blocks] == j]
        forward_size, forward_scale = size[forward_rows], scale[forward_rows]
        if (forward_scale == 1.0).all():
            continue
        total = max(int(forward_size.sum()), 1)
        mean = float((forward_size * forward_scale).sum() / total)
        by_size: dict[int, float] = {}
        for nbytes in np.unique(forward_size).tolist():
            by_size[int(nbytes)] = float(forward_scale[forward_size == nbytes].mean())
        for row in backward[block[backward] == j].tolist():
            scale[row] = by_size.get(int(size[row]), mean)


def _row_parallel_params(
    structure: TrainingStructure,
    last_roles: list[tuple[int, str]],
) -> set[int]:
    """A block's matrices, in parameter order, are its Linear layers in forward order (when the
    counts agree): which weights are row-parallel."""
    row_params: set[int] = set()
    if not structure.passes:
        return row_params
    matrix = structure.params["matrix"].to_numpy()
    param_block = structure.params["block"].to_numpy()
    for j in range(structure.n_blocks):
        matrices = np.flatnonzero(matrix & (param_block == j))
        roles = [role for block, role in last_roles if block == j]
        if len(roles) == matrices.size:
            pairs = zip(matrices.tolist(), roles, strict=True)
            row_params.update(int(param) for param, role in pairs if role == ROW)
    return row_params


def apply_tensor_parallel(
    rewrite: Rewrite,
    plan: TensorParallel,
    local: np.ndarray,
    wrap: bool = True,
) -> None:
    """Rescale the recorded allocations; the all-reduces of row-parallel outputs get their
    partial-sum buffers. ``local``: parameter bytes per rank after tensor parallelism."""
    allocs = rewrite.structure.allocs
    degree = plan.degree
    code = allocs["code"].to_numpy()
    changed = np.flatnonzero((plan.row_scale != 1.0) & (code != CODES["parameter"]))
    new_size = np.ceil(allocs["size"].to_numpy()[changed] * plan.row_scale[changed])
    rewrite.size[changed] = new_size.astype(np.int64)
    for row, row_code in zip(changed.tolist(), code[changed].tolist(), strict=True):
        if row_code == CODES["gradient"]:
            rewrite.rule[row] = RULE_GRADIENTS.format(degree=degree)
        elif row_code == CODES["optimizer_state"]:
            rewrite.rule[row] = RULE_OPTIMIZER_STATE.format(degree=degree)
        elif plan.row_scale[row] == 1.0 / degree:
            rewrite.rule[row] = RULE_SHARDED_ACTIVATIONS.format(degree=degree)
        else:
            rewrite.rule[row] = RULE_BACKWARD_TEMPORARIES
    positions = allocs["pos"].to_numpy()
    for row in plan.partials:
        position = int(positions[row])
        size, stream = int(rewrite.size[row]), int(rewrite.stream[row])
        key = rewrite.alloc_at(position, size, stream, "comm_buffer", RULE_PARTIAL_SUMS)
        rewrite.free_at(position, key, before=False)
        rewrite.rule[row] = RULE_ROW_OUTPUTS
    if wrap:
        _shard_at_wrap(rewrite, plan, local)


def _shard_at_wrap(rewrite: Rewrite, plan: TensorParallel, local: np.ndarray) -> None:
    """``distribute_tensor``: each sharded matrix's shard is copied out and the full one freed; a
    weight sharded along its columns (row-parallel) is first split into every rank's chunk, each
    copied out (a column slice is not contiguous), then the chunks are freed."""
    structure = rewrite.structure
    rows = structure.params["row"].to_numpy()
    at = structure.wrap_pos
    rule = RULE_PARAMETERS.format(degree=plan.degree)
    for i, row in enumerate(rows.tolist()):
        if local[i] == rewrite.size[row]:
            continue
        stream = int(rewrite.stream[row])
        chunks = []
        if i in plan.row_params:
            chunks = [
                rewrite.alloc_at(
                    at,
                    int(local[i]),
                    stream,
                    "parameter",
                    RULE_COLUMN_CHUNKS,
                )
                for _ in range(plan.degree)
            ]
        rewrite.alloc_at(at, int(local[i]), stream, "parameter", rule, source_row=int(row))
        for key in chunks:
            rewrite.free_at(at, key)
        rewrite.add(at, ("f", int(row)))
        rewrite.free_after[row] = -1
