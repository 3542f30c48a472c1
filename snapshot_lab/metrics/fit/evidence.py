"""What the trace shows of one training step, as a :class:`~.tape.Tape` plus the facts the
levers need: the parameters (and which are matrices autocast would copy), the optimizer, the
repeated blocks and where each one's forward and backward are.

Which allocations scale with the batch is decided by what they are: parameters, gradients,
optimizer state, anything made while the model was built or during the optimizer step, and
library caches kept for the process's life (cuBLAS workspaces) do not; the inputs and whatever
the forward and backward made does, except tensors the size of a parameter made by the backward
(a weight's gradient before it is accumulated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from ..categories import CATEGORIES, CODES
from ..categories.stacks import cache_stacks
from ..plan.structure import TrainingStructure, stack_info
from .tape import NEVER, Tape, make_tape

# operations autocast runs in float32 whatever their inputs (torch's "fp32 list" and losses)
AUTOCAST_FP32_OPS = frozenset(
    {
        "softmax",
        "log_softmax",
        "layer_norm",
        "group_norm",
        "rms_norm",
        "cross_entropy",
        "nll_loss",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "normalize",
        "cosine_similarity",
    }
)
_FUNCTIONAL = "torch/nn/functional.py"
# parameters of these modules are what autocast casts to bfloat16 (Linear, convolutions)
_CAST_MODULES = ("torch/nn/modules/linear.py", "torch/nn/modules/conv.py")
OPTIMIZER_FILES = {
    "adamw.py": "adamw",
    "adam.py": "adam",
    "sgd.py": "sgd-momentum",
    "adafactor.py": "adafactor",
    "adagrad.py": "adagrad",
    "rmsprop.py": "rmsprop",
    "bitsandbytes": "8-bit adam",
}


@dataclass(frozen=True)
class BlockSpan:
    """One repeated block's instance in one pass, as positions on the tape."""

    uid: int
    index: int  # which block of the model (0..n-1)
    forward_start: float
    forward_end: float
    backward_start: float
    backward_end: float
    matrix_bytes: int  # its parameters autocast would copy


@dataclass(frozen=True)
class PassSpan:
    forward_start: float
    backward_start: float
    backward_end: float
    outside_matrix_bytes: int  # matrices outside the blocks autocast would copy (a head)


@dataclass(frozen=True)
class StepEvidence:
    tape: Tape
    complete: bool  # a whole step (forward, backward, optimizer step) was recorded
    parameter_bytes: int
    optimizer: str
    optimizer_source: str
    optimizer_state_bytes: int  # as recorded (0 when the step was not reached)
    n_blocks: int
    blocks: tuple[BlockSpan, ...]
    passes: tuple[PassSpan, ...]
    notes: tuple[str, ...]


def stack_innermost(frames: SnapshotFrames) -> pd.DataFrame:
    """Per stack_id, its innermost Python frame's file and function."""
    if frames.stacks.empty:
        return pd.DataFrame({"filename": [], "name": []})
    sf = frames.stack_frames.set_index("frame_id")
    rows = frames.stacks.join(sf, on="frame_id")
    rows = rows[rows["line"] > 0].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    return pd.DataFrame(
        {
            "filename": rows["filename"].astype(str).str.replace("\\", "/", regex=False).to_numpy(),
            "name": rows["name"].astype(str).to_numpy(),
        },
        index=rows["stack_id"].to_numpy(),
    )


def fp32_stacks(frames: SnapshotFrames) -> set[int]:
    """Stacks whose innermost Python frame is a functional autocast keeps in float32."""
    inner = stack_innermost(frames)
    hit = inner["filename"].str.endswith(_FUNCTIONAL) & inner["name"].isin(AUTOCAST_FP32_OPS)
    return {int(s) for s in inner.index[hit.to_numpy()]}


def cast_param_stacks(frames: SnapshotFrames) -> set[int]:
    """Stacks that made a Linear's or convolution's parameter."""
    if frames.stacks.empty:
        return set()
    fn = frames.stack_frames["filename"].astype(str).str.replace("\\", "/", regex=False)
    hit = fn.str.endswith(_CAST_MODULES[0]) | fn.str.endswith(_CAST_MODULES[1])
    fids = frames.stack_frames.loc[hit, "frame_id"]
    return set(frames.stacks.loc[frames.stacks["frame_id"].isin(fids), "stack_id"].astype(int))


def optimizer_in_stacks(frames: SnapshotFrames) -> str | None:
    """The optimizer whose source file appears on the stacks (None: none did)."""
    if frames.stack_frames.empty:
        return None
    files = frames.stack_frames["filename"].astype(str).str.replace("\\", "/", regex=False)
    for key, name in OPTIMIZER_FILES.items():
        pattern = "bitsandbytes/optim" if key == "bitsandbytes" else f"/torch/optim/{key}"
        if files.str.contains(pattern, regex=False).any():
            return name
    return None


def row_categories(frames: SnapshotFrames, s: TrainingStructure, complete: bool) -> tuple[np.ndarray, np.ndarray]:
    """Tape category of every recorded allocation and whether it scales with the batch."""
    a = s.allocs
    code = a["code"].to_numpy()
    phase = a["phase"].to_numpy(dtype=object)
    size = a["size"].to_numpy()
    sid = a["sid"].to_numpy()
    cat = np.array(CATEGORIES, dtype=object)[np.clip(code, 0, len(CATEGORIES) - 1)]
    model_state = np.isin(code, [CODES["parameter"], CODES["gradient"], CODES["optimizer_state"]])
    in_pass = np.isin(phase, ["data", "forward", "backward"])
    cache = np.isin(sid, list(cache_stacks(frames)))
    kept = complete & (a["free_pos"].to_numpy() < 0) & (phase != "data")
    param_sized = (phase == "backward") & np.isin(size, s.params["size"].to_numpy())
    scales = in_pass & ~model_state & ~cache & ~kept & ~param_sized
    out = np.where(model_state, cat, np.where(scales, np.where(phase == "data", "input", "activation"), "workspace"))
    return out.astype(object), scales


def param_facts(frames: SnapshotFrames, s: TrainingStructure) -> tuple[int, np.ndarray]:
    """Parameter bytes and, per parameter, whether autocast would copy it."""
    sizes = s.params["size"].to_numpy(dtype=np.int64)
    rows = s.params["row"].to_numpy()
    sid = s.allocs["sid"].to_numpy()[rows]
    older = sum(n for n, c, _ in s.untracked if c == "parameter")
    castable = np.isin(sid, list(cast_param_stacks(frames))) & s.params["matrix"].to_numpy(dtype=bool)
    return int(sizes.sum()) + int(older), castable


def recorded_tape(frames: SnapshotFrames, s: TrainingStructure, complete: bool) -> Tape:
    """Every allocation of the trace (and the blocks older than it, from the start)."""
    a = s.allocs
    cat, scales = row_categories(frames, s, complete)
    size = a["size"].to_numpy(dtype=np.float64)
    free_pos = a["free_pos"].to_numpy()
    end = np.where(free_pos >= 0, free_pos.astype(np.float64), NEVER)
    n_blocks_per_pass = max(s.n_blocks, 1)
    block = a["block"].to_numpy()
    uid = np.where(block >= 0, a["pass_id"].to_numpy() * n_blocks_per_pass + block, -1)
    fp32 = np.isin(a["sid"].to_numpy(), list(fp32_stacks(frames)))
    tape = make_tape(
        a["pos"].to_numpy(dtype=np.float64),
        end,
        np.where(scales, 0.0, size),
        np.where(scales, size, 0.0),
        cat,
        a["stream"].to_numpy(dtype=np.int64),
        a["phase"].to_numpy(dtype=object),
        uid,
        fp32,
    )
    if not s.untracked:
        return tape
    old = np.array([n for n, _, _ in s.untracked], dtype=np.float64)
    older = make_tape(
        np.full(old.size, -1.0),
        np.full(old.size, NEVER),
        old,
        np.zeros(old.size),
        np.array([c if c in CATEGORIES else "workspace" for _, c, _ in s.untracked], dtype=object),
        np.array([st for _, _, st in s.untracked], dtype=np.int64),
        "setup",
    )
    return older.with_rows(tape)


def block_spans(s: TrainingStructure, castable: np.ndarray) -> tuple[tuple[BlockSpan, ...], tuple[PassSpan, ...]]:
    """Where every block instance and every pass is on the recorded trace."""
    p_block = s.params["block"].to_numpy()
    p_size = s.params["size"].to_numpy()
    per_block = [int(p_size[castable & (p_block == j)].sum()) for j in range(s.n_blocks)]
    outside = int(p_size[castable & (p_block < 0)].sum())
    blocks: list[BlockSpan] = []
    passes: list[PassSpan] = []
    for p in s.passes:
        passes.append(PassSpan(p.forward_start, p.backward_start, p.backward_end, outside))
        for j, ((f0, f1), (b0, b1)) in enumerate(zip(p.block_forward, p.block_backward, strict=False)):
            if j >= s.n_blocks:
                break
            uid = p.index * max(s.n_blocks, 1) + j
            blocks.append(BlockSpan(uid, j, float(f0), float(f1), float(b0), float(b1), per_block[j]))
    return tuple(blocks), tuple(passes)
