"""A planned program: the recorded run's allocations and frees, rescaled, moved and
supplemented by a strategy, replayed through the caching-allocator model.

Every planned allocation carries where it came from: the recorded allocation it rescales (its
event index and recorded size) or, for what a strategy adds (FSDP's all-gather buffers, DDP's
buckets...), the recorded moment it is placed at, and the rule that made it. The replay keeps
the allocated bytes after every operation, so the peak is found where it happens, and the
allocations alive at that moment say what the peak is made of.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..allocator import native
from ..allocator.model import AllocatorSettings, CachingAllocatorModel, OutOfMemory, ReplayStats
from ..categories import CATEGORIES

ALLOC, FREE, EMPTY_CACHE, FREE_REQUESTED = 0, 1, 2, 3
# key of microbatch m's copy of recorded allocation r: r + (m + 1) * MB_KEY
MB_KEY = 1 << 32


@dataclass(frozen=True)
class Source:
    """What a planned allocation is: its category, and the rule that made it from the recording."""

    category: str
    rule: str


def _column() -> array[int]:
    """One column of a program: int64 values, 8 bytes each (a list holds an int object of 28 or
    32 bytes for most of them besides its pointer), read by the replay without a copy."""
    return array("q")


@dataclass
class Program:
    kind: array[int] = field(default_factory=_column)
    key: array[int] = field(default_factory=_column)
    size: array[int] = field(default_factory=_column)
    stream: array[int] = field(default_factory=_column)
    source: array[int] = field(default_factory=_column)  # index into sources
    # recorded event index it comes from (or is placed at)
    origin: array[int] = field(default_factory=_column)
    # recorded bytes it rescales (0: added by the plan)
    recorded: array[int] = field(default_factory=_column)
    # recorded event index where it happens in the plan
    placed: array[int] = field(default_factory=_column)
    sources: list[Source] = field(default_factory=list)
    _source_ids: dict[tuple[str, str], int] = field(default_factory=dict)

    def source_id(self, category: str, rule: str) -> int:
        sid = self._source_ids.get((category, rule))
        if sid is None:
            sid = self._source_ids[(category, rule)] = len(self.sources)
            self.sources.append(Source(category, rule))
        return sid

    def alloc(
        self,
        key: int,
        size: int,
        stream: int,
        source: int,
        origin: int,
        recorded: int,
        placed: int | None = None,
    ) -> None:
        self.placed.append(int(origin if placed is None else placed))
        self.kind.append(ALLOC)
        self.key.append(key)
        self.size.append(int(size))
        self.stream.append(int(stream))
        self.source.append(source)
        self.origin.append(int(origin))
        self.recorded.append(int(recorded))

    def free(self, key: int, origin: int) -> None:
        self._sizeless(FREE, key, origin)

    def free_requested(self, key: int, origin: int) -> None:
        """The tensor is freed but its block stays held until a later :meth:`free` (a stream
        still uses it: ``record_stream``); torch counts it as no longer allocated from now."""
        self._sizeless(FREE_REQUESTED, key, origin)

    def empty_cache(self, origin: int) -> None:
        self._sizeless(EMPTY_CACHE, -1, origin)

    def _sizeless(self, kind: int, key: int, origin: int) -> None:
        """An operation with no size of its own, where it was recorded."""
        self.placed.append(int(origin))
        self.kind.append(kind)
        self.key.append(key)
        self.size.append(0)
        self.stream.append(0)
        self.source.append(-1)
        self.origin.append(int(origin))
        self.recorded.append(0)

    def __len__(self) -> int:
        return len(self.kind)


@dataclass(frozen=True)
class PeakPart:
    """One kind of memory alive at the predicted peak."""

    category: str
    rule: str
    planned_bytes: int  # as the allocator holds them (rounded blocks)
    # what the recorded allocations it rescales asked for (0: added by the plan)
    recorded_bytes: int
    count: int
    # recorded event indexes these allocations come from (or are placed at)
    first_event: int
    last_event: int

    def to_dict(self) -> dict[str, Any]:
        """``from_recorded_events``: the recorded allocations these rescale (their event
        indexes), or, for what the plan adds (``recorded_bytes`` 0), the recorded moments it is
        placed at."""
        return {
            "category": self.category,
            "what": self.rule,
            "planned_bytes": self.planned_bytes,
            "recorded_bytes": self.recorded_bytes,
            "allocations": self.count,
            "added_by_the_plan": self.recorded_bytes == 0,
            "from_recorded_events": [self.first_event, self.last_event],
        }


@dataclass(frozen=True)
class Replayed:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    final_allocated_bytes: int
    # index of the operation at which the allocated peak is reached
    peak_op: int
    peak_origin: int  # the recorded event index where the plan reaches its peak
    parts: tuple[PeakPart, ...]  # alive at the peak, largest first
    by_category: dict[str, int]  # planned bytes at the peak per category
    cuda_malloc_calls: int
    # recorded event index where the replay ran out of memory (under a limit)
    oom_at: int | None
    # allocated bytes after every allocation or free (for a picture)
    levels: np.ndarray
    # recorded event index where each of those operations happens
    origins: np.ndarray


def replay(
    program: Program,
    settings: AllocatorSettings,
    memory_limit: int | None = None,
    limit_is_cap: bool = False,
) -> Replayed:
    """Replay through the allocator model; peak allocated (block sizes, like torch's
    ``allocated_bytes.all.peak``) and peak reserved. Under ``memory_limit`` the replay stops at
    the first allocation the allocator could not serve. The compiled engine runs it when it is
    built (:mod:`..allocator.native`), else the Python model."""
    ran = _replay_compiled(program, settings, memory_limit, limit_is_cap)
    if ran is None:
        ran = _replay_python(program, settings, memory_limit, limit_is_cap)
    block_size, levels, last, peak, peak_op, final, stats = ran
    parts, by_cat = _at_peak(program, block_size, peak_op)
    origins = np.asarray(program.placed[:last], dtype=np.int64)
    return Replayed(
        peak_allocated_bytes=peak,
        peak_reserved_bytes=stats.peak_reserved_bytes,
        final_allocated_bytes=final,
        peak_op=peak_op,
        peak_origin=program.placed[peak_op] if peak_op >= 0 else -1,
        parts=parts,
        by_category=by_cat,
        cuda_malloc_calls=stats.cuda_malloc_calls,
        oom_at=None if last == len(program) else program.origin[last],
        levels=levels[:last],
        origins=origins,
    )


# what a replay gives back: block size and allocated bytes after each operation, the number of
# operations run (an OOM stops it), the peak and its operation, the final bytes, the counters
_Ran = tuple[np.ndarray, np.ndarray, int, int, int, int, ReplayStats]


def _replay_compiled(
    program: Program, settings: AllocatorSettings, memory_limit: int | None, limit_is_cap: bool
) -> _Ran | None:
    """:func:`replay` in the compiled engine (None: it is not in use or cannot replay this)."""
    engine = native.engine(settings, memory_limit, limit_is_cap)
    if engine is None:
        return None
    count = len(program)
    block_size = np.zeros(count, dtype=np.int64)
    levels = np.zeros(count, dtype=np.int64)
    columns = (program.kind, program.key, program.size, program.stream, np.arange(count))
    try:
        ops = [native.column(c) for c in columns]
        if count and not (ops[0].min() >= ALLOC and ops[0].max() <= FREE_REQUESTED):
            return None  # the engine names other operations with other kinds
        stop, _avoided, _decided = engine.run(*ops, block_size, levels)
    except (native.Unsupported, OverflowError):
        native.fell_back()
        return None
    last = count if stop < 0 else stop
    block_size[last:] = 0
    levels[last:] = 0
    peak = int(levels[:last].max(initial=0))
    # the allocated bytes rise only at an allocation: the first operation at the peak is one
    peak_op = int(np.argmax(levels[:last])) if peak > 0 else -1
    final = int(levels[last - 1]) if last > 0 else 0
    return block_size, levels, last, peak, peak_op, final, native.stats_of(engine)


def _replay_python(program: Program, settings: AllocatorSettings, memory_limit: int | None, limit_is_cap: bool) -> _Ran:
    """:func:`replay` in the Python model (the reference)."""
    model = CachingAllocatorModel(settings, memory_limit, limit_is_cap)
    live: dict[int, Any] = {}
    pending: set[int] = set()  # freed, block still held
    count = len(program)
    # Python lists while replaying (numpy arrays after): the loop runs once per operation
    block_sizes = [0] * count
    level_list = [0] * count
    # lists: the loop below reads each value once or more (an array makes an int each time)
    kind, key, size, stream = (c.tolist() for c in (program.kind, program.key, program.size, program.stream))
    malloc, free = model.malloc, model.free
    allocated = 0
    peak, peak_op = 0, -1
    last = count
    for i in range(count):
        op_kind = kind[i]
        if op_kind == ALLOC:
            try:
                block = malloc(size[i], stream[i], i)
            except OutOfMemory:
                last = i
                break
            old: Any = live.pop(key[i], None)
            if old is not None:
                # a key allocated twice: the first is lost (should not happen)
                allocated -= old.size
                free(old)
            live[key[i]] = block
            block_sizes[i] = block.size
            allocated += block.size
            if allocated > peak:
                peak, peak_op = allocated, i
        elif op_kind == FREE:
            block = live.pop(key[i], None)
            if block is not None:
                if key[i] in pending:
                    pending.discard(key[i])
                else:
                    allocated -= block.size
                free(block)
        elif op_kind == FREE_REQUESTED:
            held: Any = live.get(key[i])
            if held is not None and key[i] not in pending:
                pending.add(key[i])
                allocated -= held.size
        else:
            model.empty_cache()
        level_list[i] = allocated
    levels = np.array(level_list, dtype=np.int64)
    return np.array(block_sizes, dtype=np.int64), levels, last, peak, peak_op, allocated, model.stats


def _at_peak(
    program: Program,
    block_size: np.ndarray,
    peak_op: int,
) -> tuple[tuple[PeakPart, ...], dict[str, int]]:
    alive: dict[int, int] = {}
    kind, key = program.kind[: peak_op + 1].tolist(), program.key[: peak_op + 1].tolist()
    for i in range(peak_op + 1):
        if kind[i] == ALLOC:
            alive[key[i]] = i
        elif kind[i] in (FREE, FREE_REQUESTED):
            alive.pop(key[i], None)
    groups: dict[int, list[int]] = {}
    for i in alive.values():
        groups.setdefault(program.source[i], []).append(i)
    parts = []
    by_cat = dict.fromkeys(CATEGORIES, 0)
    for sid, ops in groups.items():
        src = program.sources[sid]
        planned = int(block_size[ops].sum())
        origins = [program.origin[i] for i in ops]
        parts.append(
            PeakPart(
                category=src.category,
                rule=src.rule,
                planned_bytes=planned,
                recorded_bytes=int(sum(program.recorded[i] for i in ops)),
                count=len(ops),
                first_event=min(origins),
                last_event=max(origins),
            )
        )
        by_cat[src.category] = by_cat.get(src.category, 0) + planned
    parts.sort(key=lambda part: -part.planned_bytes)
    return tuple(parts), by_cat
