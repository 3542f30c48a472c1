"""What every finding rule shares: the finding itself, and what the rules read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ...frames import SnapshotFrames
from ..allocator.whatif import WhatIf
from ..categories import CategoryBreakdown
from ..history.timeline import Timeline
from ..leaks import LeakAnalysis
from ..parallel.parallelism import ParallelLayout
from ..parallel.pipeline import PipelineSkew
from ..stats.summary import SnapshotStats

if TYPE_CHECKING:  # compare imports diagnose, which imports the findings
    from ..comparison.snapshot_summary import SnapshotSummary

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
MiB = 1024 * 1024


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str  # 'critical', 'warning', 'info'
    title: str
    advice: str
    evidence: dict[str, Any] = field(default_factory=dict)
    # memory the advice would free or make usable, when known
    savings_bytes: int | None = None
    device: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FindingContext:
    """The analyses a rule may read (all computed once per snapshot by ``diagnose``)."""

    stats: SnapshotStats
    frames: SnapshotFrames
    timelines: dict[int, Timeline | None] = field(default_factory=dict)
    categories: dict[int, CategoryBreakdown] = field(default_factory=dict)
    leaks: dict[int, LeakAnalysis] = field(default_factory=dict)
    whatifs: dict[int, WhatIf] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetContext:
    """What a rule over several files reads: each file's summary (keyed by path), its place in
    the parallel layout, and the pipeline's stages when the files span several."""

    summaries: dict[str, SnapshotSummary]
    layouts: dict[str, ParallelLayout | None]
    pipeline: PipelineSkew | None
