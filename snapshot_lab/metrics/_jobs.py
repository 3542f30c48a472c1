"""How a metric computes several independent jobs (allocator replays of a second or more): in
turn by default; the caller may pass :func:`snapshot_lab.aside.spread` instead, which spreads them
over the CPUs and returns the same values. Metrics themselves fork nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Spread = Callable[[Sequence[Callable[[], Any]]], list[Any]]


def in_turn(jobs: Sequence[Callable[[], Any]]) -> list[Any]:
    """Each job's value, computed one after the other in this process."""
    return [job() for job in jobs]
