"""The pipeline schedule a stage's trace shows, for files without a sidecar (issue #37).

``torch.distributed.pipelining`` names no schedule in its frames (GPipe's and 1F1B's loops are
both ``_step_microbatches``), but the order of a stage's allocations does. Three kinds of
allocation are read: a microbatch's forward (a ``forward_one_chunk`` frame of the pipelining
library), the backward (no Python frame: the autograd engine's threads) and the optimizer's step
(a ``torch/optim/`` frame, which ends a step); everything else (sends, receives, the loss) is
left out. The forwards between two backwards form a run.

- GPipe runs every forward of a step before any backward: one run per step.
- 1F1B interleaves them: after a warm-up of ``S - s`` forwards (stage ``s`` of ``S``), one
  forward per backward: several runs per step. The shortest is one microbatch's forward, so the
  step's runs in its units count the microbatches.

Said only where the optimizer's allocations bound a step; otherwise (SGD without momentum makes
none after its first step, a trace shorter than a step) unknown (None). Written on the two-stage
GPT pair under both schedules; checked after on the MLP pairs and on four-stage runs, where a
first rule (a run's repeating period as its microbatches) counted an MLP's identical layers as
microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...frames import SnapshotFrames
from .filenames import slashed_filenames

FORWARD_CHUNK = "forward_one_chunk"
PIPELINING_FILES = "distributed/pipelining/"
OPTIMIZER_FILES = "torch/optim/"
# kinds of allocation in the order read
FORWARD, BACKWARD, OPTIMIZER = 1, 2, 3
MIN_RUNS = 2  # complete forward runs needed to say anything
MAX_RUNS = 400  # runs read (the pattern repeats every step)


@dataclass(frozen=True)
class TraceSchedule:
    schedule: str  # "GPipe" or "1F1B", as the sidecar spells them
    microbatches: int | None  # per step, where the trace bounds a step
    runs: int  # complete forward runs read


def _stacks_with(frames: SnapshotFrames, mask: np.ndarray) -> np.ndarray:
    ids = frames.stack_frames.loc[mask, "frame_id"]
    stacks = frames.stacks
    return np.unique(stacks.loc[stacks["frame_id"].isin(ids), "stack_id"].to_numpy())


def _allocation_kinds(frames: SnapshotFrames) -> np.ndarray | None:
    """The kind of each allocation of the three, in order, on the device with the most forward
    allocations; None when no allocation is a pipelined forward."""
    sf = frames.stack_frames
    files = slashed_filenames(sf)
    chunk = (sf["name"].astype(str) == FORWARD_CHUNK) & files.str.contains(PIPELINING_FILES, regex=False)
    forward = _stacks_with(frames, chunk.to_numpy())
    if forward.size == 0:
        return None
    python = _stacks_with(frames, files.str.endswith(".py").to_numpy())
    optimizer = _stacks_with(frames, files.str.contains(OPTIMIZER_FILES, regex=False).to_numpy())
    ev = frames.events
    allocs = ev.loc[ev["action"] == "alloc", ["device", "stack_id"]]
    sid = allocs["stack_id"].fillna(-1).to_numpy(dtype=np.int64)
    is_forward = np.isin(sid, forward)
    if not is_forward.any():
        return None
    device = allocs["device"].to_numpy()
    on = device == np.bincount(device[is_forward]).argmax()
    kind = np.zeros(sid.size, dtype=np.int8)
    kind[~np.isin(sid, python)] = BACKWARD
    kind[np.isin(sid, optimizer)] = OPTIMIZER
    kind[is_forward] = FORWARD
    return kind[on & (kind > 0)]


def _runs(kind: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, end and kind of each maximal run of one kind."""
    cut = np.flatnonzero(np.diff(kind)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [kind.size]])
    return starts, ends, kind[starts]


def _steps(run_kinds: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """The lengths of the complete forward runs (a backward after each) of every step that an
    optimizer run ends (the first may have begun before the trace)."""
    steps: list[list[int]] = []
    current: list[int] = []
    last = min(run_kinds.size, MAX_RUNS)
    for i in range(last):
        k = int(run_kinds[i])
        if k == OPTIMIZER:
            if current:
                steps.append(current)
            current = []
        elif k == FORWARD and i + 1 < run_kinds.size and run_kinds[i + 1] == BACKWARD:
            current.append(int(lengths[i]))
    return steps


def _microbatches(runs: list[int]) -> int | None:
    """A 1F1B step's microbatches: its runs in units of the shortest (one microbatch's forward),
    when every run is a whole number of them."""
    unit = min(runs)
    if unit <= 0 or any(length % unit for length in runs):
        return None
    return sum(runs) // unit


def schedule_from_trace(frames: SnapshotFrames) -> TraceSchedule | None:
    """GPipe or 1F1B, and the microbatches per step where the trace shows them (None: not a
    pipelined stage's trace, or not decided)."""
    read = _allocation_kinds(frames)
    if read is None:
        return None
    starts, ends, run_kinds = _runs(read)
    steps = _steps(run_kinds, ends - starts)
    runs = sum(len(step) for step in steps)
    if not steps or runs < MIN_RUNS:
        return None
    most = max(steps, key=len)
    if len(most) == 1:  # every forward of a step before its backward
        return TraceSchedule("GPipe", None, runs)
    return TraceSchedule("1F1B", _microbatches(most), runs)
