"""The small summary of one snapshot that ``diff``, ``ranks``, ``check`` and the findings
across files (``findings`` over several ranks) work on, never on two sets of frames.

Its own module, beside :mod:`.compare` (which builds it) and :mod:`.findings` (whose rules over
several files read it), so that neither has to import the other for the type."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..parallel.parallelism import ParallelLayout


@dataclass(frozen=True)
class SnapshotSummary:
    """What ``diff``, ``ranks`` and ``check`` need of one snapshot (small, picklable)."""

    path: str
    devices: list[int]
    torch_stats: dict[str, int]
    external_fragmentation: float
    free_in_reserved_bytes: int
    stranded_bytes: int
    peak_requested_bytes: int | None
    peak_reserved_bytes: int | None
    oom_cause: str | None
    oom_requested_bytes: int | None
    categories: dict[str, int]
    findings: list[str]
    leak_growth_bytes_per_iteration: int
    sites: list[dict[str, Any]] = field(default_factory=list)
    # where the rank sits in the parallel layout (from the capture sidecar), when it says
    layout: ParallelLayout | None = None
    # at each device's peak of requested bytes (summed over devices): requested bytes per
    # category, and the largest sites alive then ({site, detail, category, bytes}, at most
    # PEAK_SITES_LIMIT); empty without a trace
    peak_categories: dict[str, int] = field(default_factory=dict)
    peak_sites: list[dict[str, Any]] = field(default_factory=list)
    # at the same peaks: requested bytes by module (self bytes; metrics.modules), with the
    # bytes outside any module and those allocated before the trace as rows of their own;
    # modules_source 'tags' (exact), 'stacks' (approximate) or 'none'
    peak_modules: dict[str, int] = field(default_factory=dict)
    modules_source: str = "none"
    # the pipeline stage the stacks show (metrics.parallelism.layout_from_pipeline_stacks): used
    # when neither the sidecar nor the file name places the file
    stack_layout: ParallelLayout | None = None
    # memory over the trace, per device, reduced to at most TIMELINE_POINTS buckets (each bucket's
    # largest value): {device, x_label ('seconds' or 'event index'), x (bucket starts: seconds
    # since the first event, or event index), index (the bucket starts' event index), requested,
    # reserved}; only for ``diff`` (empty for ranks and check, and without a trace)
    timelines: list[dict[str, Any]] = field(default_factory=list)

    @property
    def reserved(self) -> int:
        return self.torch_stats["reserved_bytes.all.current"]

    @property
    def allocated(self) -> int:
        return self.torch_stats["allocated_bytes.all.current"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
