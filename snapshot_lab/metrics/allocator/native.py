"""Which replay engine runs the allocator model: the compiled one (``_replay.c``, built by
``pip install`` when a C compiler is there) or the pure-Python model (:mod:`.model`, the
reference). Both give the same results to the byte; the compiled engine replays a whole
operation stream in C.

``SNAPLAB_PURE_PYTHON=1`` forces the Python model. Anything the compiled engine does not
reproduce (a value out of its range, a state the Python model handles in its own way) raises
:class:`Unsupported` inside it, and the caller replays the same stream in Python instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import _compiled as compiled_parts
from .model import UNLIMITED, AllocatorSettings, ReplayStats
from .state import StartState

try:
    from . import _replay as _compiled
except ImportError:  # not built: no compiler at install time, or a source checkout
    _compiled = None  # type: ignore[assignment]

# operation kinds of Engine.run (the OP_* of _replay.c)
ALLOC, FREE, EMPTY_CACHE, FREE_REQUESTED = 0, 1, 2, 3
ALLOC_KEEP, RECORD_ADDRESS, OOM_PROBE, NOP = 4, 5, 6, 7
RELEASE_UNLESS_SERVED, ALLOC_IF_ABSENT, TRY = 8, 9, 10

ENV_PURE_PYTHON = compiled_parts.PURE_PYTHON_VARIABLE  # SNAPLAB_PURE_PYTHON, as for the other compiled parts


# raised by the compiled engine when it cannot replay a stream exactly (the Python model will)
Unsupported: type[ValueError] = _compiled.Unsupported if _compiled is not None else ValueError


_fallbacks = [0]  # streams the compiled engine handed back to the Python model


def fell_back() -> None:
    """Count a stream the compiled engine could not replay (the Python model did)."""
    _fallbacks[0] += 1


def fallbacks() -> int:
    """How many streams the compiled engine handed back to the Python model so far."""
    return _fallbacks[0]


def available() -> bool:
    """Whether the compiled engine was built."""
    return _compiled is not None


def enabled() -> bool:
    """Whether replays use the compiled engine: built, and not switched off with
    ``SNAPLAB_PURE_PYTHON=1``."""
    return _compiled is not None and not compiled_parts.pure_python_forced()


def backend() -> str:
    """``compiled`` or ``pure-python``: the allocator replay in use (``snaplab --version`` says it
    for every compiled part, through :func:`snapshot_lab._compiled.describe`)."""
    return "compiled" if enabled() else "pure-python"


def engine(
    settings: AllocatorSettings, limit: int | None, limit_is_cap: bool = True, top_down: bool = False
) -> Any | None:
    """A fresh compiled allocator (None: the Python model must run: not built, switched off,
    or settings out of the engine's range)."""
    if not enabled():
        return None
    try:
        return _compiled.Engine(
            None if settings.max_split_size == UNLIMITED else settings.max_split_size,
            settings.max_non_split_rounding,
            tuple(settings.roundup_power2_divisions),
            float(settings.garbage_collection_threshold),
            bool(settings.expandable_segments),
            limit,
            bool(limit_is_cap),
            bool(top_down),
        )
    except (Unsupported, TypeError, OverflowError):
        fell_back()
        return None


def column(values: Any) -> np.ndarray:
    """An operation column as the engine reads it: contiguous int64."""
    return np.ascontiguousarray(values, dtype=np.int64)


def stats_of(eng: Any) -> ReplayStats:
    """The engine's counters as the Python model keeps them."""
    reserved, peak_reserved, allocated, peak_allocated, mallocs, frees, retries, ooms, _level = eng.stats()
    return ReplayStats(
        reserved_bytes=reserved,
        peak_reserved_bytes=peak_reserved,
        allocated_bytes=allocated,
        peak_allocated_bytes=peak_allocated,
        cuda_malloc_calls=mallocs,
        cuda_free_calls=frees,
        alloc_retries=retries,
        ooms=list(ooms),
    )


def seed(eng: Any, start: StartState) -> None:
    """:func:`.state.seed` into the compiled engine: the same chains of blocks, in the same order
    (its live blocks are then the engine's, under their addresses)."""
    groups: dict[tuple[int, bool], list[tuple[int, list[tuple[int, int, bool]]]]] = {}
    for s in start.segments:
        if s.expandable:
            groups.setdefault((s.stream, s.small), []).append((s.address, s.blocks()))
        else:
            blocks = s.blocks()
            allocated = {a for a, _, alloc in blocks if alloc}
            chain = [(a, n, True, a in allocated) for a, n, _ in blocks]
            _seed_chain(eng, s.stream, s.small, False, s.address, sum(n for _, n, _ in blocks), chain)
    for (stream, small), ranges in groups.items():
        _seed_expandable(eng, stream, small, ranges)


def _seed_expandable(eng: Any, stream: int, small: bool, ranges: list[tuple[int, list[tuple[int, int, bool]]]]) -> None:
    """``CachingAllocatorModel.seed_expandable``: the mapped ranges, the unmapped gaps between
    them and the unmapped address space after the last, as one chain."""
    ranges = sorted(ranges)
    base = ranges[0][0]
    allocated = {a for _, blocks in ranges for a, _, alloc in blocks if alloc}
    chain: list[tuple[int, int, bool, bool]] = []
    pos, booked = base, 0
    for start, blocks in ranges:
        if start > pos:
            chain.append((pos, start - pos, False, False))
        chain.extend((a, n, True, a in allocated) for a, n, _ in blocks)
        pos = start + sum(n for _, n, _ in blocks)
        booked += pos - start
    chain.append((pos, base + (1 << 47) - pos, False, False))
    _seed_chain(eng, stream, small, True, base, booked, chain)


def _seed_chain(
    eng: Any,
    stream: int,
    small: bool,
    expandable: bool,
    start: int,
    booked: int,
    chain: list[tuple[int, int, bool, bool]],
) -> None:
    addrs, sizes, mapped, allocated = (column(c) for c in zip(*chain, strict=True)) if chain else (column([]),) * 4
    eng.seed_chain(stream, small, expandable, start, booked, addrs, sizes, mapped, allocated)
