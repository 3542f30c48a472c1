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
        # both parts of every operation's size, in operation order (one gather, not one per batch)
        self.fixed = self.tape.fixed[self.which]
        self.per_batch = self.tape.per_batch[self.which]
        # every size grows with the batch, and with it the peak: the largest batch is a boundary
        self.monotone = bool((self.tape.per_batch >= 0).all())

    def _allocated(self, scale: float) -> np.ndarray:
        """Bytes allocated after each operation at ``scale`` (sizes rounded as the allocator does)."""
        size = np.maximum(np.ceil(self.fixed + self.per_batch * scale), 0).astype(np.int64)  # Tape.sizes
        rounded = np.where(size > 0, -(-size // MIN_BLOCK) * MIN_BLOCK, 0)
        return np.cumsum(self.sign * rounded)

    def peak(self, scale: float) -> int:
        if not len(self.tape):
            return 0
        return int(self._allocated(scale).max(initial=0))

    def batch_part_peak(self) -> int:
        """The most of what grows with the batch alive at once, at the recorded batch (the
        activations at their own peak, wherever the step's peak is)."""
        if not len(self.tape):
            return 0
        return int(np.cumsum(self.sign * self.per_batch).max(initial=0))

    def alive_at_peak(self, scale: float, rows: np.ndarray) -> int:
        """Bytes of the tensors in ``rows`` (a mask) alive at the peak allocated at ``scale``."""
        if not len(self.tape) or not rows.any():
            return 0
        upto = int(self._allocated(scale).argmax()) + 1
        which, freeing = self.which[:upto], self.is_free[:upto]
        alive = np.zeros(len(self.tape), dtype=np.int8)
        np.add.at(alive, which, np.where(freeing, -1, 1))
        return int(self.tape.sizes(scale)[(alive > 0) & rows].sum())

    def largest(self, units: int, limit: int) -> int:
        """The largest batch, in ``units`` per recorded batch, whose peak allocated is within
        ``limit`` (0: not even one unit; below MAX_UNITS). Every size grows with the batch, so the
        peak does, and the answer is the one boundary; it is found by interpolating between the
        peaks on either side (a few evaluations, where doubling and bisection take about twenty),
        bisecting where that stops closing in."""
        first = self.peak(1 / units)
        if first > limit:
            return 0
        if not self.monotone:
            return self._doubling(units, limit)
        return _boundary(lambda n: self.peak(n / units), first, limit)

    def _doubling(self, units: int, limit: int) -> int:
        """:meth:`largest` for a peak that need not grow with the batch: doubling, then bisection."""
        lo, hi = 1, 2
        while hi < MAX_UNITS and self.peak(hi / units) <= limit:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # allocated: lo fits, hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak(mid / units) <= limit else (lo, mid)
        return lo


def _boundary(value: Callable[[int], int], first: int, limit: int) -> int:
    """The largest n below MAX_UNITS with ``value(n) <= limit``, for a ``value`` that grows with
    n and is within the limit at 1 (``first``). MAX_UNITS counts as over the limit, as in the
    doubling search. Each guess is where the line through the nearest values on either side (or,
    with none above yet, through the last two below) meets the limit; bisection when the bracket
    did not halve in two guesses."""
    lo, at_lo = 1, first
    hi, at_hi = MAX_UNITS, None  # at_hi None: MAX_UNITS itself, never evaluated
    before, at_before = 0, None
    widths = [hi - lo]
    while hi - lo > 1:
        if len(widths) > 2 and widths[-1] * 2 > widths[-3]:  # not halved in two guesses
            guess = (lo + hi) // 2
        elif at_hi is not None:
            guess = lo + (limit - at_lo) * (hi - lo) // (at_hi - at_lo)
        elif at_before is not None and at_lo > at_before:  # past the line's crossing: a bracket sooner
            guess = lo + 2 * (limit - at_lo) * (lo - before) // (at_lo - at_before) + 1
        else:
            guess = 2 * lo
        guess = min(max(guess, lo + 1), hi - 1)
        got = value(guess)
        if got <= limit:
            before, at_before, lo, at_lo = lo, at_lo, guess, got
        else:
            hi, at_hi = guess, got
        widths.append(hi - lo)
    return lo


def largest_batch(
    tape: Tape, units: int, settings: AllocatorSettings, limit: int, at_least: int = 0, bound: int | None = None
) -> int:
    """The largest batch, in ``units`` per recorded batch, whose step runs under ``limit``
    (0: not even one unit). Monotone in the batch: the allocated peak's boundary (a bound),
    then, down from that bound, replays through the allocator (none for a tape longer than
    ``LONG_TAPE_ROWS``: the bound stands). ``at_least``: a batch whose replay fits (the one asked
    for): near the boundary the replay is not monotone, and the search down from the bound may
    pass over it (a capped ResNet-50 that ran at batch 162 was told 0.94x of it fits,
    ``fit_resnet50_b162_ckpt_capped_python``), so the answer is never below it. ``bound``: the
    allocated peak's boundary where the caller has it already."""
    lo = PeakCurve(tape).largest(units, limit) if bound is None else bound
    if lo == 0 or len(tape) > LONG_TAPE_ROWS:
        return lo
    found = _down_from(lo, lambda n: bool(simulate(tape, n / units, settings, limit).fits))
    return max(found, at_least) if at_least <= lo else found


def largest_batch_no_retry(tape: Tape, units: int, settings: AllocatorSettings, limit: int, top: int) -> int | None:
    """The largest batch up to ``top`` (the answer of :func:`largest_batch`), in ``units`` per
    recorded batch, whose step reserves no more than ``limit`` replayed without it: the
    allocator never reaches the limit, so never frees its cache to retry a request. Up to it the
    step fits whatever the process did before; above it, only as its cache's fragmentation
    allows, which the process's history moves (GPT-2 with checkpointing ran at batch 27 after
    other runs in its process and failed at 27 in a fresh one,
    ``fit_gpt2_b27_ckpt_capped_python``). None for a tape too long to replay per batch."""
    if top <= 0 or len(tape) > LONG_TAPE_ROWS:
        return None if top > 0 else 0
    return _down_from(top, lambda n: simulate(tape, n / units, settings).peak_reserved_bytes <= limit)


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
