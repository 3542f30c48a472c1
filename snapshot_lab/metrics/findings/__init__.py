"""Findings: what the numbers mean for the user, each with its evidence and advice.

One module per family of findings, each with a ``find(context)`` rule; :func:`compute_findings`
runs them all on one snapshot, :func:`compute_fleet_findings` runs the rules over several files
(the ranks of one job: ``pipeline``) on their summaries. A finding is raised only when the
snapshot shows the situation, and carries the numbers that show it; ``savings_bytes`` is the
memory the advice would free or make usable, when the snapshot tells.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...frames import SnapshotFrames
from ..allocator.whatif import WhatIf
from ..categories import CategoryBreakdown
from ..comparison.snapshot_summary import SnapshotSummary
from ..history.timeline import Timeline
from ..leaks import LeakAnalysis
from ..parallel.parallelism import ParallelLayout, layout_from_name
from ..parallel.pipeline import pipeline_skew
from ..stats.summary import SnapshotStats
from . import (
    allocator,
    cache_flush,
    churn,
    dataparallel,
    ddp,
    fragmentation,
    fsdp,
    fsdp_prefetch,
    graphs,
    leaks,
    oom,
    pipeline,
    recording,
    recovered_oom,
    reserved_gap,
    streams,
    tensor_parallel,
)
from .base import SEVERITY_ORDER, Finding, FindingContext, FleetContext

RULES: list[Callable[[FindingContext], list[Finding]]] = [
    oom.find,
    recovered_oom.find,
    allocator.find,
    ddp.find,
    fsdp.find,
    fsdp_prefetch.find,
    tensor_parallel.find,
    dataparallel.find,
    leaks.find,
    fragmentation.find,
    reserved_gap.find,
    churn.find,
    cache_flush.find,
    streams.find,
    graphs.find,
    recording.find,
]

# rules over several files, on their summaries
FLEET_RULES: list[Callable[[FleetContext], list[Finding]]] = [
    pipeline.find,
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
    out = [finding for rule in RULES for finding in rule(ctx)]
    # most severe first; within a severity, the devices in the stats' order (the failing one first)
    place = {device: index for index, device in enumerate(stats.devices)}
    out.sort(
        key=lambda finding: (
            SEVERITY_ORDER[finding.severity],
            -1 if finding.device is None else place.get(finding.device, finding.device),
        )
    )
    return out


def compute_fleet_findings(
    summaries: Mapping[str, SnapshotSummary], layouts: Mapping[str, ParallelLayout | None] | None = None
) -> list[Finding]:
    """Findings across several files (``summaries`` keyed by path), most severe first. Each
    file's place in the parallel layout is ``layouts``' or, by default, its summary's (from the
    capture sidecar), else its file name's."""
    lays = {
        path: (layouts or {}).get(path) or summary.layout or layout_from_name(path) or summary.stack_layout
        for path, summary in summaries.items()
    }
    ctx = FleetContext(dict(summaries), lays, pipeline_skew(summaries, lays))
    out = [finding for rule in FLEET_RULES for finding in rule(ctx)]
    out.sort(key=lambda finding: SEVERITY_ORDER[finding.severity])
    return out


@dataclass(frozen=True)
class FleetFindings:
    """``findings`` over several files: each file's own findings (as for one file), the findings
    across the files, and the files that could not be read."""

    # path -> its findings, most severe first; in the order given
    files: dict[str, list[Finding]]
    across_files: list[Finding]
    errors: dict[str, str]  # path -> why it could not be read

    def to_dict(self) -> dict[str, Any]:
        """One list of findings, each tagged with the file it is about (``file``, null for one
        across the files) and the files it rests on (``files``): the findings across the files
        first, then each file's in the order given."""
        read = list(self.files)
        return {
            "files": read,
            "findings": [
                *({"file": None, "files": read, **finding.to_dict()} for finding in self.across_files),
                *(
                    {"file": path, "files": [path], **finding.to_dict()}
                    for path, findings in self.files.items()
                    for finding in findings
                ),
            ],
            "errors": self.errors,
        }


__all__ = [
    "FLEET_RULES",
    "RULES",
    "SEVERITY_ORDER",
    "Finding",
    "FindingContext",
    "FleetContext",
    "FleetFindings",
    "compute_findings",
    "compute_fleet_findings",
]
