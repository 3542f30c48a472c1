"""One training step as a tape of allocations whose sizes are functions of the batch.

Every row is one tensor: where it is allocated and freed (positions on the recorded trace,
fractional for what a lever or the extrapolation adds), its size as ``fixed + per_batch * k``
(``k``: the batch as a fraction of the recorded one), its category and its stream. The peak
allocated at any ``k`` is a running sum over the tape; reserved memory, and whether a capped
process survives, come from replaying the tape through the caching-allocator model.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._memo import forget_named, memo
from ..allocator import native
from ..allocator.model import MIN_BLOCK, AllocatorSettings, CachingAllocatorModel, OutOfMemory, segment_address_space
from .labels import Labels

NEVER = np.inf


@dataclass(frozen=True)
class Tape:
    start: np.ndarray  # float64 positions
    end: np.ndarray  # float64; NEVER: alive to the end of the step
    fixed: np.ndarray  # float64 bytes that do not depend on the batch
    per_batch: np.ndarray  # float64 bytes at the recorded batch that scale with it
    category: Labels  # parameter, gradient, optimizer_state, activation, workspace, input
    stream: np.ndarray  # int64
    phase: Labels  # setup, data, forward, backward, step
    block: np.ndarray  # int32: the repeated block it belongs to (-1: none)
    autocast: np.ndarray  # int8: what autocast makes of it (AUTOCAST_* in evidence)

    def __post_init__(self) -> None:
        for name in ("category", "phase"):  # given as an array of names: held as labels
            object.__setattr__(self, name, Labels.of(getattr(self, name), self.start.size))

    def __len__(self) -> int:
        return int(self.start.size)

    def sizes(self, scale: float) -> np.ndarray:
        """Bytes each tensor asks for at ``scale`` times the recorded batch (0: not made)."""
        raw = np.ceil(self.fixed + self.per_batch * scale)
        return np.maximum(raw, 0).astype(np.int64)

    def select(self, keep: np.ndarray) -> Tape:
        return Tape(*(getattr(self, f)[keep] for f in _FIELDS))

    def with_rows(self, *others: Tape) -> Tape:
        """This tape's rows, then those of ``others`` in order (one concatenation for all)."""
        if not others:
            return self
        return Tape(*(_concat([getattr(self, f), *(getattr(o, f) for o in others)]) for f in _FIELDS))

    def scaled(self, rows: np.ndarray, factor: float) -> Tape:
        """``rows`` (a mask) made ``factor`` times as large (both parts)."""
        fixed, per = self.fixed.copy(), self.per_batch.copy()
        fixed[rows] *= factor
        per[rows] *= factor
        return replace(self, fixed=fixed, per_batch=per)


_FIELDS = ("start", "end", "fixed", "per_batch", "category", "stream", "phase", "block", "autocast")


def _concat(columns: list[Any]) -> Any:
    return Labels.concat(columns) if isinstance(columns[0], Labels) else np.concatenate(columns)


def make_tape(
    start: np.ndarray,
    end: np.ndarray,
    fixed: np.ndarray,
    per_batch: np.ndarray,
    category: np.ndarray | Labels | str,
    stream: np.ndarray | int = 0,
    phase: np.ndarray | Labels | str = "forward",
    block: np.ndarray | int = -1,
    autocast: np.ndarray | int = 0,
) -> Tape:
    """A tape from columns; a scalar stands for the same value in every row."""
    n = np.asarray(start).size

    def column(v: object, dtype: type | np.dtype) -> np.ndarray:
        return v.astype(dtype) if isinstance(v, np.ndarray) else np.full(n, v, dtype=dtype)

    return Tape(
        np.asarray(start, dtype=np.float64).reshape(n),
        np.asarray(end, dtype=np.float64).reshape(n),
        np.asarray(fixed, dtype=np.float64).reshape(n),
        np.asarray(per_batch, dtype=np.float64).reshape(n),
        Labels.of(category, n),
        column(stream, np.int64),
        Labels.of(phase, n),
        column(block, np.int32),
        column(autocast, np.int8),
    )


def empty_tape() -> Tape:
    z = np.zeros(0)
    return make_tape(z, z, z, z, "activation")


def ordered_ops(tape: Tape) -> tuple[np.ndarray, np.ndarray]:
    """Row of every operation (allocations, then frees) and whether it is a free, in order:
    by position, an allocation before a free at the same position, rows in order among equals.
    The order does not depend on the batch: it is sorted once per tape (a lever's search replays
    one tape many times), and once for tapes that share their positions (a lever that only
    rescales sizes keeps the arrays of the tape it rewrites)."""
    return memo(tape, "ordered_ops", lambda: _shared_order(tape.start, tape.end))


def forget_order(tape: Tape) -> None:
    """Drop the order :func:`ordered_ops` keeps for ``tape``, where nothing reads it again (a
    later call sorts it anew)."""
    forget_named(tape, "ordered_ops")
    forget_named(tape.end, "ordered_ops")


def _shared_order(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_ordered_ops`, kept with the ``end`` array for every tape made with the same two
    arrays (the ``start`` kept beside it tells an array that took a dead one's identity)."""
    kept_start, order = memo(end, ("ordered_ops", id(start)), lambda: (start, _ordered_ops(start, end)))
    return order if kept_start is start else _ordered_ops(start, end)


def _ordered_ops(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = start.size
    freed = np.flatnonzero(np.isfinite(end))
    # allocations first: an allocation before a free at one position
    order = np.argsort(np.concatenate([start, end[freed]]), kind="stable").astype(np.int64, copy=False)
    is_free = order >= rows
    order[is_free] = freed[order[is_free] - rows]  # each free's row, in place of its place in the sort
    return order, is_free


def peak_allocated(tape: Tape, scale: float) -> int:
    """Most bytes allocated at once (rounded blocks, like torch's counter)."""
    if not len(tape):
        return 0
    rounded = np.maximum(-(-tape.sizes(scale) // MIN_BLOCK) * MIN_BLOCK, 0)
    rounded[tape.sizes(scale) == 0] = 0
    which, is_free = ordered_ops(tape)
    delta = np.where(is_free, -rounded[which], rounded[which])
    return int(np.cumsum(delta).max(initial=0))


@dataclass(frozen=True)
class Simulated:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits: bool | None  # under the limit: did the whole step run


class TopDownAllocator(CachingAllocatorModel):
    """The allocator model with new segments placed as the CUDA driver places them: from the top
    of the address space down (the fit recordings' segments go down more often than up), in the
    lowest freed range that fits when there is one. Among free blocks of one size the allocator
    takes the lowest address, so the order decides which cached blocks stay split: replaying
    ``fit_gpt2_b4_complete_python`` with increasing addresses reserves 6.02 GiB, with
    decreasing ones the 6.08 GiB it recorded (ResNet-50's recordings are the same either way)."""

    TOP = 1 << 47

    def _fresh_range(self, need: int) -> int:
        self._next_addr = min(self._next_addr, self.TOP) - need
        return self._next_addr

    def _return_address(self, addr: int, size: int) -> None:
        bisect.insort(self._free_va, (addr, segment_address_space(size)))


def simulate(tape: Tape, scale: float, settings: AllocatorSettings, limit: int | None = None) -> Simulated:
    """Replay the tape at ``scale`` through the allocator model (under ``limit``: a
    per-process cap, cached blocks released and the request retried before giving up). The
    compiled engine runs it when it is built (:mod:`..allocator.native`), else the Python model.
    Replayed once per tape, batch, settings, limit and engine (the step asked for is often a
    lever's)."""
    key = ("simulate", scale, settings, limit, native.enabled())
    return memo(tape, key, lambda: _simulate(tape, scale, settings, limit))


def _top_down(settings: AllocatorSettings) -> bool:
    """Whether new segments go from the top of the address space down (:class:`TopDownAllocator`):
    cudaMalloc'd segments do. An expandable segment is one range per stream that grows upward as
    pages are mapped at its end, so under ``expandable_segments`` the tape is laid out as the
    what-if replays the trace (issue #37: on one complete Mixtral-config step, fit's
    ``expandable_segments`` row said 3.47 GiB reserved where ``whatif`` said 2.76 GiB; the
    top-down ranges left no room above a segment to grow into)."""
    return not settings.expandable_segments


def _simulate(tape: Tape, scale: float, settings: AllocatorSettings, limit: int | None) -> Simulated:
    sizes = tape.sizes(scale)
    which, is_free = ordered_ops(tape)
    fast = _simulate_compiled(tape, sizes, which, is_free, settings, limit)
    if fast is not None:
        return fast
    made = sizes[which] > 0  # a row not made has neither its allocation nor its free
    which, is_free = which[made], is_free[made]
    size = sizes.tolist()  # Python ints: the loop below runs once per operation
    stream = tape.stream.tolist()
    model = (TopDownAllocator if _top_down(settings) else CachingAllocatorModel)(settings, limit, limit_is_cap=True)
    malloc, free = model.malloc, model.free
    live: dict[int, Any] = {}
    for r, f in zip(which.tolist(), is_free.tolist(), strict=True):
        if f:
            block = live.pop(r, None)
            if block is not None:
                free(block)
            continue
        try:
            live[r] = malloc(size[r], stream[r])
        except OutOfMemory:
            return Simulated(model.stats.peak_allocated_bytes, model.stats.peak_reserved_bytes, False)
    fits = None if limit is None else True
    return Simulated(model.stats.peak_allocated_bytes, model.stats.peak_reserved_bytes, fits)


def _simulate_compiled(
    tape: Tape,
    sizes: np.ndarray,
    which: np.ndarray,
    is_free: np.ndarray,
    settings: AllocatorSettings,
    limit: int | None,
) -> Simulated | None:
    """:func:`simulate` in the compiled engine, which takes the tape by row (None: it is not in
    use or cannot replay this)."""
    engine = native.engine(settings, limit, limit_is_cap=True, top_down=_top_down(settings))
    if engine is None:
        return None
    try:
        stop = engine.run_tape(which, is_free, sizes, native.column(tape.stream))
    except (native.Unsupported, OverflowError):
        native.fell_back()
        return None
    stats = native.stats_of(engine)
    fits = False if stop >= 0 else None if limit is None else True
    return Simulated(stats.peak_allocated_bytes, stats.peak_reserved_bytes, fits)
