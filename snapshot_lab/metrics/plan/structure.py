"""What a recorded training run shows of its own structure, as far as a plan needs it.

From one device's trace and the allocation categories (:mod:`..categories`):

- the *passes*: each forward (from the first allocation inside a module's forward on the
  program's thread) and its backward (from the first allocation on autograd's thread, or
  without a stack, which with Python stacks is the same thing, to the optimizer step or the
  next forward);
- the *blocks*: the layers the model repeats (a GPT's decoder blocks, an MLP's Linear+GELU
  pairs), found as the longest run of forward allocations whose stacks repeat with one period,
  all made inside modules called from one call site (``x = blk(x)``); a block instance starts
  where the block's first stack follows its last. Before the blocks is the model's ``pre``
  part (embeddings), after them its ``post`` part (final norm, head, loss);
- which *parameter* belongs to which block: parameters are allocated in module order, so the
  same repeat, found in the (size, stack) sequence of the parameter allocations with as many
  repetitions as the forward has blocks, cuts them into the blocks' parameters; those before
  are the ``pre`` part's, those after the ``post`` part's;
- each block's *backward*: the span in which the activations its forward saved are freed;
- which parameter each *gradient* and each piece of *optimizer state* mirrors (same size, in
  parameter order).

Nothing here is specific to one model: the tests run the same rules on a config-built GPT and
on an MLP stack (``tests/test_plan.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames, event_positions
from .._memo import forget, memo
from ..categories import CODES, categorize, stack_threads
from ..categories.gradients import THREAD_CODES, thread_codes
from ..categories.stacks import MODULE_CALL_NAMES, MODULE_PY
from ..history.lifetimes import device_lifetimes
from ..history.ooms import fatal_rows
from .messages import (
    MISSING_ITERATION,
    MISSING_STACKS,
    NOTE_BUCKET_VIEW,
    NOTE_NO_BLOCKS,
    NOTE_PARAMETERS_NOT_REPEATED,
    NOTE_RECORDED_DDP,
    NOTE_UNEVEN_BLOCKS,
    NOTE_UNTRACKED,
)

# every allocation's phase: setup (before the first forward), data, forward, backward or step;
# its part of the model: pre (before the blocks), block or post (after them; the loss too), ''
# outside the passes. Both are categorical columns of the allocation table (one byte a row)
PHASES = ("setup", "data", "forward", "backward", "step")
PARTS = ("", "pre", "block", "post")
PHASE_CODE = {name: code for code, name in enumerate(PHASES)}
PART_CODE = {name: code for code, name in enumerate(PARTS)}
_PHASE_DTYPE = pd.CategoricalDtype(list(PHASES))
_PART_DTYPE = pd.CategoricalDtype(list(PARTS))


@dataclass(frozen=True)
class StackInfo:
    """Per stack_id: the module call sites on the stack (outermost first, as frame ids) and the
    file of the innermost module's ``forward``."""

    call_path: dict[int, tuple[int, ...]]
    # per call site: the called module's forward ("file:function")
    callee: dict[int, tuple[str, ...]]
    module_file: dict[int, str]
    frame_label: dict[int, str]  # frame_id -> "file:function:line"

    def in_module(self, sid: int) -> bool:
        return bool(self.call_path.get(sid))


def stack_info(frames: SnapshotFrames) -> StackInfo:
    return memo(frames, "plan.stack_info", lambda: _stack_info(frames))


def _stack_info(frames: SnapshotFrames) -> StackInfo:
    frame_table = frames.stack_frames
    fname = frame_table["filename"].astype(str).str.replace("\\", "/", regex=False).to_numpy()
    name = frame_table["name"].astype(str).to_numpy()
    line = frame_table["line"].to_numpy()
    fid_pos = {int(frame): i for i, frame in enumerate(frame_table["frame_id"].to_numpy())}
    label = {int(frame): f"{fname[i].rsplit('/', 1)[-1]}:{name[i]}:{int(line[i])}" for frame, i in fid_pos.items()}
    call_path: dict[int, tuple[int, ...]] = {}
    callee: dict[int, tuple[str, ...]] = {}
    module_file: dict[int, str] = {}
    stacks = frames.stacks.sort_values(["stack_id", "depth"])
    for sid, group in stacks.groupby("stack_id", sort=False):
        fids = group["frame_id"].to_numpy()
        pos = [fid_pos.get(int(frame_id), -1) for frame_id in fids]
        is_call = [
            position >= 0 and fname[position].endswith(MODULE_PY) and name[position] in MODULE_CALL_NAMES
            for position in pos
        ]
        sites: list[int] = []
        callees: list[str] = []
        innermost_forward = None
        run_start = -1
        for i in range(len(pos)):
            if not is_call[i]:
                continue
            if run_start < 0:
                run_start = i
            if innermost_forward is None and i > 0 and pos[i - 1] >= 0:
                innermost_forward = fname[pos[i - 1]]
            # the call site: the first frame outside this run of module.py call frames; the
            # module's forward: the frame just inside it
            if i + 1 < len(pos) and not is_call[i + 1] and pos[i + 1] >= 0:
                sites.append(int(fids[i + 1]))
                inner = pos[run_start - 1] if run_start > 0 else -1
                callees.append(f"{fname[inner]}:{name[inner]}" if inner >= 0 else "")
                run_start = -1
        call_path[int(sid)] = tuple(reversed(sites))
        callee[int(sid)] = tuple(reversed(callees))
        if innermost_forward is not None:
            module_file[int(sid)] = innermost_forward
    return StackInfo(call_path, callee, module_file, label)


@dataclass(frozen=True)
class Pass:
    """One forward and its backward (positions are rows of the device's trace)."""

    index: int
    # first position after the previous pass (its data loading starts here)
    data_start: int
    forward_start: int
    backward_start: int
    # exclusive: the optimizer step or the next pass begins here
    backward_end: int
    # per block: first and last position of its forward allocations
    block_forward: tuple[tuple[int, int], ...]
    # per block: first and last position of its backward span
    block_backward: tuple[tuple[int, int], ...]
    # the post part's backward (loss, head), first
    post_backward: tuple[int, int]
    # last position of the backward of what the program computed outside modules (the loss)
    loss_backward_end: int
    pre_backward: tuple[int, int]  # the pre part's backward (embeddings), last
    # allocation row of the model's output (last allocation inside a module's forward)
    output_row: int
    end: int  # exclusive: the next pass's data starts here


@dataclass(frozen=True)
class TrainingStructure:
    device: int
    n_events: int
    # event_index of every position of the device's trace
    event_index: np.ndarray
    allocs: pd.DataFrame  # one row per allocation of the trace (see _annotate)
    # one row per parameter tensor: row, size, block (-1: none), part, matrix
    params: pd.DataFrame
    passes: tuple[Pass, ...]
    n_blocks: int
    block_period: int  # forward allocations per block
    block_call_site: str  # where the blocks are called from
    # the model is built: parameters allocated before this position
    wrap_pos: int
    # optimizer steps: first and last position
    steps: tuple[tuple[int, int], ...]
    # positions of the program's own empty_cache() calls
    releases: tuple[int, ...]
    # (position, requested bytes, stream) of the recorded OOMs
    ooms: tuple[tuple[int, int, int], ...]
    # blocks alive before the trace: (bytes, category, stream)
    untracked: tuple[tuple[int, str, int], ...]
    notes: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        return not self.missing

    def origin(self, pos: int) -> int:
        """The recorded event index at trace position ``pos`` (clipped to the trace)."""
        if self.n_events == 0:
            return 0
        return int(self.event_index[min(max(pos, 0), self.n_events - 1)])

    def position(self, event_index: int) -> int:
        return int(np.searchsorted(self.event_index, event_index))


# --------------------------------------------------------------------------- repeats


def tandem_repeat(seq: np.ndarray, min_count: int = 2) -> tuple[int, int, int]:
    """The run of ``seq`` that repeats one period most often: (period, start, count); count 0
    when nothing repeats ``min_count`` times."""
    length = int(seq.size)
    if length < 2 * min_count:
        return 0, 0, 0
    # the distance from every element to the next equal one (a block's stacks recur once per
    # block, so the block's period is among them)
    order = np.argsort(seq, kind="stable")
    same = seq[order][1:] == seq[order][:-1]
    gaps = (order[1:] - order[:-1])[same]
    candidates = {int(gap) for gap in np.unique(gaps) if 0 < gap <= length // min_count}
    best = (0, 0, 0, 0)  # coverage, -period, start, count
    for period in sorted(candidates):
        equal = seq[:-period] == seq[period:]
        if not equal.any():
            continue
        # longest run of True
        padded = np.r_[False, equal, False]
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        starts, ends = edges[::2], edges[1::2]
        longest = int(np.argmax(ends - starts))
        run, start = int(ends[longest] - starts[longest]), int(starts[longest])
        count = (run + period) // period
        if count < min_count:
            continue
        key = (count * period, -period, start, count)
        if key > best:
            best = key
    if best[0] == 0:
        return 0, 0, 0
    return -best[1], best[2], best[3]


# --------------------------------------------------------------------------- passes


def _per_stack(stack_ids: np.ndarray, value_of: Callable[[int], bool]) -> np.ndarray:
    """``value_of(stack_id)`` for every element of ``stack_ids``, called once per distinct stack."""
    distinct, inverse = np.unique(stack_ids, return_inverse=True)
    values = np.array([value_of(int(stack_id)) for stack_id in distinct.tolist()], dtype=bool)
    return values[inverse.reshape(-1)] if distinct.size else np.zeros(stack_ids.size, dtype=bool)


def _threads(frames: SnapshotFrames, sid: np.ndarray) -> np.ndarray:
    return thread_codes(sid, stack_threads(frames))


@dataclass
class _Scan:
    pos: np.ndarray  # alloc positions
    sid: np.ndarray
    main: np.ndarray  # on the program's own thread
    grad_thread: np.ndarray  # on autograd's thread (or stackless)
    module: np.ndarray  # inside a module's forward
    optim: np.ndarray  # optimizer step


# the kinds of allocation that start, turn and end a pass (0: any other)
_FORWARD, _AUTOGRAD, _STEP = 1, 2, 3


def _find_passes(scan: _Scan) -> list[tuple[int, int, int]]:
    """(forward_start, backward_start, backward_end) positions of every pass whose backward
    was recorded.

    The allocations that matter are forward ones (inside a module, on the program's thread),
    autograd's and the optimizer's; of a run of one kind only its first (and, of autograd's, its
    last) counts. A pass starts at the first run of forward allocations, or at the next one that
    comes after a run of autograd's; its backward is the first run of autograd's after that, and
    it ends where that run does (a forward or an optimizer step follows)."""
    forward = scan.main & scan.module
    grad = scan.grad_thread & ~forward
    step = scan.optim & ~forward & ~grad
    kind = np.where(forward, _FORWARD, np.where(grad, _AUTOGRAD, np.where(step, _STEP, 0)))
    rows = np.flatnonzero(kind)
    kinds = kind[rows]
    run_first = np.flatnonzero(np.r_[True, kinds[1:] != kinds[:-1]]) if rows.size else rows
    run_last = np.r_[run_first[1:], kinds.size] - 1
    run_kind = kinds[run_first]
    forward_runs = np.flatnonzero(run_kind == _FORWARD)
    grad_runs = np.flatnonzero(run_kind == _AUTOGRAD)
    if not forward_runs.size:
        return []
    grads_so_far = np.cumsum(run_kind == _AUTOGRAD)[forward_runs]
    starting = forward_runs[np.r_[True, grads_so_far[1:] > grads_so_far[:-1]]]
    following = np.searchsorted(grad_runs, starting)
    found = following < grad_runs.size
    starting, backward_runs = starting[found], grad_runs[following[found]]
    first_pos, last_pos = scan.pos[rows[run_first]], scan.pos[rows[run_last]]
    return list(
        zip(
            first_pos[starting].tolist(),
            first_pos[backward_runs].tolist(),
            last_pos[backward_runs].tolist(),
            strict=True,
        )
    )


# --------------------------------------------------------------------------- the structure


def training_structure(frames: SnapshotFrames, device: int) -> TrainingStructure:
    """The structure of the run on ``device`` (computed once per snapshot and device)."""
    return memo(frames, ("plan.structure", device), lambda: _structure(frames, device))


def forget_structure(frames: SnapshotFrames, device: int) -> None:
    """Drop the structure :func:`training_structure` keeps (its table of every allocation: 200
    MiB at 5M trace entries), for a caller that reads it no more."""
    forget(frames, ("plan.structure", device))


def _structure(frames: SnapshotFrames, device: int) -> TrainingStructure:
    events = frames.device_events(device)
    base_index = events["event_index"].to_numpy()
    lifetimes = device_lifetimes(frames, device).reset_index(drop=True)
    codes = categorize(frames).alloc_codes.get(device, np.zeros(0, dtype=np.int64))
    info = stack_info(frames)
    scan = _scan(frames, lifetimes, base_index, codes, info)
    missing: list[str] = []
    if frames.stacks.empty or not (scan.sid >= 0).any():
        missing.append(MISSING_STACKS)
    raw = _find_passes(scan) if not missing else []
    if not raw and not missing:
        missing.append(MISSING_ITERATION)
    steps = _optimizer_steps(scan, raw)
    allocs = _allocation_table(lifetimes, scan, codes, base_index, events["stream"].to_numpy())
    notes: list[str] = []
    passes: list[Pass] = []
    n_blocks, period, site_label = 0, 0, ""
    if raw:
        passes, n_blocks, period, site_label = _passes_and_blocks(
            allocs,
            raw,
            info,
            len(events),
            notes,
        )
    params = _params(allocs, passes, n_blocks, notes)
    _from_ddp(allocs, params, passes, notes)
    wrap = _wrap_pos(allocs, passes)
    _map_mirrors(allocs, params)
    untracked = _untracked(frames, device)
    if untracked:
        nbytes = sum(entry[0] for entry in untracked)
        notes.append(NOTE_UNTRACKED.format(count=len(untracked), nbytes=nbytes))
    if n_blocks == 0 and raw:
        notes.append(NOTE_NO_BLOCKS)
    return TrainingStructure(
        device=device,
        n_events=len(events),
        event_index=base_index,
        allocs=allocs,
        params=params,
        passes=tuple(passes),
        n_blocks=n_blocks,
        block_period=period,
        block_call_site=site_label,
        wrap_pos=wrap,
        steps=tuple(steps),
        releases=_program_releases(frames, device),
        ooms=_recorded_ooms(events),
        untracked=untracked,
        notes=tuple(notes),
        missing=tuple(missing),
    )


def _scan(
    frames: SnapshotFrames,
    lifetimes: pd.DataFrame,
    base_index: np.ndarray,
    codes: np.ndarray,
    info: StackInfo,
) -> _Scan:
    """Where each allocation happens in the device's trace, and who made it."""
    positions = event_positions(base_index, lifetimes["event_index"].to_numpy())
    stack_ids = lifetimes["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    thread = _threads(frames, stack_ids)
    module = _per_stack(stack_ids, info.in_module)
    main = thread == THREAD_CODES["main"]
    grad_thread = (thread == THREAD_CODES["autograd"]) | (thread == THREAD_CODES["none"])
    optim = codes == CODES["optimizer_state"]
    return _Scan(positions, stack_ids, main, grad_thread, module, optim)


def _optimizer_steps(scan: _Scan, raw: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Optimizer steps: runs of optimizer allocations, interrupted only by a forward (split
    where a pass starts in between)."""
    step_positions = scan.pos[scan.optim & scan.main]
    if not step_positions.size:
        return []
    forward_starts = np.array([forward for forward, _, _ in raw], dtype=np.int64)
    after = np.searchsorted(forward_starts, step_positions, side="left")
    cuts = np.flatnonzero(np.diff(after)) + 1
    firsts = step_positions[np.r_[0, cuts]]
    lasts = step_positions[np.r_[cuts - 1, step_positions.size - 1]]
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


def _allocation_table(
    lifetimes: pd.DataFrame,
    scan: _Scan,
    codes: np.ndarray,
    base_index: np.ndarray,
    stream_of: np.ndarray,
) -> pd.DataFrame:
    """One row per allocation of the trace, before the passes and blocks are marked."""
    free_index = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)
    free_pos = np.where(free_index >= 0, event_positions(base_index, np.maximum(free_index, 0)), -1)
    count = len(lifetimes)

    def unset() -> np.ndarray:  # an int32 column of -1, its own array (copy=False shares none)
        return np.full(count, -1, dtype=np.int32)

    # copy=False: the scan's arrays become the columns themselves (a table of 1.6M rows at 5M
    # entries); the columns written in place later (param, phase) are made here
    allocs = pd.DataFrame(
        {
            "row": np.arange(count),
            "event_index": lifetimes["event_index"].to_numpy(),
            "pos": scan.pos,
            "free_pos": free_pos,
            "size": lifetimes["size_bytes"].to_numpy(dtype=np.int64),
            "sid": scan.sid,
            "code": codes if codes.size == count else np.full(count, CODES["other"]),
            "main": scan.main,
            "grad_thread": scan.grad_thread,
            "module": scan.module,
            "pass_id": unset(),
            "phase": pd.Categorical.from_codes(np.zeros(count, dtype=np.int8), dtype=_PHASE_DTYPE),
            "part": pd.Categorical.from_codes(np.zeros(count, dtype=np.int8), dtype=_PART_DTYPE),
            "block": unset(),
            "param": unset(),
            # the recorded run's own parallel machinery (DDP's buckets): left out of plans
            "dropped": np.zeros(count, dtype=bool),
        },
        copy=False,
    )
    allocs["code_recorded"] = allocs["code"]
    allocs["free_pos_recorded"] = allocs["free_pos"]
    n_events = len(base_index)
    last = max(n_events - 1, 0)
    no_streams = np.zeros(0, dtype=np.int64)
    allocs["stream"] = stream_of[np.minimum(scan.pos, last)] if n_events else no_streams
    return allocs


def _program_releases(frames: SnapshotFrames, device: int) -> tuple[int, ...]:
    """Positions of the program's own empty_cache() calls."""
    from ..allocator.releases import find_releases

    releases = find_releases(frames, device)
    return tuple(release.start for release in releases if release.cause == "empty_cache")


def _recorded_ooms(events: pd.DataFrame) -> tuple[tuple[int, int, int], ...]:
    """(position, requested bytes, stream) of the recorded OOMs that ended the job (not those it
    went on from: :mod:`..history.ooms`)."""
    oom_positions = np.flatnonzero(fatal_rows(events))
    return tuple(
        (
            int(position),
            int(events["size_bytes"].iloc[position]),
            int(events["stream"].iloc[position]),
        )
        for position in oom_positions.tolist()
    )


def _untracked(frames: SnapshotFrames, device: int) -> tuple[tuple[int, str, int], ...]:
    """Blocks alive just before the trace's first event (memory older than the trace), with the
    category of the block at the dump when it survives there."""
    from ..allocator.model import recorded_settings
    from ..allocator.state import start_state

    state = start_state(frames, device, recorded_settings(frames.info.allocator_settings))
    if not any(segment.live for segment in state.segments):
        return ()
    blocks = frames.blocks[frames.blocks["device"] == device]
    cats = categorize(frames).block_category.reindex(blocks.index)
    cat_at = {
        int(address): (category if isinstance(category, str) else "other")
        for address, category in zip(blocks["address"], cats, strict=True)
    }
    out = []
    for seg in state.segments:
        for addr, size in sorted(seg.live.items()):
            out.append((int(size), cat_at.get(int(addr), "other"), int(seg.stream)))
    return tuple(out)


# of a forward's allocations the repeated blocks must make
MIN_BLOCK_SHARE = 0.2


@dataclass(frozen=True)
class _BlockRepeat:
    """The repeated block, as the canonical pass's forward shows it."""

    count: int  # blocks (0: no model made of blocks)
    period: int  # forward allocations per block
    # index of the first block's first allocation in the canonical pass's forward
    start: int
    best_pass: int  # the canonical pass
    # depth of the blocks' call site on the call paths (-1: none found)
    site_depth: int
    site_frame: int  # frame id of the blocks' call site (-1: none found)
    signature: np.ndarray  # stack ids of one block's forward allocations


def _passes_and_blocks(
    allocs: pd.DataFrame,
    raw: list[tuple[int, int, int]],
    info: StackInfo,
    n_positions: int,
    notes: list[str],
) -> tuple[list[Pass], int, int, str]:
    sid = allocs["sid"].to_numpy()
    forwards = _Forwards.of(allocs, raw)
    repeat = _block_repeat(sid, forwards.sets(), info)
    blocks = _all_blocks(sid, forwards, repeat, info)
    found = _pass_spans(allocs, _bounds(allocs, raw, n_positions, forwards), blocks)
    counts = blocks.counts.tolist()
    n_blocks = max(set(counts), key=counts.count) if counts else 0
    if len(set(counts)) > 1:
        notes.append(NOTE_UNEVEN_BLOCKS.format(counts=sorted(set(counts)), n_blocks=n_blocks))
    site_frame = repeat.site_frame
    label = info.frame_label.get(site_frame, "") if site_frame >= 0 else ""
    passes = _passes(allocs["pos"].to_numpy(), found, blocks)
    _annotate(allocs, found, blocks)
    return passes, n_blocks, int(repeat.period if n_blocks else 0), label


@dataclass(frozen=True)
class _Forwards:
    """Every pass's forward allocations on the program's thread inside modules: ``rows[low[k]:high[k]]``
    for pass ``k`` (the trace's allocations are in event order, so positions grow with rows)."""

    rows: np.ndarray
    low: np.ndarray
    high: np.ndarray

    @classmethod
    def of(cls, allocs: pd.DataFrame, raw: list[tuple[int, int, int]]) -> _Forwards:
        pos = allocs["pos"].to_numpy()
        rows = np.flatnonzero(allocs["main"].to_numpy() & allocs["module"].to_numpy())
        spans = np.array(raw, dtype=np.int64).reshape(-1, 3)
        low = np.searchsorted(pos[rows], spans[:, 0], "left")
        high = np.searchsorted(pos[rows], spans[:, 1], "left")
        return cls(rows, low, high)

    def sets(self) -> list[np.ndarray]:
        return [self.rows[low:high] for low, high in zip(self.low.tolist(), self.high.tolist(), strict=True)]


def _block_repeat(sid: np.ndarray, forward_sets: list[np.ndarray], info: StackInfo) -> _BlockRepeat:
    """The canonical block: the pass whose forward repeats most (the latest of equals: the first
    pass makes one-off allocations, such as cuBLAS's workspace, inside its first block), and
    where the blocks are called from."""
    best = (0, 0, 0, -1)
    # a training loop repeats the same forward: each distinct one is searched once
    repeats: dict[bytes, tuple[int, int, int]] = {}
    for index, forward_rows in enumerate(forward_sets):
        stack_ids = sid[forward_rows]
        key = stack_ids.tobytes()
        if key not in repeats:
            repeats[key] = tandem_repeat(stack_ids)
        period, start, count = repeats[key]
        covered, best_covered = count * period, best[0] * best[1]
        if covered > best_covered or (covered == best_covered and count >= best[0] and count >= 2):
            best = (count, period, start, index)
    count, period, start, best_pass = best
    if count * period < MIN_BLOCK_SHARE * len(forward_sets[best_pass]):
        # a few equal neighbours (a ResNet stage's first layers), not a model made of blocks
        count = 0
    site_depth, site_frame = -1, -1
    signature: np.ndarray = np.zeros(0, dtype=np.int64)
    if count >= 2:
        canonical = sid[forward_sets[best_pass]]
        blocks = canonical[start : start + count * period]
        common = _block_call_site(blocks, info)
        if common:
            site_depth, site_frame = len(common) - 1, common[-1]
            region = _region(canonical, info, site_depth, site_frame)
            if region.size >= period:
                signature = canonical[region[0] : region[0] + period]
        if signature.size == 0:
            signature = blocks[:period]
    return _BlockRepeat(count, period, start, best_pass, site_depth, site_frame, signature)


def _block_call_site(block_stack_ids: np.ndarray, info: StackInfo) -> tuple[int, ...]:
    """The call path down to the blocks' call site: the deepest common one that calls one and
    the same module (the MLP's Linear and GELU share the block's call line, but not their
    module)."""
    common = _common_prefix([info.call_path.get(int(sid), ()) for sid in block_stack_ids])
    callees = [info.callee.get(int(stack_id), ()) for stack_id in block_stack_ids]

    def called_modules(depth: int) -> set[str]:
        return {callee[depth - 1] if len(callee) >= depth else "" for callee in callees}

    while common and len(called_modules(len(common))) > 1:
        common = common[:-1]
    return common


def _common_prefix(paths: list[tuple[int, ...]]) -> tuple[int, ...]:
    if not paths:
        return ()
    first = paths[0]
    shortest = min(len(other) for other in paths)
    out = []
    for i in range(shortest):
        if all(path[i] == first[i] for path in paths):
            out.append(first[i])
        else:
            break
    return tuple(out)


def _in_site(stack_ids: np.ndarray, info: StackInfo, depth: int, frame: int) -> np.ndarray:
    """Per element of ``stack_ids``: made inside a module called from the blocks' call site."""

    def called_there(stack_id: int) -> bool:
        path = info.call_path.get(stack_id, ())
        return len(path) > depth and path[depth] == frame

    return _per_stack(stack_ids, called_there)


def _region(stack_ids: np.ndarray, info: StackInfo, depth: int, frame: int) -> np.ndarray:
    """Indices of forward allocations made inside a module called from the blocks' call site."""
    return np.flatnonzero(_in_site(stack_ids, info, depth, frame))


@dataclass(frozen=True)
class _Blocks:
    """Every block instance of every pass, in pass order: ``rows`` are the forward allocations
    the blocks made (in order), ``block_of`` which block each is; per block its pass and its
    first and last row; per pass how many blocks it has and the index of its first."""

    rows: np.ndarray
    block_of: np.ndarray
    pass_of: np.ndarray
    first: np.ndarray
    last: np.ndarray
    counts: np.ndarray
    first_block: np.ndarray

    @property
    def is_first(self) -> np.ndarray:
        """Per block: the first of its pass."""
        return np.arange(self.pass_of.size) == self.first_block[self.pass_of]


def _all_blocks(sid: np.ndarray, forwards: _Forwards, repeat: _BlockRepeat, info: StackInfo) -> _Blocks:
    """The block instances of every pass: the pass's region (its forward allocations made
    inside a module called from the blocks' call site) cut where the block's first stack
    follows its last (and where the region starts)."""
    lengths = forwards.high - forwards.low
    index, owner = index_ranges(forwards.low, forwards.high)
    rows = forwards.rows[index]
    if not repeat.signature.size:
        region = np.zeros(rows.size, dtype=bool)
    elif repeat.site_depth >= 0:
        region = _in_site(sid[rows], info, repeat.site_depth, repeat.site_frame)
    else:
        local = np.arange(rows.size) - (np.cumsum(lengths) - lengths)[owner]
        region = (owner == repeat.best_pass) & (local >= repeat.start)
        region &= local < repeat.start + repeat.count * repeat.period
    rows, owner = rows[region], owner[region]
    stack_ids = sid[rows]
    first_stack, last_stack = (int(repeat.signature[0]), int(repeat.signature[-1])) if rows.size else (0, 0)
    starts = np.r_[True, owner[1:] != owner[:-1]] if rows.size else np.zeros(0, dtype=bool)
    starts[1:] |= (stack_ids[1:] == first_stack) & (stack_ids[:-1] == last_stack)
    first_index = np.flatnonzero(starts)
    last_index = np.r_[first_index[1:], rows.size][: first_index.size] - 1
    pass_of = owner[first_index]
    counts = np.bincount(pass_of, minlength=lengths.size)
    return _Blocks(
        rows=rows,
        block_of=np.cumsum(starts) - 1,
        pass_of=pass_of,
        first=rows[first_index],
        last=rows[last_index],
        counts=counts,
        first_block=np.cumsum(counts) - counts,
    )


def index_ranges(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The integers ``low[k] <= i < high[k]`` of every range ``k``, concatenated, and the range
    each comes from."""
    lengths = np.maximum(high - low, 0)
    owner = np.repeat(np.arange(lengths.size), lengths)
    offsets = np.cumsum(lengths) - lengths
    return np.arange(owner.size) - offsets[owner] + low[owner], owner


def _segment_max(values: np.ndarray, owner: np.ndarray, count: int) -> np.ndarray:
    """Per segment the largest of its ``values`` (-1: none)."""
    out = np.full(count, -1, dtype=np.int64)
    np.maximum.at(out, owner, values)
    return out


def _segment_median(values: np.ndarray, owner: np.ndarray, count: int) -> np.ndarray:
    """Per segment the median of its ``values`` as ``np.median`` computes it (nan: none)."""
    order = np.lexsort((values, owner))
    ordered = values[order].astype(np.float64)
    sizes = np.bincount(owner, minlength=count)
    offsets = np.cumsum(sizes) - sizes
    some = sizes > 0
    low = offsets[some] + (sizes[some] - 1) // 2
    high = offsets[some] + sizes[some] // 2
    out = np.full(count, np.nan)
    out[some] = (ordered[low] + ordered[high]) / 2
    return out


@dataclass(frozen=True)
class _Bounds:
    """Every pass's bounds, as arrays over the passes."""

    forward_start: np.ndarray
    backward_start: np.ndarray
    backward_end: np.ndarray
    next_start: np.ndarray  # the next pass's forward (or the trace's end)
    output_row: np.ndarray  # the model's output: its forward's last allocation (-1: none)

    def in_backward(self, free_pos: np.ndarray, passes: np.ndarray) -> np.ndarray:
        """Per free position: within the backward of the pass given for it."""
        return (free_pos >= self.backward_start[passes]) & (free_pos < self.backward_end[passes])


@dataclass(frozen=True)
class _PassSpans:
    """Where every pass's backward parts end: its post part's and its loss's (per pass), each
    block's (per block)."""

    bounds: _Bounds
    post_end: np.ndarray
    loss_end: np.ndarray
    block_end: np.ndarray


def _bounds(allocs: pd.DataFrame, raw: list[tuple[int, int, int]], n_positions: int, forwards: _Forwards) -> _Bounds:
    pos = allocs["pos"].to_numpy()
    main = allocs["main"].to_numpy()
    code = allocs["code"].to_numpy()
    spans = np.array(raw, dtype=np.int64).reshape(-1, 3)
    forward_start, backward_start, last_grad = spans[:, 0], spans[:, 1], spans[:, 2]
    next_start = np.r_[forward_start[1:], n_positions].astype(np.int64)
    # the backward ends where the optimizer step or the next pass begins
    later = np.flatnonzero(main & ((code == CODES["optimizer_state"]) | allocs["module"].to_numpy()))
    following = np.searchsorted(pos[later], last_grad, "right")
    following_pos = next_start.copy()
    found = following < later.size
    following_pos[found] = pos[later[following[found]]]
    backward_end = np.where(found & (following_pos < next_start), following_pos, next_start)
    has_forward = forwards.high > forwards.low
    output_row = np.full(len(raw), -1, dtype=np.int64)
    output_row[has_forward] = forwards.rows[forwards.high[has_forward] - 1]
    return _Bounds(forward_start, backward_start, backward_end, next_start, output_row)


def _pass_spans(allocs: pd.DataFrame, bounds: _Bounds, blocks: _Blocks) -> _PassSpans:
    """Where, within every pass's backward, the backward of its post part, of each block and of
    the loss end."""
    pos = allocs["pos"].to_numpy()
    main = allocs["main"].to_numpy()
    free_pos = allocs["free_pos"].to_numpy()
    inputs = _block_inputs(pos, main, bounds, blocks)
    medians, before_median = _saved_frees(free_pos, bounds, blocks, inputs)
    post_end = _post_frees(pos, free_pos, bounds, blocks, inputs, medians)
    post_end = np.maximum(post_end, bounds.backward_start - 1)
    # the loss: what the program computed after the model's output, outside any module
    out_pos = bounds.forward_start.copy()
    has_output = bounds.output_row >= 0
    out_pos[has_output] = pos[bounds.output_row[has_output]]
    rows, owner = index_ranges(
        np.searchsorted(pos, out_pos, "right"), np.searchsorted(pos, bounds.backward_start, "left")
    )
    keep = main[rows] & ~allocs["module"].to_numpy()[rows] & bounds.in_backward(free_pos[rows], owner)
    keep &= free_pos[rows] < post_end[owner] + 1.0
    loss_end = _segment_max(free_pos[rows[keep]], owner[keep], bounds.forward_start.size)
    loss_end = np.minimum(np.maximum(loss_end, bounds.backward_start - 1), post_end)
    # backward order: post, blocks n-1 .. 0, pre; each span ends no earlier than the one before
    floor = np.maximum(before_median, post_end[blocks.pass_of])
    block_end = pd.Series(floor[::-1]).groupby(blocks.pass_of[::-1], sort=False).cummax()
    return _PassSpans(bounds, post_end, loss_end, block_end.to_numpy(dtype=np.int64)[::-1])


@dataclass(frozen=True)
class _Inputs:
    """Per block the row it consumes: the previous block's last, or for a pass's first block the
    last allocation on the program's thread before it (``valid``: there is one); per pass what
    its post part consumes (the last block's output, or with no blocks that same allocation)."""

    block_row: np.ndarray
    block_valid: np.ndarray
    post_row: np.ndarray
    post_valid: np.ndarray


def _block_inputs(pos: np.ndarray, main: np.ndarray, bounds: _Bounds, blocks: _Blocks) -> _Inputs:
    has_blocks = blocks.counts > 0
    first_fwd = bounds.backward_start.copy()
    first_fwd[has_blocks] = pos[blocks.first[blocks.first_block[has_blocks]]]
    main_rows = np.flatnonzero(main)
    before = np.searchsorted(pos[main_rows], first_fwd, "left") - 1
    pre_valid = before >= 0
    pre_last = np.full(before.size, -1, dtype=np.int64)
    pre_last[pre_valid] = main_rows[before[pre_valid]]
    pre_valid[pre_valid] = pos[pre_last[pre_valid]] >= bounds.forward_start[pre_valid]
    is_first = blocks.is_first
    previous = np.r_[-1, blocks.last][:-1].astype(np.int64)
    post_row = pre_last.copy()
    post_row[has_blocks] = blocks.last[blocks.first_block[has_blocks] + blocks.counts[has_blocks] - 1]
    return _Inputs(
        block_row=np.where(is_first, pre_last[blocks.pass_of], previous),
        block_valid=np.where(is_first, pre_valid[blocks.pass_of], True),
        post_row=post_row,
        post_valid=has_blocks | pre_valid,
    )


def _saved_frees(
    free_pos: np.ndarray, bounds: _Bounds, blocks: _Blocks, inputs: _Inputs
) -> tuple[np.ndarray, np.ndarray]:
    """Per block the median of when, within the pass's backward, what it saved for backward is
    freed, and the last of those before the previous block's median (a tensor freed later than
    most of the previous block's, the loss or a tensor kept to the end, marks no end).

    What a block saved for backward is freed by its backward, except its output: that is the
    next block's input (or the loss's), freed when the backward of what consumed it is done."""
    n_blocks = blocks.pass_of.size
    not_last = np.r_[blocks.block_of[1:] == blocks.block_of[:-1], False][: blocks.rows.size]
    with_input = np.flatnonzero(inputs.block_valid)
    rows = np.r_[blocks.rows[not_last], inputs.block_row[with_input]].astype(np.int64)
    owner = np.r_[blocks.block_of[not_last], with_input].astype(np.int64)
    values = free_pos[rows]
    keep = bounds.in_backward(values, blocks.pass_of[owner])
    values, owner = values[keep], owner[keep]
    medians = _segment_median(values, owner, n_blocks)
    previous_median = np.r_[np.nan, medians[:-1]]
    limit = np.where(blocks.is_first, np.nan, previous_median)[owner]
    before = np.isnan(limit) | (values < limit)
    return medians, _segment_max(values[before], owner[before], n_blocks)


def _post_frees(
    pos: np.ndarray, free_pos: np.ndarray, bounds: _Bounds, blocks: _Blocks, inputs: _Inputs, medians: np.ndarray
) -> np.ndarray:
    """Per pass the last free, within its backward, of what its post part saved (made after the
    blocks' forward, and the last block's output) before the last block's median (-1: none)."""
    n_passes = bounds.forward_start.size
    has_blocks = blocks.counts > 0
    last_block = blocks.first_block[has_blocks] + blocks.counts[has_blocks] - 1
    last_fwd = bounds.forward_start - 1
    last_fwd[has_blocks] = pos[blocks.last[last_block]]
    rows, owner = index_ranges(
        np.searchsorted(pos, last_fwd, "right"), np.searchsorted(pos, bounds.backward_start, "left")
    )
    with_input = np.flatnonzero(inputs.post_valid)
    rows = np.r_[rows, inputs.post_row[with_input]].astype(np.int64)
    owner = np.r_[owner, with_input].astype(np.int64)
    values = free_pos[rows]
    keep = bounds.in_backward(values, owner)
    values, owner = values[keep], owner[keep]
    limit = np.full(n_passes, np.nan)
    limit[has_blocks] = medians[last_block]
    before = np.isnan(limit[owner]) | (values < limit[owner])
    return _segment_max(values[before], owner[before], n_passes)


def _passes(pos: np.ndarray, found: _PassSpans, blocks: _Blocks) -> list[Pass]:
    """The passes as :class:`Pass`: each block's backward starts after the one it follows (the
    post part's for the last block), the pre part's after the first block's."""
    bounds = found.bounds
    is_last = np.r_[blocks.pass_of[1:] != blocks.pass_of[:-1], True][: blocks.pass_of.size]
    follows = np.r_[found.block_end[1:], 0][: blocks.pass_of.size]
    block_start = (np.where(is_last, found.post_end[blocks.pass_of], follows) + 1).tolist()
    block_end = found.block_end.tolist()
    first_pos, last_pos = pos[blocks.first].tolist(), pos[blocks.last].tolist()
    forward_start, backward_start = bounds.forward_start.tolist(), bounds.backward_start.tolist()
    backward_end, next_start = bounds.backward_end.tolist(), bounds.next_start.tolist()
    post_end, loss_end, output_row = found.post_end.tolist(), found.loss_end.tolist(), bounds.output_row.tolist()
    out = []
    for index, (first, count) in enumerate(zip(blocks.first_block.tolist(), blocks.counts.tolist(), strict=True)):
        mine = range(first, first + count)
        out.append(
            Pass(
                index=index,
                # data starts after the previous pass's backward and step
                data_start=backward_end[index - 1] if index else 0,
                forward_start=forward_start[index],
                backward_start=backward_start[index],
                backward_end=backward_end[index],
                block_forward=tuple((first_pos[block], last_pos[block]) for block in mine),
                block_backward=tuple((block_start[block], block_end[block]) for block in mine),
                post_backward=(backward_start[index], post_end[index]),
                loss_backward_end=loss_end[index],
                pre_backward=((block_end[first] if count else post_end[index]) + 1, backward_end[index] - 1),
                output_row=output_row[index],
                end=next_start[index],
            )
        )
    return out


def _annotate(allocs: pd.DataFrame, found: _PassSpans, blocks: _Blocks) -> None:
    """Phase, part and block of every allocation of the passes. A pass's span runs from the end
    of the previous pass's backward to the next pass's forward: an allocation belongs to the last
    pass whose span holds it (the step between two passes is the later's data)."""
    pos = allocs["pos"].to_numpy()
    main = allocs["main"].to_numpy()
    optim = allocs["code"].to_numpy() == CODES["optimizer_state"]
    phase = allocs["phase"].cat.codes.to_numpy().copy()
    pass_id = allocs["pass_id"].to_numpy().copy()
    bounds = found.bounds
    owner = np.searchsorted(np.r_[0, bounds.backward_end[:-1]], pos, "right") - 1
    held = owner >= 0
    owner = np.maximum(owner, 0)
    held &= pos < bounds.next_start[owner]
    before = held & (pos < bounds.forward_start[owner])
    forward = held & ~before & (pos < bounds.backward_start[owner])
    backward = held & ~before & ~forward & (pos < bounds.backward_end[owner])
    after = held & ~before & ~forward & ~backward
    phase[before & ~optim] = PHASE_CODE["data"]
    phase[before & optim] = PHASE_CODE["step"]
    phase[forward] = PHASE_CODE["forward"]
    phase[backward] = PHASE_CODE["backward"]
    phase[after & (optim | ~main)] = PHASE_CODE["step"]
    phase[after & ~optim & main] = PHASE_CODE["data"]
    pass_id[held] = owner[held]
    part = allocs["part"].cat.codes.to_numpy().copy()
    block = allocs["block"].to_numpy().copy()
    plain = (forward | backward) & (blocks.counts[owner] == 0)
    part[plain] = PART_CODE["pre"]
    _forward_parts(pos, np.flatnonzero(forward & ~plain), owner, blocks, part, block)
    _backward_parts(pos, np.flatnonzero(backward & ~plain), owner, found, blocks, part, block)
    allocs["phase"] = pd.Categorical.from_codes(phase, dtype=_PHASE_DTYPE)
    allocs["part"] = pd.Categorical.from_codes(part, dtype=_PART_DTYPE)
    allocs["block"] = block
    allocs["pass_id"] = pass_id


def _forward_parts(
    pos: np.ndarray, rows: np.ndarray, owner: np.ndarray, blocks: _Blocks, part: np.ndarray, block: np.ndarray
) -> None:
    """Part and block of the forward allocations ``rows`` of passes with blocks: a block runs
    from its first allocation to the next block's first (the last block to its last)."""
    first_pos = pos[blocks.first]
    first_block = blocks.first_block[owner[rows]]
    last_block = first_block + blocks.counts[owner[rows]] - 1
    at = pos[rows]
    index = np.searchsorted(first_pos, at, "right") - 1
    is_pre = at < first_pos[first_block]
    is_post = at > pos[blocks.last[last_block]]
    inside = ~is_pre & ~is_post
    part[rows[is_pre]] = PART_CODE["pre"]
    part[rows[is_post]] = PART_CODE["post"]
    part[rows[inside]] = PART_CODE["block"]
    block[rows[inside]] = (index - first_block)[inside]


def _backward_parts(
    pos: np.ndarray,
    rows: np.ndarray,
    owner: np.ndarray,
    found: _PassSpans,
    blocks: _Blocks,
    part: np.ndarray,
    block: np.ndarray,
) -> None:
    """Part and block of the backward allocations ``rows`` of passes with blocks: the post part
    first, then the blocks from the last to the first, then the pre part."""
    passes = owner[rows]
    first_block, counts = blocks.first_block[passes], blocks.counts[passes]
    at = pos[rows]
    # the blocks' backward ends in backward order (ascending: each ends no earlier than the one
    # before), pass after pass
    backward_order = 2 * blocks.first_block[blocks.pass_of] + blocks.counts[blocks.pass_of] - 1
    ends = np.empty_like(found.block_end)
    ends[backward_order - np.arange(blocks.pass_of.size)] = found.block_end
    later = np.searchsorted(ends, at, "left")
    is_post = at <= found.post_end[passes]
    is_pre = at > found.block_end[first_block]
    inside = ~is_post & ~is_pre
    part[rows[is_post]] = PART_CODE["post"]
    part[rows[is_pre]] = PART_CODE["pre"]
    part[rows[inside]] = PART_CODE["block"]
    block[rows[inside]] = (counts - 1 - (later - first_block))[inside]


def _params(
    allocs: pd.DataFrame,
    passes: list[Pass],
    n_blocks: int,
    notes: list[str],
) -> pd.DataFrame:
    """Parameter tensors built before the first pass, in allocation order, with their block."""
    first_fwd = passes[0].forward_start if passes else int(allocs["pos"].to_numpy().max(initial=0)) + 1
    first_bwd_end = passes[0].backward_end if passes else first_fwd
    code = allocs["code"].to_numpy()
    pos = allocs["pos"].to_numpy()
    free_pos = allocs["free_pos"].to_numpy()
    sel = np.flatnonzero(
        (code == CODES["parameter"]) & (pos < first_fwd) & ((free_pos < 0) | (free_pos > first_bwd_end))
    )
    sizes = allocs["size"].to_numpy()[sel]
    sids = allocs["sid"].to_numpy()[sel]
    block = np.full(sel.size, -1, dtype=np.int64)
    part = np.full(sel.size, "pre", dtype=object)
    if n_blocks >= 2 and sel.size:
        found = None
        for keys in (sizes * 1_000_003 + sids, sizes):
            period, start, count = tandem_repeat(keys)
            if count >= n_blocks and period:
                # the run may repeat further by chance (identical neighbours): take n_blocks periods
                found = (period, start)
                break
        if found is None:
            notes.append(NOTE_PARAMETERS_NOT_REPEATED.format(n_blocks=n_blocks))
        else:
            period, start = found
            for j in range(n_blocks):
                block[start + j * period : start + (j + 1) * period] = j
            part[:start] = "pre"
            part[start : start + n_blocks * period] = "block"
            part[start + n_blocks * period :] = "post"
    largest = {}
    for block_index in np.unique(block):
        largest[int(block_index)] = int(sizes[block == block_index].max())
    matrix = np.array(
        [sizes[i] * 32 >= largest[int(block[i])] for i in range(sel.size)],
        dtype=bool,
    )
    params = pd.DataFrame(
        {
            "row": sel,
            "size": sizes,
            "block": block,
            "part": part,
            "matrix": matrix,
        }
    )
    allocs.loc[sel, "param"] = np.arange(sel.size, dtype=np.int32)
    allocs.loc[sel, "phase"] = "setup"
    return params


def _from_ddp(
    allocs: pd.DataFrame,
    params: pd.DataFrame,
    passes: list[Pass],
    notes: list[str],
) -> None:
    """A snapshot of one rank of a DDP run, made the single-GPU run it stands for: DDP's buckets
    are left out (a plan adds its own). With ``gradient_as_bucket_view`` the gradients were views
    into those buckets, and the tensors the backward made were freed once copied in: those
    (parameter-sized, made on autograd's thread and freed within the backward) are taken as the
    gradients, alive until the next forward (``zero_grad``), as without DDP."""
    code = allocs["code"].to_numpy().copy()
    buckets = code == CODES["ddp_bucket"]
    if not buckets.any():
        return
    allocs["dropped"] = buckets
    notes.append(NOTE_RECORDED_DDP)
    if (code == CODES["gradient"]).any() or params.empty:
        return
    pos = allocs["pos"].to_numpy()
    free_pos = allocs["free_pos"].to_numpy().copy()
    backward_start = np.array([one_pass.backward_start for one_pass in passes], dtype=np.int64)
    backward_end = np.array([one_pass.backward_end for one_pass in passes], dtype=np.int64)
    next_forward = np.array([one_pass.forward_start - 1 for one_pass in passes[1:]] + [-1], dtype=np.int64)
    rows, owner = index_ranges(np.searchsorted(pos, backward_start, "left"), np.searchsorted(pos, backward_end, "left"))
    free = free_pos[rows]
    keep = (allocs["phase"].to_numpy()[rows] == "backward") & allocs["grad_thread"].to_numpy()[rows]
    keep &= (free >= 0) & (free < backward_end[owner])
    keep &= np.isin(allocs["size"].to_numpy()[rows], params["size"].to_numpy())
    keep[keep] = _last_per_parameter(allocs["size"].to_numpy()[rows[keep]], owner[keep], params)
    code[rows[keep]] = CODES["gradient"]
    free_pos[rows[keep]] = next_forward[owner[keep]]
    found = int(keep.sum())
    allocs["code"] = code
    allocs["free_pos"] = free_pos
    notes.append(NOTE_BUCKET_VIEW.format(found=found))


def _last_per_parameter(size: np.ndarray, owner: np.ndarray, params: pd.DataFrame) -> np.ndarray:
    """Of a backward's parameter-sized tensors (``size``, in order; ``owner``: their pass), the last
    of each size in each pass, as many as there are parameters of that size: an activation's
    gradient can have a parameter's size too (the 8-layer GPT's DDP ranks make 42 of the 24 MiB of
    its two embeddings in every backward), and only its parameters' gradients are kept."""
    allowed = params["size"].value_counts().reindex(size).fillna(0).to_numpy(dtype=np.int64)
    from_end = pd.DataFrame({"pass": owner, "size": size}).groupby(["pass", "size"]).cumcount(ascending=False)
    return from_end.to_numpy() < allowed  # from_end 0: the last of its pass and size


def _wrap_pos(allocs: pd.DataFrame, passes: list[Pass]) -> int:
    """Where a parallel wrapper would take the model over: right after the last parameter
    allocation before the first forward."""
    if not passes:
        return 0
    code = allocs["code"].to_numpy()
    pos = allocs["pos"].to_numpy()
    before = pos[(code == CODES["parameter"]) & (pos < passes[0].forward_start)]
    return int(before.max()) + 1 if before.size else passes[0].forward_start


def _map_mirrors(allocs: pd.DataFrame, params: pd.DataFrame) -> None:
    """The parameter each gradient and each optimizer-state allocation mirrors: the next
    parameter of the same size in parameter order (cyclically: the optimizer walks the
    parameter list once per state tensor or per foreach operation), gradients in reverse order
    within their block (backward runs the layers backwards)."""
    if params.empty:
        return
    p_size = params["size"].to_numpy()
    code = allocs["code"].to_numpy()
    size = allocs["size"].to_numpy()
    out = allocs["param"].to_numpy().copy()
    by_size: dict[int, list[int]] = {}
    for i, size_bytes in enumerate(p_size.tolist()):
        by_size.setdefault(int(size_bytes), []).append(i)
    _mirror_gradients(allocs, params, by_size, out)
    # optimizer state: in parameter order, cyclically (each pick depends on the one before)
    ptr = 0
    rows = np.flatnonzero(code == CODES["optimizer_state"])
    for row, size_bytes in zip(rows.tolist(), size[rows].tolist(), strict=True):
        cands = by_size.get(size_bytes)
        if cands is None:
            continue
        later = bisect.bisect_left(cands, ptr)
        pick = cands[later] if later < len(cands) else cands[0]
        out[row] = pick
        ptr = pick
    allocs["param"] = out


def _mirror_gradients(
    allocs: pd.DataFrame, params: pd.DataFrame, by_size: dict[int, list[int]], out: np.ndarray
) -> None:
    """Per gradient, within the pass, the last parameter of its size and block not taken yet,
    else the last of its size not taken yet, else the last of its size. Where every block's
    gradients of a size are no more than its parameters of that size (the rule), the k-th
    gradient of a block takes the block's k-th last parameter; the passes and sizes where
    some are more are walked one gradient after the other."""
    p_size = params["size"].to_numpy()
    p_block = params["block"].to_numpy()
    size = allocs["size"].to_numpy()
    block = allocs["block"].to_numpy()
    pass_id = allocs["pass_id"].to_numpy()
    rows = np.flatnonzero(allocs["code"].to_numpy() == CODES["gradient"])
    rows = rows[np.isin(size[rows], p_size)]
    # one key per (size, block): parameters sorted by it (stably: in parameter order within)
    stride = int(max(p_block.max(initial=-1), block[rows].max(initial=-1))) + 2
    p_key = p_size.astype(np.int64) * stride + (p_block + 1)
    order = np.argsort(p_key, kind="stable")
    row_key = size[rows].astype(np.int64) * stride + (block[rows] + 1)
    low = np.searchsorted(p_key[order], row_key, "left")
    high = np.searchsorted(p_key[order], row_key, "right")
    keys = pd.DataFrame({"pass": pass_id[rows], "size": size[rows], "block": block[rows]})
    same_block = keys.groupby(["pass", "size", "block"], sort=False)
    rank = same_block.cumcount().to_numpy()
    enough = same_block["pass"].transform("size").to_numpy() <= high - low
    regular = keys.assign(enough=enough).groupby(["pass", "size"], sort=False)["enough"].transform("all")
    regular = regular.to_numpy(dtype=bool)
    out[rows[regular]] = order[(high - 1 - rank)[regular]]
    taken: dict[int, set[int]] = {}
    for row in rows[~regular].tolist():
        cands = by_size[int(size[row])]
        used = taken.setdefault(int(pass_id[row]), set())
        rest = [candidate for candidate in cands if candidate not in used]
        same = [candidate for candidate in rest if p_block[candidate] == block[row]]
        pick = same[-1] if same else (rest[-1] if rest else cands[-1])
        used.add(pick)
        out[row] = pick
