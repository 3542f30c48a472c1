"""Allocator what-if: replay a device's recorded trace through the allocator model under other
settings and predict reserved memory, cudaMalloc calls, retries and OOMs.

The trace supplies the program's requests (``alloc`` with the size asked for, ``free_completed``
when a block really returned to the cache) and its explicit ``torch.cuda.empty_cache()`` calls;
everything the allocator decided by itself (segments, retries, garbage collection) is
recomputed by the model. A ``replay_check`` first replays the trace under the settings the
snapshot recorded and compares the resulting segments with the snapshot's.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._jobs import Spread, in_turn
from ..history.moments import oom_moment
from ..history.ooms import recovered
from . import native
from .model import (
    UNLIMITED,
    AllocatorSettings,
    Block,
    CachingAllocatorModel,
    OutOfMemory,
    allocation_size,
    apply_conf,
    recorded_settings,
    round_size,
)
from .releases import find_releases
from .state import StartState, live_at_start, place_from_empty, seed, start_state

__all__ = ["apply_conf", "recorded_settings"]  # settings parsing lives in the model, re-exported

MiB = 1 << 20

_ALLOC, _FREE, _SEG_NEW, _SEG_GONE, _OOM, _OTHER, _TRY = range(7)  # _TRY: an OOM the run went on from

# where a scenario's replay started, for a trace that starts mid-run (a ring buffer that wrapped,
# recording started after the model was built): the recorded settings replay from the cache as
# recorded (rebuilt from the snapshot backwards: exact), every other setting from a steady state
START_REBUILT = "rebuilt"
START_STEADY = "steady"


@dataclass(frozen=True)
class ScenarioResult:
    settings: dict[str, Any]
    peak_reserved_bytes: int
    final_reserved_bytes: int
    final_allocated_bytes: int
    cuda_malloc_calls: int
    cuda_free_calls: int
    alloc_retries: int
    ooms: list[dict[str, int]]
    recorded_oom_avoided: bool | None  # None when the recording had no OOM
    # where the replay started, for a trace that starts mid-run (None: from empty, like the
    # replay check): START_REBUILT or START_STEADY
    start: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.start is None:
            del out["start"]  # a trace that starts with the job: every replay starts empty
        return out


@dataclass(frozen=True)
class ReplayCheck:
    exact: bool
    start: str  # the allocator state the replay started from
    reasons: list[str]
    recorded_reserved_bytes: int
    replayed_reserved_bytes: int
    recorded_segments: int
    replayed_segments: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WhatIf:
    device: int
    events: int
    memory_limit_bytes: int | None
    replay_check: ReplayCheck
    scenarios: list[ScenarioResult] = field(default_factory=list)  # the first: the recorded settings
    memory_limit_source: str = ""
    memory_limit_inferred: bool = False  # the limit is a stand-in (see MemoryLimit)
    # how the other settings were replayed, when the trace starts mid-run ("": from empty)
    scenario_start: str = ""
    # the recorded settings replayed from the same steady state as the other settings (a trace
    # that starts mid-run): what their rows compare with, like for like
    steady_baseline: ScenarioResult | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device": self.device,
            "events": self.events,
            "memory_limit_bytes": self.memory_limit_bytes,
            "memory_limit_source": self.memory_limit_source,
            "memory_limit_inferred": self.memory_limit_inferred,
            "replay_check": self.replay_check.to_dict(),
            "scenarios": [s.to_dict() for s in self.scenarios],
        }
        if self.scenario_start:
            out["scenario_start"] = self.scenario_start
        if self.steady_baseline is not None:
            out["steady_baseline"] = self.steady_baseline.to_dict()
        return out


@dataclass(frozen=True)
class _Program:
    """The trace reduced to what the program did, as numpy columns. ``releases``: for each run
    of segment frees or unmaps (by the position of its first event), who made it
    (:mod:`.releases`) and the position of the allocation its following new segment was made
    for (-1: none)."""

    kind: np.ndarray
    address: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    index: np.ndarray
    releases: dict[int, tuple[str, int]]


_KIND_OF_ACTION = {
    "alloc": _ALLOC,
    "free_completed": _FREE,
    "segment_alloc": _SEG_NEW,
    "segment_map": _SEG_NEW,
    "segment_free": _SEG_GONE,
    "segment_unmap": _SEG_GONE,
    "oom": _OOM,
}


def _kinds(action: pd.Series) -> np.ndarray:
    """The program's kind of every event, looked up once per category (the action column is
    categorical: its codes index a table, no string is compared per event)."""
    if not isinstance(action.dtype, pd.CategoricalDtype):
        action = action.astype("category")
    table = np.array(
        [_KIND_OF_ACTION.get(str(name), _OTHER) for name in action.cat.categories] + [_OTHER], dtype=np.int8
    )
    return table[action.cat.codes.to_numpy()]  # code -1 (missing): the table's last entry


def _program(frames: SnapshotFrames, device: int) -> _Program:
    ev = frames.device_events(device)
    kind = _kinds(ev["action"])
    kind[recovered(ev)] = _TRY  # a request the run was refused and went on from (history/ooms.py)
    releases: dict[int, tuple[str, int]] = {}
    n = len(kind)
    for r in find_releases(frames, device):
        target = -1
        if r.followed_by in ("segment_alloc", "segment_map"):
            j = r.end
            while j < n and kind[j] in (_SEG_NEW, _OTHER):
                j += 1
            target = j if j < n and kind[j] == _ALLOC else -1
        releases[r.start] = (r.cause, target)
    return _Program(
        kind=kind,
        address=ev["address"].fillna(-1).astype("int64").to_numpy(),
        size=ev["size_bytes"].to_numpy(),
        stream=ev["stream"].to_numpy(),
        index=ev["event_index"].to_numpy(),
        releases=releases,
    )


def _explicit_release(model: CachingAllocatorModel, prog: _Program, i: int) -> bool:
    """Whether the release at ``i`` was the program's own ``torch.cuda.empty_cache()`` (replayed
    as such under every setting) rather than the allocator making room inside an allocation
    (recomputed by the model). The free events' stacks tell when they were recorded
    (:mod:`.releases`); a release recorded without stacks (on the autograd thread with Python
    stacks) before the new segment of an allocation was the allocator's exactly when that
    allocation, under the recorded settings and limit, could not be served without giving memory
    back (garbage collection, or a cudaMalloc over the limit and its retry). Real runs that break
    the simpler rule "frees then a new segment are the allocator's only with garbage collection
    or max_split_size on": capped default-settings runs whose out-of-memory retry freed the cache
    (``whatif_default_capB``, ``gcwhatif_default_capH``); replayed as empty_cache() calls under
    garbage collection they drop the predicted reserved memory."""
    cause, target = prog.releases[i]
    if cause in ("empty_cache", "oom", "flush", "allocator"):
        return cause == "empty_cache"
    if target < 0 or model.limit is None:
        return True
    return not model.needs_release(int(prog.size[target]), int(prog.stream[target]))


def _run_events(
    prog: _Program, model: CachingAllocatorModel, live: dict[int, Block], explicit: set[int] | None, decided: set[int]
) -> tuple[bool | None, bool]:
    """Apply the program's events to ``model``; ``live`` (recorded address -> block) is updated
    in place, and the release runs taken as explicit empty_cache() calls are added to
    ``decided`` (decided on the way when ``explicit`` is None: only under the recorded settings).
    Returns whether the recorded OOM (if any) was avoided, and whether the replay ran out of
    memory (the program raises OutOfMemoryError there: the rest of the trace never happens)."""
    recorded_oom_avoided: bool | None = None
    # Python ints (the columns are int64), not numpy scalars, and the model's methods bound
    # once: this loop runs once per recorded event
    columns = (prog.address, prog.size, prog.stream, prog.index)
    address, size, stream, index = (column.astype(np.int64, copy=False).tolist() for column in columns)
    malloc, free, take_live = model.malloc, model.free, live.pop
    for i, k in enumerate(prog.kind.tolist()):
        if k == _ALLOC:
            try:
                live[address[i]] = malloc(size[i], stream[i], index[i])
            except OutOfMemory:
                return recorded_oom_avoided, True
        elif k == _FREE:
            b = take_live(address[i], None)
            if b is not None:
                free(b)
        elif k == _SEG_NEW:
            model.recorded_addresses.setdefault(size[i], []).append(address[i])
        elif k == _SEG_GONE:
            if i in prog.releases:
                is_explicit = _explicit_release(model, prog, i) if explicit is None else i in explicit
                if is_explicit:
                    decided.add(i)
                    model.empty_cache()
        elif k == _OOM:
            try:
                malloc(size[i], stream[i], index[i])
                recorded_oom_avoided = True if recorded_oom_avoided is None else recorded_oom_avoided
            except OutOfMemory:
                recorded_oom_avoided = False
        elif k == _TRY:  # served: a workspace used and freed; refused again: the program goes on
            try:
                free(malloc(size[i], stream[i], index[i]))
            except OutOfMemory:
                model.stats.ooms.pop()
    return recorded_oom_avoided, False


class _CompiledModel:
    """A replay the compiled engine ran, read like the Python model: its counters, its layout."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stats = native.stats_of(engine)

    def layout(self, _allocated: list[Block]) -> list[list[tuple[int, bool]]]:
        """The engine's mapped ranges (it holds its live blocks itself)."""
        return [list(chain) for chain in self.engine.layout()]


_Model = CachingAllocatorModel | _CompiledModel


def _engine_ops(prog: _Program, explicit: set[int] | None, limit: int | None) -> tuple[list[np.ndarray], set[int]]:
    """The program as the compiled engine's operation columns (kind, key, size, stream, event
    index), and the release runs that are explicit empty_cache() calls whatever the state
    (:func:`_explicit_release`); with ``explicit`` None the others are decided in the engine
    (``RELEASE_UNLESS_SERVED``: an empty_cache() unless the allocation after it needs a release)."""
    kind = np.full(len(prog.kind), native.NOP, dtype=np.int64)
    for mine, theirs in ((_ALLOC, native.ALLOC_KEEP), (_FREE, native.FREE), (_SEG_NEW, native.RECORD_ADDRESS)):
        kind[prog.kind == mine] = theirs
    kind[prog.kind == _OOM] = native.OOM_PROBE
    kind[prog.kind == _TRY] = native.TRY
    always: set[int] = set()
    served: list[tuple[int, int]] = []  # (release, the allocation it is decided by)
    for i, (cause, target) in prog.releases.items():
        if prog.kind[i] != _SEG_GONE:
            continue
        if explicit is not None:
            is_explicit = i in explicit
        elif cause in ("empty_cache", "oom", "flush", "allocator"):
            is_explicit = cause == "empty_cache"
        elif target < 0 or limit is None:
            is_explicit = True
        else:
            kind[i] = native.RELEASE_UNLESS_SERVED
            served.append((i, target))
            continue
        if is_explicit:
            kind[i] = native.EMPTY_CACHE
            always.add(i)
    # the program's own columns, which the engine reads as they are (int64, contiguous: no copy,
    # 40 MiB each at 5M entries); size and stream copied only where a release takes its allocation's
    size, stream = prog.size, prog.stream
    if served:
        at, target = np.array(served, dtype=np.int64).T
        size, stream = size.astype(np.int64, copy=True), stream.astype(np.int64, copy=True)
        size[at], stream[at] = size[target], stream[target]
    columns = [kind, prog.address, size, stream, prog.index]
    return [native.column(c) for c in columns], always


def _run_compiled(
    prog: _Program, engine: Any, explicit: set[int] | None, limit: int | None
) -> tuple[bool | None, bool, set[int]]:
    """:func:`_run_events` in the compiled engine: whether the recorded OOM was avoided, whether
    the replay ran out of memory, the release runs taken as explicit empty_cache() calls.
    Raises native.Unsupported when the engine cannot replay it."""
    ops, always = _engine_ops(prog, explicit, limit)
    stop, avoided, decided = engine.run(*ops, None, None)
    ran_out = stop >= 0
    if ran_out:
        always = {i for i in always if i < stop}
    return avoided, ran_out, always | set(decided)


def _replay(
    prog: _Program,
    settings: AllocatorSettings,
    limit: int | None,
    start: StartState | None = None,
    explicit: set[int] | None = None,
    limit_is_cap: bool = True,
) -> tuple[_Model, dict[int, Block], bool | None, set[int]]:
    """Replay the program; returns the model, its live blocks by recorded address, whether the
    recorded OOM (if any) was avoided, and the release runs taken as explicit empty_cache()
    calls (decided on the way when ``explicit`` is None: only under the recorded settings). The
    compiled engine runs it when it is built (:mod:`.native`)."""
    engine = native.engine(settings, limit, limit_is_cap)
    if engine is not None:
        try:
            if start is not None:
                native.seed(engine, start)
            avoided, _ran_out, decided = _run_compiled(prog, engine, explicit, limit)
            return _CompiledModel(engine), {}, avoided, decided
        except (native.Unsupported, OverflowError):
            native.fell_back()
    model = CachingAllocatorModel(settings, limit, limit_is_cap)
    live: dict[int, Block] = seed(model, start) if start is not None else {}
    decided = set()
    recorded_oom_avoided, _ran_out = _run_events(prog, model, live, explicit, decided)
    return model, live, recorded_oom_avoided, decided


def _steady_replay(
    prog: _Program,
    settings: AllocatorSettings,
    limit: int | None,
    start: StartState,
    explicit: set[int],
    limit_is_cap: bool = True,
) -> tuple[_Model, bool | None]:
    """A trace that starts mid-run, replayed under other settings from a steady state: the
    blocks alive at its start placed as ``settings`` lay them out from empty, the trace replayed
    once to fill the cache the way these settings fill it, the live blocks brought back to the
    trace's start (what the first pass allocated and still holds freed, the start's blocks it
    freed allocated again), and the trace replayed a second time; the model's counters (peak
    reserved, cudaMalloc calls, retries, OOMs) are the second pass's. The recorded cache at the
    trace's start was built under the recorded settings, and replaying from it shows another
    setting's effect on the segments made before the trace not at all (``twin_wrapped``:
    expandable segments 1.74 GiB from the recorded cache, 1.40 GiB really, 1.24 GiB from the
    steady state)."""
    blocks = live_at_start(start)
    engine = native.engine(settings, limit, limit_is_cap)
    if engine is not None:
        try:
            return _steady_compiled(prog, engine, blocks, explicit, limit)
        except (native.Unsupported, OverflowError):
            native.fell_back()
    model = CachingAllocatorModel(settings, limit, limit_is_cap)
    try:
        placed = place_from_empty(model, blocks)
    except OutOfMemory:
        return model, None  # the blocks alive at the trace's start do not fit under the limit
    live = dict(placed)
    avoided, ran_out = _run_events(prog, model, live, explicit, set())
    if ran_out:
        return model, avoided
    stats = model.stats
    stats.peak_reserved_bytes, stats.peak_allocated_bytes = stats.reserved_bytes, stats.allocated_bytes
    stats.cuda_malloc_calls = stats.cuda_free_calls = stats.alloc_retries = 0
    stats.ooms.clear()
    for address, block in list(live.items()):
        if placed.get(address) is not block:
            model.free(live.pop(address))
    try:
        for address, size, stream in blocks:
            if address not in live:
                live[address] = model.malloc(size, stream)
    except OutOfMemory:
        return model, None
    avoided, _ran_out = _run_events(prog, model, live, explicit, set())
    return model, avoided


def _steady_compiled(
    prog: _Program, engine: Any, blocks: list[tuple[int, int, int]], explicit: set[int], limit: int | None
) -> tuple[_Model, bool | None]:
    """:func:`_steady_replay` in the compiled engine, step for step."""
    columns = list(zip(*blocks, strict=True)) if blocks else [(), (), ()]
    address, size, stream = (native.column(c) for c in columns)
    no_index = native.column(np.full(len(blocks), -1))

    def place(kind: int) -> bool:
        """Allocate the start's blocks (``kind``: all, or those not live); False on OutOfMemory."""
        stop, _avoided, _decided = engine.run(
            native.column(np.full(len(blocks), kind)), address, size, stream, no_index, None, None
        )
        return bool(stop < 0)

    if not place(native.ALLOC_KEEP):
        return _CompiledModel(engine), None
    engine.mark_placed()
    avoided, ran_out, _decided = _run_compiled(prog, engine, explicit, limit)
    if ran_out:
        return _CompiledModel(engine), avoided
    engine.reset_stats()
    engine.free_unplaced()
    if not place(native.ALLOC_IF_ABSENT):
        return _CompiledModel(engine), None
    avoided, _ran_out, _decided = _run_compiled(prog, engine, explicit, limit)
    return _CompiledModel(engine), avoided


def _recorded_layout(frames: SnapshotFrames, device: int) -> list[list[tuple[int, bool]]]:
    seg = frames.segments[(frames.segments["device"] == device) & ~frames.segments["is_private_pool"]]
    blk = frames.blocks[frames.blocks["segment_id"].isin(seg["segment_id"])]
    out = []
    for _, g in blk.groupby("segment_id", sort=False):
        out.append([(int(s), st != "inactive") for s, st in zip(g["size_bytes"], g["state"].astype(str), strict=True)])
    return out


def _canon(layout: list[list[tuple[int, bool]]]) -> list[tuple[tuple[int, bool], ...]]:
    return sorted(tuple(seg) for seg in layout)


def _describe_start(start: StartState) -> str:
    if not start.segments:
        return "empty: the trace starts before the first allocation"
    live = sum(len(s.live) for s in start.segments)
    reserved = sum(s.size for s in start.segments)
    return (
        f"rebuilt from the snapshot backwards: {len(start.segments)} segments ({reserved:,} bytes) "
        f"with {live} live blocks before the trace's first event"
    )


def _describe_steady(start: StartState) -> str:
    live = sum(len(s.live) for s in start.segments)
    return (
        f"other settings from a steady state: the {live} blocks live at the trace's start placed as each setting "
        "lays them out from empty, the trace replayed twice, the second pass measured (segments made before the "
        "trace for requests it does not repeat are not seen: a max_split_size_mb row is then a lower bound)"
    )


def _scenario_result(
    settings: AllocatorSettings, m: _Model, avoided: bool | None, start: str | None = None
) -> ScenarioResult:
    return ScenarioResult(
        settings=settings.describe(),
        peak_reserved_bytes=m.stats.peak_reserved_bytes,
        final_reserved_bytes=m.stats.reserved_bytes,
        final_allocated_bytes=m.stats.allocated_bytes,
        cuda_malloc_calls=m.stats.cuda_malloc_calls,
        cuda_free_calls=m.stats.cuda_free_calls,
        alloc_retries=m.stats.alloc_retries,
        ooms=[{"event_index": i, "requested_bytes": r} for i, r in m.stats.ooms],
        recorded_oom_avoided=avoided,
        start=start,
    )


def analyse_whatif(
    frames: SnapshotFrames,
    device: int,
    scenarios: list[AllocatorSettings],
    memory_limit: int | None = None,
    limit_is_cap: bool = True,
    spread: Spread = in_turn,
) -> WhatIf:
    """Replay check under the recorded settings, then each scenario. A trace that starts with
    the job replays every scenario from empty. One that starts mid-run (a ring buffer that
    wrapped, recording started late) replays the recorded settings from the state just before
    its first event, rebuilt from the dump (exact), and every other setting from a steady state
    (:func:`_steady_replay`), labelled in each scenario's ``start``. ``limit_is_cap``: the limit is a per-process cap
    (``set_per_process_memory_fraction``), under which garbage collection runs; the device's
    own capacity is not. ``spread``: how the scenarios' replays are computed (:mod:`.._jobs`)."""
    base = recorded_settings(frames.info.allocator_settings)
    ev = frames.device_events(device)
    prog = _program(frames, device)
    start = start_state(frames, device, base)
    # replay check: the recorded settings and segment addresses under the same limit (a limit
    # the recorded run never met shows up here as a mismatch: it is not the one it ran under)
    model, live, base_avoided, explicit = _replay(prog, base, memory_limit, start, None, limit_is_cap)
    replayed = model.layout(list(live.values()))
    recorded = _recorded_layout(frames, device)
    reasons = []
    rec_reserved = sum(sum(s for s, _ in seg) for seg in recorded)
    rep_reserved = sum(sum(s for s, _ in seg) for seg in replayed)
    if frames.segments["is_private_pool"].any():
        reasons.append("private pools (CUDA graphs, MemPool) are not modelled (replayed in the default pool)")
    if rep_reserved != rec_reserved:
        reasons.append(f"reserved bytes differ: replayed {rep_reserved}, recorded {rec_reserved}")
    if len(replayed) != len(recorded):
        reasons.append(f"segment count differs: replayed {len(replayed)}, recorded {len(recorded)}")
    elif _canon(replayed) != _canon(recorded):
        reasons.append("block layout inside segments differs")
    exact = not reasons
    check = ReplayCheck(
        exact=exact,
        start=_describe_start(start),
        reasons=reasons,
        recorded_reserved_bytes=rec_reserved,
        replayed_reserved_bytes=rep_reserved,
        recorded_segments=len(recorded),
        replayed_segments=len(replayed),
    )
    results, baseline = _scenario_results(
        _Replays(prog, base, memory_limit, start, explicit, limit_is_cap), scenarios, (model, base_avoided), spread
    )
    if baseline is None:
        return WhatIf(device, len(ev), memory_limit, check, results)
    return WhatIf(
        device, len(ev), memory_limit, check, results, scenario_start=_describe_steady(start), steady_baseline=baseline
    )


@dataclass(frozen=True)
class _Replays:
    """What each scenario's replay starts from: the trace's program, the recorded settings, the
    limit, the state at the trace's start and the frees the check found explicit."""

    prog: _Program
    base: AllocatorSettings
    memory_limit: int | None
    start: StartState
    explicit: set[int]
    limit_is_cap: bool

    def result(self, s: AllocatorSettings) -> ScenarioResult:
        """One scenario's replay: from empty, or from a steady state where the trace starts mid-run."""
        if self.start.segments:
            m, avoided = _steady_replay(self.prog, s, self.memory_limit, self.start, self.explicit, self.limit_is_cap)
            return _scenario_result(s, m, avoided, START_STEADY)
        m, _live, avoided, _ = _replay(self.prog, s, self.memory_limit, self.start, self.explicit, self.limit_is_cap)
        return _scenario_result(s, m, avoided)


def _scenario_results(
    replays: _Replays, scenarios: list[AllocatorSettings], checked: tuple[_Model, bool | None], spread: Spread
) -> tuple[list[ScenarioResult], ScenarioResult | None]:
    """Each scenario's result, by ``spread`` (the recorded settings' from the check's replay,
    ``checked``) and, where a scenario started from a steady state, the recorded settings' from one
    too (else None)."""
    mid_run = bool(replays.start.segments)
    model, avoided = checked
    jobs = [
        functools.partial(_scenario_result, s, model, avoided, START_REBUILT if mid_run else None)
        if s == replays.base  # the check replayed exactly this already
        else functools.partial(replays.result, s)
        for s in scenarios
    ]
    steady = mid_run and any(s != replays.base for s in scenarios)
    if steady:
        jobs.append(functools.partial(replays.result, replays.base))
    results = spread(jobs)
    return results[: len(scenarios)], results[-1] if steady else None


def grid(base: AllocatorSettings, memory_limit: int | None) -> list[AllocatorSettings]:
    """Sensible alternatives to try when the user names none."""
    out = [replace(base, expandable_segments=True)]
    for mb in (64, 128, 256, 512):
        out.append(replace(base, max_split_size=mb * MiB, expandable_segments=False))
    out.append(replace(base, roundup_power2_divisions=(4,) * 16))
    out.append(replace(base, expandable_segments=True, roundup_power2_divisions=(4,) * 16))
    if memory_limit is not None:
        out.append(replace(base, garbage_collection_threshold=0.6, expandable_segments=False))
    return [s for s in dict.fromkeys(out) if s != base]


def scenarios_for(
    recorded: AllocatorSettings, conf: list[str], defaults: bool, memory_limit: int | None
) -> list[AllocatorSettings]:
    """The scenarios ``snaplab whatif`` replays, the recorded settings first: ``conf``
    (``KEY:VALUE`` items) applied to the recorded settings, or to PyTorch's defaults with
    ``defaults``; without ``conf``, the grid around that base (with ``defaults``, the plain
    defaults themselves too, when the recording used other settings). Raises ValueError for a
    malformed ``conf``."""
    base = AllocatorSettings() if defaults else recorded
    scenarios = [apply_conf(base, conf)] if conf else [base, *grid(base, memory_limit)]
    return [recorded, *[s for s in dict.fromkeys(scenarios) if s != recorded]]


def quick_grid(base: AllocatorSettings, memory_limit: int | None, events: int = 0) -> list[AllocatorSettings]:
    """The few alternatives the report tries on the way (``snaplab whatif`` sweeps more), with
    expandable segments and no split limit too when the recording had one; one
    for traces of more than ``WHATIF_FULL_GRID_EVENTS`` events, so a huge trace stays within the
    report's time budget (the Python model replays about 600k events per second; the
    compiled engine, when built, 10 to 20 times as many)."""
    if events > WHATIF_FULL_GRID_EVENTS:
        return [s for s in [replace(base, expandable_segments=True)] if s != base]
    out = [
        replace(base, expandable_segments=True),
        replace(base, expandable_segments=True, roundup_power2_divisions=(4,) * 16),
    ]
    if base.max_split_size != UNLIMITED:
        # what the cache would be without the split limit (the reserved-gap finding names it)
        out.append(replace(base, max_split_size=UNLIMITED, expandable_segments=True))
    if memory_limit is not None:
        out.append(replace(base, max_split_size=256 * MiB, expandable_segments=False))
    return [s for s in dict.fromkeys(out) if s != base]


@dataclass(frozen=True)
class MemoryLimit:
    """What the job's allocator could reserve, as far as the snapshot tells."""

    bytes: int | None  # None: no limit met in the trace
    source: str
    is_cap: bool = True  # a per-process cap (set_per_process_memory_fraction), not the device's capacity
    inferred: bool = False  # a guess: the snapshot shows an OOM under a cap whose value it does not record


def infer_memory_limit(frames: SnapshotFrames, device: int, reserved_peak: int | None) -> MemoryLimit:
    """The limit the job ran under: the capture sidecar's OOM record, else the OOM event. When
    the device itself had room for the failing request, a per-process cap caused the OOM; the
    snapshot does not record its value, which the trace bounds (:func:`_cap_between`). A trace
    with no OOM but with cache flushes (cudaMalloc failed and its retry succeeded) bounds the
    limit too: see :func:`_limit_from_flushes`."""
    cap = frames.info.capture or {}
    oom = cap.get("oom") if isinstance(cap, dict) else None
    ev = frames.events[(frames.events["device"] == device) & (frames.events["action"] == "oom")]
    last = ev.iloc[-1] if len(ev) else None
    device_had_room = (
        last is not None
        and not pd.isna(last["device_free_bytes"])
        and int(last["device_free_bytes"]) >= int(last["size_bytes"])
    )
    if isinstance(oom, dict) and isinstance(oom.get("limit_bytes"), int) and oom.get("device", device) == device:
        limit = int(oom["limit_bytes"])
        totals = cap.get("device_total_bytes")
        total = totals.get(str(device)) if isinstance(totals, dict) else None
        is_cap = limit < total if isinstance(total, int) else device_had_room
        return MemoryLimit(limit, "capture sidecar (the OOM observer's limit)", is_cap)
    if last is None:
        return _limit_from_flushes(frames, device, reserved_peak)
    if not device_had_room and not pd.isna(last["device_free_bytes"]):
        m = oom_moment(frames, device)
        reserved = int(m.segments["total_size_bytes"].sum()) if m is not None else 0
        return MemoryLimit(
            reserved + int(last["device_free_bytes"]), "the OOM event (device memory was full)", is_cap=False
        )
    if reserved_peak:
        return _cap_between(frames, device, reserved_peak, int(last["size_bytes"]))
    return MemoryLimit(None, "none (unlimited)")


# the sizes a per-process cap is taken to be set at, coarsest first: whole GiB, then half GiB
ROUND_CAPS = (1 << 30, 1 << 29)
CAP_INFERRED = (
    "inferred: the device had room for the failing request, so a per-process cap refused it; its value is not "
    "recorded. The trace bounds it: at least the peak reserved ({low:,} bytes), less than what was reserved when "
    "the request failed plus the segment it asked for ({high:,} bytes)"
)


def _cap_between(frames: SnapshotFrames, device: int, reserved_peak: int, request: int) -> MemoryLimit:
    """A per-process cap the snapshot does not record. Every segment the allocator reserved fit
    under it (the peak reserved: a lower bound), and the failing request's segment, after the
    allocator had freed its cache, did not (an upper bound). A cap of whole GiB, or else of half
    GiB, between them stands in for it, the smallest such; with none, the lower bound (what fits
    under it surely fit). Every capped OOM among the samples lies between its bounds, and the
    round size is its cap in all the fit recordings (6 GiB, 8 GiB for one) and the capture runs
    (1, 2 and 3 GiB): the lower bound alone was 4.9 to 6.0 GiB for the 6 GiB caps, and the largest
    batches an OOM's report gave followed it down."""
    m = oom_moment(frames, device)  # the dump's layout where the trace cannot rebuild the OOM's
    high = None
    if m is not None:
        reserved = int(m.segments["total_size_bytes"].sum())
        high = reserved + allocation_size(round_size(request, AllocatorSettings())) - 1
    if high is None or high < reserved_peak:
        return MemoryLimit(
            reserved_peak,
            "inferred: the device had room for the failing request, so a per-process cap refused it; its value "
            "is not recorded, and the peak reserved before the OOM stands in for it",
            is_cap=True,
            inferred=True,
        )
    source = CAP_INFERRED.format(low=reserved_peak, high=high)
    for unit in ROUND_CAPS:
        cap = -(-reserved_peak // unit) * unit
        if cap <= high:
            return MemoryLimit(
                cap, f"{source}; {cap / (1 << 30):g} GiB, the roundest size between them, stands in", True, True
            )
    return MemoryLimit(reserved_peak, f"{source}; the lower bound stands in", is_cap=True, inferred=True)


def _limit_from_flushes(frames: SnapshotFrames, device: int, reserved_peak: int | None) -> MemoryLimit:
    """The limit a job that never ran out of memory met: each time the allocator flushed its
    cache to retry a cudaMalloc (:mod:`.releases`), the reserved memory plus the new segment
    would have crossed it (an upper bound), while every cudaMalloc that succeeded stayed under it
    (the peak reserved: a lower bound). The peak stands in for it, as for an OOM under a cap: a
    job that flushes climbs to its limit, and what fits under the peak surely fit."""
    flushes = [r for r in find_releases(frames, device) if r.cause == "flush" and r.next_segment_bytes]
    if not flushes:
        return MemoryLimit(None, "none (unlimited)")
    upper = min(r.reserved_before_bytes + r.next_segment_bytes for r in flushes) - 1
    if reserved_peak is not None and upper < reserved_peak:
        return MemoryLimit(None, "none (the cache flushes in the trace do not agree on one limit)")
    limit = upper if reserved_peak is None else reserved_peak
    return MemoryLimit(
        limit,
        f"inferred from the {len(flushes)} cache flush{'es' if len(flushes) > 1 else ''} in the trace: the "
        f"allocator freed its cache when a cudaMalloc would have taken reserved memory over a limit of at most "
        f"{upper:,} bytes, and it reserved up to {limit:,} bytes; the limit is not recorded, and the peak reserved "
        "stands in for it",
        is_cap=True,
        inferred=True,
    )


WHATIF_FULL_GRID_EVENTS = 200_000  # above this, the report replays one alternative, not three
MIN_SAVING_BYTES = 256 * MiB
MIN_SAVING_SHARE = 0.10


def settings_label(settings: dict[str, Any]) -> str:
    """``expandable_segments:True,max_split_size_mb:128`` for a scenario's settings."""
    parts = []
    for k, v in settings.items():
        if k == "expandable_segments":
            if v:
                parts.append("expandable_segments:True")
        elif v not in (None, 0, 0.0):
            parts.append(f"{k}:{v}")
    return ",".join(parts) or "(defaults)"


def best_alternative(w: WhatIf) -> tuple[ScenarioResult, str] | None:
    """The alternative worth suggesting: one that avoids the recorded OOM (lowest peak first),
    else one that cuts the peak reserved by a meaningful amount; with why. The cut is measured
    against the recorded settings and, for a trace that starts mid-run, against the recorded
    settings replayed from the same steady state as the alternatives too (the recorded cache
    holds segments from before the trace that no steady state sees: ``twin_wrapped`` holds
    1.74 GiB, its steady state 1.65 GiB, and expandable segments really save 0.34 GiB, not
    1.74 - 1.24 = 0.50)."""
    if not w.scenarios:
        return None
    recorded, alternatives = w.scenarios[0], w.scenarios[1:]
    baseline = recorded.peak_reserved_bytes
    if w.steady_baseline is not None:
        baseline = min(baseline, w.steady_baseline.peak_reserved_bytes)
    if recorded.recorded_oom_avoided is False or recorded.ooms:
        fixes = [s for s in alternatives if not s.ooms]
        if fixes:
            best = min(fixes, key=lambda s: s.peak_reserved_bytes)
            return best, "avoids the OOM"
        return None
    better = [
        s
        for s in alternatives
        if not s.ooms
        and baseline - s.peak_reserved_bytes >= MIN_SAVING_BYTES
        and baseline - s.peak_reserved_bytes >= MIN_SAVING_SHARE * baseline
    ]
    if not better:
        return None
    return min(better, key=lambda s: s.peak_reserved_bytes), "lowers the peak reserved memory"
