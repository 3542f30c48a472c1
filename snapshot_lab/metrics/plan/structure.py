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

import itertools
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo
from ..categories import CODES, categorize, stack_threads
from ..categories.gradients import THREAD_CODES, thread_codes
from ..history.lifetimes import device_lifetimes
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

_MODULE_PY = "torch/nn/modules/module.py"
_CALL_IMPL = frozenset({"_call_impl", "_wrapped_call_impl"})
# every allocation's phase: setup (before the first forward), data, forward, backward or step;
# its part of the model: pre (before the blocks), block or post (after them; the loss too)


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
            position >= 0 and fname[position].endswith(_MODULE_PY) and name[position] in _CALL_IMPL for position in pos
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


def _find_passes(scan: _Scan) -> list[tuple[int, int, int]]:
    """(forward_start, backward_start, backward_end) positions of every pass whose backward
    was recorded."""
    out: list[tuple[int, int, int]] = []
    fwd = -1
    bwd = -1
    last_grad = -1
    for i in range(scan.pos.size):
        position = int(scan.pos[i])
        if scan.main[i] and scan.module[i]:
            if bwd >= 0:
                # a new forward after a backward: the pass before is complete
                out.append((fwd, bwd, last_grad))
                fwd, bwd = position, -1
            elif fwd < 0:
                fwd = position
        elif scan.grad_thread[i] and fwd >= 0:
            if bwd < 0:
                bwd = position
            last_grad = position
        elif scan.optim[i] and bwd >= 0:
            out.append((fwd, bwd, last_grad))
            fwd, bwd = -1, -1
    if fwd >= 0 and bwd >= 0:
        out.append((fwd, bwd, last_grad))
    return out


# --------------------------------------------------------------------------- the structure


def training_structure(frames: SnapshotFrames, device: int) -> TrainingStructure:
    """The structure of the run on ``device`` (computed once per snapshot and device)."""
    return memo(frames, ("plan.structure", device), lambda: _structure(frames, device))


def _structure(frames: SnapshotFrames, device: int) -> TrainingStructure:
    events = frames.events[frames.events["device"] == device]
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
    positions = np.searchsorted(base_index, lifetimes["event_index"].to_numpy())
    stack_ids = lifetimes["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    thread = _threads(frames, stack_ids)
    module = np.array([info.in_module(int(stack_id)) for stack_id in stack_ids], dtype=bool)
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
    return [(int(chunk[0]), int(chunk[-1])) for chunk in np.split(step_positions, cuts)]


def _allocation_table(
    lifetimes: pd.DataFrame,
    scan: _Scan,
    codes: np.ndarray,
    base_index: np.ndarray,
    stream_of: np.ndarray,
) -> pd.DataFrame:
    """One row per allocation of the trace, before the passes and blocks are marked."""
    free_index = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)
    free_pos = np.where(free_index >= 0, np.searchsorted(base_index, np.maximum(free_index, 0)), -1)
    count = len(lifetimes)
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
            "pass_id": -1,
            "phase": "setup",
            "part": "",
            "block": -1,
            "param": -1,
            # the recorded run's own parallel machinery (DDP's buckets): left out of plans
            "dropped": False,
        }
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
    """(position, requested bytes, stream) of the recorded OOMs."""
    oom_positions = np.flatnonzero(events["action"].astype(str).to_numpy() == "oom")
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
    forward_sets = _forward_sets(allocs, raw)
    repeat = _block_repeat(sid, forward_sets, info)
    passes: list[Pass] = []
    counts = []
    pass_spans = zip(raw, forward_sets, strict=True)
    for pass_index, ((forward, backward, last_grad), forward_rows) in enumerate(pass_spans):
        next_start = raw[pass_index + 1][0] if pass_index + 1 < len(raw) else n_positions
        blocks = _pass_blocks(sid, forward_rows, pass_index, repeat, info)
        counts.append(len(blocks))
        one_pass = _make_pass(pass_index, allocs, forward, backward, last_grad, next_start, blocks)
        passes.append(one_pass)
    n_blocks = max(set(counts), key=counts.count) if counts else 0
    if len(set(counts)) > 1:
        notes.append(NOTE_UNEVEN_BLOCKS.format(counts=sorted(set(counts)), n_blocks=n_blocks))
    site_frame = repeat.site_frame
    label = info.frame_label.get(site_frame, "") if site_frame >= 0 else ""
    # data starts: after the previous pass's backward and step
    fixed = [
        replace(
            training_pass,
            data_start=passes[index - 1].backward_end if index else 0,
            end=passes[index + 1].forward_start if index + 1 < len(passes) else n_positions,
        )
        for index, training_pass in enumerate(passes)
    ]
    _annotate(allocs, fixed)
    return fixed, n_blocks, int(repeat.period if n_blocks else 0), label


def _forward_sets(allocs: pd.DataFrame, raw: list[tuple[int, int, int]]) -> list[np.ndarray]:
    """Per pass, the rows of its forward allocations on the program's thread inside modules."""
    pos = allocs["pos"].to_numpy()
    in_module = allocs["main"].to_numpy() & allocs["module"].to_numpy()
    return [np.flatnonzero((pos >= forward) & (pos < backward) & in_module) for forward, backward, _ in raw]


def _block_repeat(sid: np.ndarray, forward_sets: list[np.ndarray], info: StackInfo) -> _BlockRepeat:
    """The canonical block: the pass whose forward repeats most (the latest of equals: the first
    pass makes one-off allocations, such as cuBLAS's workspace, inside its first block), and
    where the blocks are called from."""
    best = (0, 0, 0, -1)
    for index, forward_rows in enumerate(forward_sets):
        period, start, count = tandem_repeat(sid[forward_rows])
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


def _pass_blocks(
    sid: np.ndarray,
    forward_rows: np.ndarray,
    pass_index: int,
    repeat: _BlockRepeat,
    info: StackInfo,
) -> list[np.ndarray]:
    """The rows of each block's forward allocations in pass ``k``."""
    if not repeat.signature.size:
        return []
    stack_ids = sid[forward_rows]
    if repeat.site_depth >= 0:
        region = _region(stack_ids, info, repeat.site_depth, repeat.site_frame)
    elif pass_index == repeat.best_pass:
        region = np.arange(repeat.start, repeat.start + repeat.count * repeat.period)
    else:
        region = np.zeros(0, dtype=np.int64)
    return [forward_rows[block] for block in _split_blocks(stack_ids, region, repeat.signature)]


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


def _region(stack_ids: np.ndarray, info: StackInfo, depth: int, frame: int) -> np.ndarray:
    """Indices of forward allocations made inside a module called from the blocks' call site."""
    hit = [
        len(info.call_path.get(int(stack_id), ())) > depth and info.call_path[int(stack_id)][depth] == frame
        for stack_id in stack_ids
    ]
    return np.flatnonzero(np.array(hit, dtype=bool))


def _split_blocks(
    stack_ids: np.ndarray,
    region: np.ndarray,
    signature: np.ndarray,
) -> list[np.ndarray]:
    """Cut the region into block instances: one starts where the block's first stack follows
    its last (or where the region starts)."""
    if region.size == 0:
        return []
    first, last = int(signature[0]), int(signature[-1])
    starts = [int(region[0])]
    for start, stop in itertools.pairwise(region):
        if int(stack_ids[stop]) == first and int(stack_ids[start]) == last:
            starts.append(int(stop))
    out = []
    bounds = [*starts, int(region[-1]) + 1]
    in_region = np.zeros(stack_ids.size, dtype=bool)
    in_region[region] = True
    for start, stop in itertools.pairwise(bounds):
        idx = np.arange(start, stop)
        out.append(idx[in_region[start:stop]])
    return out


def _make_pass(
    index: int,
    allocs: pd.DataFrame,
    forward_start: int,
    backward_start: int,
    last_grad: int,
    next_start: int,
    blocks: list[np.ndarray],
) -> Pass:
    pos = allocs["pos"].to_numpy()
    free_pos = allocs["free_pos"].to_numpy()
    main = allocs["main"].to_numpy()
    module = allocs["module"].to_numpy()
    code = allocs["code"].to_numpy()
    # the backward ends where the optimizer step or the next pass begins
    later = np.flatnonzero(
        (pos > last_grad) & (pos < next_start) & main & ((code == CODES["optimizer_state"]) | module)
    )
    bwd_end = int(pos[later[0]]) if later.size else next_start
    # the data of the next pass begins after the step: keep the backward span to the step
    block_fwd = tuple((int(pos[block_rows[0]]), int(pos[block_rows[-1]])) for block_rows in blocks if block_rows.size)
    fwd_rows = np.flatnonzero((pos >= forward_start) & (pos < backward_start) & main & module)
    output_row = int(fwd_rows[-1]) if fwd_rows.size else -1
    in_bwd = (free_pos >= backward_start) & (free_pos < bwd_end)
    # what a block saved for backward is freed by its backward, except its output: that is the
    # next block's input (or the loss's), freed when the backward of what consumed it is done
    last_fwd = block_fwd[-1][1] if block_fwd else forward_start - 1
    first_fwd = block_fwd[0][0] if block_fwd else backward_start
    pre_rows = np.flatnonzero((pos >= forward_start) & (pos < first_fwd) & main)
    # inputs[j]: what block j consumes
    inputs = [pre_rows[-1:]] + [block_rows[-1:] for block_rows in blocks]
    saved = []
    for j, rows in enumerate(blocks):
        mine = np.r_[rows[:-1], inputs[j]].astype(np.int64)
        saved.append(np.sort(free_pos[mine][in_bwd[mine]]))
    after_blocks = np.flatnonzero((pos > last_fwd) & (pos < backward_start) & in_bwd)
    post_rows = np.r_[after_blocks, inputs[-1]].astype(np.int64)
    post_frees = np.sort(free_pos[post_rows][in_bwd[post_rows]])
    frees = saved
    # a tensor freed later than most of the previous block's (the loss, a tensor kept to the
    # end) marks no end
    meds = [float(np.median(block_frees)) if block_frees.size else np.nan for block_frees in frees]

    def last_before(frees: np.ndarray, limit: float) -> int:
        earlier = frees[frees < limit] if not np.isnan(limit) else frees
        return int(earlier[-1]) if earlier.size else -1

    post_end = last_before(post_frees, meds[-1] if meds else np.nan)
    post_end = max(post_end, backward_start - 1)
    # the loss: what the program computed after the model's output, outside any module
    out_pos = pos[fwd_rows[-1]] if fwd_rows.size else forward_start
    loss_rows = np.flatnonzero((pos > out_pos) & (pos < backward_start) & main & ~module & in_bwd)
    loss_end = last_before(np.sort(free_pos[loss_rows]), post_end + 1.0)
    loss_end = min(max(loss_end, backward_start - 1), post_end)
    # backward order: post, blocks n-1 .. 0, pre; each span ends no earlier than the one before
    bwd_spans: list[tuple[int, int]] = [(0, 0)] * len(blocks)
    start = post_end + 1
    for j in range(len(blocks) - 1, -1, -1):
        end = max(last_before(frees[j], meds[j - 1] if j >= 1 else np.nan), start - 1)
        bwd_spans[j] = (start, end)
        start = end + 1
    pre = (start, bwd_end - 1)
    return Pass(
        index=index,
        data_start=0,
        forward_start=forward_start,
        backward_start=backward_start,
        backward_end=bwd_end,
        block_forward=block_fwd,
        block_backward=tuple(bwd_spans),
        post_backward=(backward_start, post_end),
        loss_backward_end=loss_end,
        pre_backward=pre,
        output_row=output_row,
        end=next_start,
    )


class _ByPosition:
    """The allocations sorted by position once: the rows whose position lies in a range are a
    slice of that order, found by binary search (one scan of every allocation per range made
    :func:`_annotate` quadratic in the trace's length)."""

    def __init__(self, pos: np.ndarray) -> None:
        self.order = np.argsort(pos, kind="stable")
        self.pos = pos[self.order]

    def between(self, low: float, high: float, within: slice | None = None, high_inclusive: bool = False) -> slice:
        """``low <= pos < high`` (``<= high`` when ``high_inclusive``), inside ``within``."""
        start = int(np.searchsorted(self.pos, low, "left"))
        stop = int(np.searchsorted(self.pos, high, "right" if high_inclusive else "left"))
        if within is not None:
            start, stop = max(start, within.start), min(stop, within.stop)
        return slice(start, max(start, stop))

    def above(self, low: float, within: slice) -> slice:
        """``pos > low``, inside ``within``."""
        return slice(max(int(np.searchsorted(self.pos, low, "right")), within.start), within.stop)

    def rows(self, part: slice) -> np.ndarray:
        return self.order[part]


def _annotate(allocs: pd.DataFrame, passes: list[Pass]) -> None:
    """Phase, part and block of every allocation of the passes."""
    main = allocs["main"].to_numpy()
    code = allocs["code"].to_numpy()
    phase = allocs["phase"].to_numpy(dtype=object).copy()
    part = allocs["part"].to_numpy(dtype=object).copy()
    block = allocs["block"].to_numpy().copy()
    pass_id = allocs["pass_id"].to_numpy().copy()
    optim = code == CODES["optimizer_state"]
    by_position = _ByPosition(allocs["pos"].to_numpy())
    for one_pass in passes:
        span = by_position.between(one_pass.data_start, one_pass.end)
        data = by_position.rows(by_position.between(-np.inf, one_pass.forward_start, span))
        phase[data[~optim[data]]] = "data"
        phase[data[optim[data]]] = "step"
        fwd = by_position.between(one_pass.forward_start, one_pass.backward_start)
        phase[by_position.rows(fwd)] = "forward"
        bwd = by_position.between(one_pass.backward_start, one_pass.backward_end)
        phase[by_position.rows(bwd)] = "backward"
        after = by_position.rows(by_position.between(one_pass.backward_end, one_pass.end))
        phase[after[optim[after] | ~main[after]]] = "step"
        phase[after[~optim[after] & main[after]]] = "data"
        pass_id[by_position.rows(span)] = one_pass.index
        if one_pass.block_forward:
            _annotate_blocks(one_pass, by_position, fwd, bwd, part, block)
        else:
            part[by_position.rows(fwd)] = "pre"
            part[by_position.rows(bwd)] = "pre"
    allocs["phase"] = phase
    allocs["part"] = part
    allocs["block"] = block
    allocs["pass_id"] = pass_id


def _annotate_blocks(
    one_pass: Pass, by_position: _ByPosition, fwd: slice, bwd: slice, part: np.ndarray, block: np.ndarray
) -> None:
    """Part and block of the allocations of a pass with repeated blocks (``fwd`` and ``bwd``:
    its forward's and its backward's allocations, as slices of ``by_position``)."""
    first, last = one_pass.block_forward[0][0], one_pass.block_forward[-1][1]
    part[by_position.rows(by_position.between(-np.inf, first, fwd))] = "pre"
    part[by_position.rows(by_position.above(last, fwd))] = "post"
    for j, (start_pos, last_pos) in enumerate(one_pass.block_forward):
        end = one_pass.block_forward[j + 1][0] - 1 if j + 1 < len(one_pass.block_forward) else last_pos
        sel = by_position.rows(by_position.between(start_pos, end, fwd, high_inclusive=True))
        part[sel] = "block"
        block[sel] = j
    post_end = one_pass.post_backward[1]
    part[by_position.rows(by_position.between(-np.inf, post_end, bwd, high_inclusive=True))] = "post"
    for j, (start_pos, last_pos) in enumerate(one_pass.block_backward):
        sel = by_position.rows(by_position.between(start_pos, last_pos, bwd, high_inclusive=True))
        part[sel] = "block"
        block[sel] = j
    part[by_position.rows(by_position.between(one_pass.pre_backward[0], np.inf, bwd))] = "pre"


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
    allocs.loc[sel, "param"] = np.arange(sel.size)
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
    sizes = set(params["size"].tolist())
    pos = allocs["pos"].to_numpy()
    free_pos = allocs["free_pos"].to_numpy().copy()
    phase = allocs["phase"].to_numpy()
    grad_thread = allocs["grad_thread"].to_numpy()
    size = allocs["size"].to_numpy()
    found = 0
    for index, one_pass in enumerate(passes):
        next_forward = passes[index + 1].forward_start - 1 if index + 1 < len(passes) else -1
        sel = np.flatnonzero(
            (phase == "backward")
            & grad_thread
            & (pos >= one_pass.backward_start)
            & (pos < one_pass.backward_end)
            & (free_pos >= 0)
            & (free_pos < one_pass.backward_end)
            & np.isin(size, list(sizes))
        )
        code[sel] = CODES["gradient"]
        free_pos[sel] = next_forward
        found += sel.size
    allocs["code"] = code
    allocs["free_pos"] = free_pos
    notes.append(NOTE_BUCKET_VIEW.format(found=found))


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
    p_block = params["block"].to_numpy()
    code = allocs["code"].to_numpy()
    size = allocs["size"].to_numpy()
    block = allocs["block"].to_numpy()
    pass_id = allocs["pass_id"].to_numpy()
    out = allocs["param"].to_numpy().copy()
    by_size: dict[int, np.ndarray] = {}
    for i, size_bytes in enumerate(p_size.tolist()):
        by_size.setdefault(int(size_bytes), np.zeros(0, dtype=np.int64))
        by_size[int(size_bytes)] = np.r_[by_size[int(size_bytes)], i]
    # gradients: per pass, within the block the backward was in, last parameters first
    taken: dict[int, set[int]] = {}
    for row in np.flatnonzero(code == CODES["gradient"]).tolist():
        cands = by_size.get(int(size[row]))
        if cands is None:
            continue
        used = taken.setdefault(int(pass_id[row]), set())
        rest = [int(candidate) for candidate in cands if int(candidate) not in used]
        same = [candidate for candidate in rest if p_block[candidate] == block[row]]
        pick = same[-1] if same else (rest[-1] if rest else int(cands[-1]))
        used.add(pick)
        out[row] = pick
    # optimizer state: in parameter order, cyclically
    ptr = 0
    for row in np.flatnonzero(code == CODES["optimizer_state"]).tolist():
        cands = by_size.get(int(size[row]))
        if cands is None:
            continue
        later = cands[cands >= ptr]
        pick = int(later[0]) if later.size else int(cands[0])
        out[row] = pick
        ptr = pick
    allocs["param"] = out
