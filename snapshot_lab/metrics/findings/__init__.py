"""Findings: what the numbers mean for the user, each with its evidence and advice.

One module per family of findings, each with a ``find(context)`` rule; :func:`compute_findings`
runs them all. A finding is raised only when the snapshot shows the situation, and carries the
numbers that show it; ``savings_bytes`` is the memory the advice would free or make usable, when
the snapshot tells.
"""

from __future__ import annotations

from collections.abc import Callable

from ...frames import SnapshotFrames
from ..categories import CategoryBreakdown
from ..leaks import LeakAnalysis
from ..summary import SnapshotStats
from ..timeline import Timeline
from ..whatif import WhatIf
from . import (
    allocator,
    churn,
    dataparallel,
    ddp,
    fragmentation,
    fsdp,
    graphs,
    leaks,
    oom,
    recording,
    streams,
    tensor_parallel,
)
from .base import SEVERITY_ORDER, Finding, FindingContext

RULES: list[Callable[[FindingContext], list[Finding]]] = [
    oom.find,
    allocator.find,
    ddp.find,
    fsdp.find,
    tensor_parallel.find,
    dataparallel.find,
    leaks.find,
    fragmentation.find,
    churn.find,
    streams.find,
    graphs.find,
    recording.find,
]


def compute_findings(
    stats: SnapshotStats,
    frames: SnapshotFrames,
    timelines: dict[int, Timeline | None] | None = None,
    categories: dict[int, CategoryBreakdown] | None = None,
    leaks: dict[int, LeakAnalysis] | None = None,
    whatifs: dict[int, WhatIf] | None = None,
) -> list[Finding]:
    """All findings, most severe first."""
    ctx = FindingContext(stats, frames, timelines or {}, categories or {}, leaks or {}, whatifs or {})
    out = [f for rule in RULES for f in rule(ctx)]
    out.sort(key=lambda f: (SEVERITY_ORDER[f.severity], f.device if f.device is not None else -1))
    return out


__all__ = ["RULES", "SEVERITY_ORDER", "Finding", "FindingContext", "compute_findings"]
