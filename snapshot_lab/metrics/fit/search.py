"""The largest batch whose whole step runs under a memory limit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..allocator.model import MIN_BLOCK, AllocatorSettings
from .tape import Tape, ordered_ops, simulate

FRACTION_STEPS = 100  # without the recorded batch in samples: the largest batch to 1% of the recorded one
MAX_UNITS = 1 << 20
LONG_TAPE_ROWS = 40_000  # above this, replaying the allocator for every candidate batch takes too long


@dataclass
class PeakCurve:
    """Peak allocated at any batch, from one ordering of the tape."""

    tape: Tape

    def __post_init__(self) -> None:
        self.which, self.is_free = ordered_ops(self.tape)
        self.sign = np.where(self.is_free, -1, 1)

    def peak(self, scale: float) -> int:
        if not len(self.tape):
            return 0
        size = self.tape.sizes(scale)
        rounded = np.where(size > 0, -(-size // MIN_BLOCK) * MIN_BLOCK, 0)
        return int(np.cumsum(self.sign * rounded[self.which]).max(initial=0))


def largest_batch(tape: Tape, units: int, settings: AllocatorSettings, limit: int) -> int:
    """The largest batch, in ``units`` per recorded batch, whose step runs under ``limit``
    (0: not even one unit). Monotone in the batch: bisection on the allocated peak (a bound),
    then, down from that bound, replays through the allocator (none for a tape longer than
    ``LONG_TAPE_ROWS``: the bound stands)."""
    curve = PeakCurve(tape)
    if curve.peak(1 / units) > limit:
        return 0
    lo, hi = 1, 2
    while hi < MAX_UNITS and curve.peak(hi / units) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # allocated: lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if curve.peak(mid / units) <= limit else (lo, mid)
    if len(tape) > LONG_TAPE_ROWS:
        return lo
    return _down_from(lo, lambda n: bool(simulate(tape, n / units, settings, limit).fits))


def _down_from(top: int, fits: Callable[[int], bool]) -> int:
    """The largest n <= top that fits: steps down doubling until one fits, then bisection (the
    answer is usually close to the allocated bound)."""
    if fits(top):
        return top
    hi, step = top, 1
    lo = top - step
    while lo > 0 and not fits(lo):
        hi, step = lo, step * 2
        lo = max(top - step, 0)
    lo = max(lo, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
