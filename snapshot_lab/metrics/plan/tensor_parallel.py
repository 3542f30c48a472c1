"""Tensor parallelism (Megatron-style column/row pairs, as ``ColwiseParallel`` /
``RowwiseParallel`` do): which layers are sharded and which activations shrink.

Which Linear layers: those whose forward allocates inside the repeated blocks (the stacks show
a module from a ``linear.py``, as ``torch.nn.Linear`` and Transformer Engine's are, or
Hugging Face's ``Conv1D``, GPT-2's Linear), by default; ``layers="all"`` also shards the model's other
matrices (embeddings, head) and the activations after a Linear outside the blocks (a
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
from .rewrite import Rewrite
from .structure import TrainingStructure, stack_info

TP_LAYERS = ("blocks", "all")
# where Linear-like modules are defined: torch.nn.Linear, Transformer Engine / apex (linear.py),
# Hugging Face's Conv1D (pytorch_utils.py)
LINEAR_FILES = ("/linear.py", "transformers/pytorch_utils.py")


@dataclass(frozen=True)
class TensorParallel:
    degree: int
    row_scale: np.ndarray  # per recorded allocation: its size on one rank / recorded size
    param_scale: np.ndarray  # per parameter
    partials: tuple[int, ...]  # rows that are row-parallel outputs (all-reduced)
    column_layers: int  # Linear calls per pass taken as column-parallel
    row_layers: int
    row_params: frozenset[int] = frozenset()  # parameters of row-parallel layers (sharded along columns)


def plan_tensor_parallel(
    frames: SnapshotFrames, s: TrainingStructure, degree: int, layers: str = "blocks"
) -> TensorParallel:
    a = s.allocs
    n = len(a)
    scale = np.ones(n)
    partials: list[int] = []
    inv = 1.0 / degree
    code = a["code"].to_numpy()
    part = a["part"].to_numpy()
    block = a["block"].to_numpy()
    phase = a["phase"].to_numpy()
    pass_id = a["pass_id"].to_numpy()
    size = a["size"].to_numpy()
    info = stack_info(frames)
    sid = a["sid"].to_numpy()
    main = a["main"].to_numpy()
    free_pos = a["free_pos"].to_numpy()
    is_linear = np.array(
        [info.module_file.get(int(x), "").replace("\\", "/").endswith(LINEAR_FILES) for x in sid], dtype=bool
    )
    # a tensor the Linear returns is freed some time; what its first call keeps for good is
    # cuBLAS's workspace
    call = is_linear & main & (phase == "forward") & (part == "block") & (free_pos >= 0)
    activation_like = np.isin(code, [CODES["activation"], CODES["other"]])
    order = np.argsort(pass_id, kind="stable")  # rows are in event order already
    bounds = np.searchsorted(pass_id[order], [p.index for p in s.passes] + [len(s.passes)])
    n_col = n_row = 0
    last_roles: list[tuple[int, str]] = []
    for k in range(len(s.passes)):
        rows_p = np.sort(order[bounds[k] : bounds[k + 1]])
        fwd = rows_p[phase[rows_p] == "forward"]
        role: dict[int, str] = {}
        groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        calls = fwd[call[fwd]]
        for r in calls.tolist():
            parent = info.call_path.get(int(sid[r]), ())[:-1]
            groups.setdefault((int(block[r]), parent), []).append(r)
        alone = 0
        for rows in groups.values():
            if len(rows) >= 2:
                for r in rows[:-1]:
                    role[r] = "col"
                role[rows[-1]] = "row"
            else:
                role[rows[0]] = "col" if alone % 2 == 0 else "row"
                alone += 1
        n_col = sum(1 for v in role.values() if v == "col")  # the last pass's: a steady iteration
        n_row = len(role) - n_col
        last_roles = [(int(block[r]), role[r]) for r in calls.tolist()]
        sharded = False
        for r in fwd.tolist():
            if not activation_like[r]:
                continue
            if part[r] == "block":
                kind = role.get(r)
                if kind == "col":
                    sharded = True
                    scale[r] = inv
                elif kind == "row":
                    sharded = False
                    partials.append(r)
                elif sharded:
                    scale[r] = inv
            elif part[r] == "post" and layers == "all":
                if is_linear[r]:
                    sharded = True
                    scale[r] = inv
                elif sharded:
                    scale[r] = inv
            else:
                sharded = False
        # backward: like the forward tensors of the same size in the same block
        f_blk = fwd[part[fwd] == "block"]
        bwd = rows_p[(phase[rows_p] == "backward") & (part[rows_p] == "block") & (code[rows_p] == CODES["activation"])]
        for j in np.unique(block[f_blk]).tolist():
            f_rows = f_blk[block[f_blk] == j]
            f_size, f_scale = size[f_rows], scale[f_rows]
            if (f_scale == 1.0).all():
                continue
            mean = float((f_size * f_scale).sum() / max(int(f_size.sum()), 1))
            by_size: dict[int, float] = {}
            for sz in np.unique(f_size).tolist():
                by_size[int(sz)] = float(f_scale[f_size == sz].mean())
            for r in bwd[block[bwd] == j].tolist():
                scale[r] = by_size.get(int(size[r]), mean)
    p_scale = np.ones(len(s.params))
    matrix = s.params["matrix"].to_numpy()
    pb = s.params["block"].to_numpy()
    # a block's matrices, in parameter order, are its Linear layers in forward order (when the
    # counts agree): which weights are row-parallel
    row_params: set[int] = set()
    if s.passes:
        for j in range(s.n_blocks):
            mats = np.flatnonzero(matrix & (pb == j))
            roles = [r for b, r in last_roles if b == j]
            if len(roles) == mats.size:
                row_params.update(int(i) for i, r in zip(mats.tolist(), roles, strict=True) if r == "row")
    shard = matrix & ((pb >= 0) | (layers == "all"))
    p_scale[shard] = inv
    # gradients and optimizer state: like the parameter they mirror
    param = a["param"].to_numpy()
    mirrors = np.flatnonzero(np.isin(code, [CODES["gradient"], CODES["optimizer_state"]]) & (param >= 0))
    scale[mirrors] = p_scale[param[mirrors]]
    return TensorParallel(degree, scale, p_scale, tuple(partials), n_col, n_row, frozenset(row_params))


def apply_tensor_parallel(rw: Rewrite, tp: TensorParallel, local: np.ndarray, wrap: bool = True) -> None:
    """Rescale the recorded allocations; the all-reduces of row-parallel outputs get their
    partial-sum buffers. ``local``: parameter bytes per rank after tensor parallelism."""
    s = rw.structure
    t = tp.degree
    a = s.allocs
    code = a["code"].to_numpy()
    changed = np.flatnonzero((tp.row_scale != 1.0) & (code != CODES["parameter"]))
    new = np.ceil(a["size"].to_numpy()[changed] * tp.row_scale[changed]).astype(np.int64)
    rw.size[changed] = new
    for r, c in zip(changed.tolist(), code[changed].tolist(), strict=True):
        if c == CODES["gradient"]:
            rw.rule[r] = f"gradients of sharded matrices, 1/{t} (tensor parallel)"
        elif c == CODES["optimizer_state"]:
            rw.rule[r] = f"optimizer state of sharded matrices, 1/{t} (tensor parallel)"
        elif tp.row_scale[r] == 1.0 / t:
            rw.rule[r] = f"activations between column- and row-parallel layers, 1/{t} (tensor parallel)"
        else:
            rw.rule[r] = "backward temporaries, scaled like the block's forward tensors of their size (tensor parallel)"
    pos = a["pos"].to_numpy()
    for r in tp.partials:
        p = int(pos[r])
        k = rw.alloc_at(
            p,
            int(rw.size[r]),
            int(rw.stream[r]),
            "comm_buffer",
            "tensor-parallel all-reduce input: a row-parallel layer's partial sums",
        )
        rw.free_at(p, k, before=False)
        rw.rule[r] = "row-parallel outputs, all-reduced (replicated, tensor parallel)"
    if wrap:
        _shard_at_wrap(rw, tp, local)


def _shard_at_wrap(rw: Rewrite, tp: TensorParallel, local: np.ndarray) -> None:
    """``distribute_tensor``: each sharded matrix's shard is copied out and the full one freed; a
    weight sharded along its columns (row-parallel) is first split into every rank's chunk, each
    copied out (a column slice is not contiguous), then the chunks are freed."""
    s = rw.structure
    rows = s.params["row"].to_numpy()
    t = tp.degree
    at = s.wrap_pos
    rule = f"parameters: sharded matrices 1/{t}, the rest replicated (tensor parallel)"
    for i, r in enumerate(rows.tolist()):
        if local[i] == rw.size[r]:
            continue
        chunks = []
        if i in tp.row_params:
            chunks = [
                rw.alloc_at(
                    at, int(local[i]), int(rw.stream[r]), "parameter", "distribute_tensor: column chunks (temporary)"
                )
                for _ in range(t)
            ]
        rw.alloc_at(at, int(local[i]), int(rw.stream[r]), "parameter", rule, source_row=int(r))
        for k in chunks:
            rw.free_at(at, k)
        rw.add(at, ("f", int(r)))
        rw.free_after[r] = -1
