"""Everything the diagnostics need, computed once per snapshot and shared by the commands and
the report: timelines, categories, leak suspects and the findings drawn from them."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..frames import SnapshotFrames
from .categories import CategoryBreakdown, compute_categories, stack_categories
from .findings import Finding, compute_findings
from .leaks import LeakAnalysis, find_leaks
from .lifetimes import allocation_lifetimes
from .summary import SnapshotStats
from .timeline import Timeline, compute_timeline


@dataclass(frozen=True)
class Diagnosis:
    timelines: dict[int, Timeline | None]
    categories: dict[int, CategoryBreakdown]
    leaks: dict[int, LeakAnalysis]
    findings: list[Finding]
    lifetimes: dict[int, pd.DataFrame]


def diagnose(frames: SnapshotFrames, stats: SnapshotStats, with_category_timelines: bool = True) -> Diagnosis:
    timelines: dict[int, Timeline | None] = {}
    categories: dict[int, CategoryBreakdown] = {}
    leaks: dict[int, LeakAnalysis] = {}
    lifetimes: dict[int, pd.DataFrame] = {}
    stack_cat = stack_categories(frames)
    for dev, d in stats.devices.items():
        lifetimes[dev] = allocation_lifetimes(frames.events, dev)
        timelines[dev] = compute_timeline(
            frames.events,
            dev,
            d.torch_stats["requested_bytes.all.current"],
            d.torch_stats["reserved_bytes.all.current"],
            frames.annotations,
        )
        categories[dev] = compute_categories(
            frames, dev, with_timeline=with_category_timelines, lifetimes=lifetimes[dev], stack_cat=stack_cat
        )
        leaks[dev] = find_leaks(frames, dev, lifetimes[dev])
    findings = compute_findings(stats, frames.events, timelines, categories, leaks)
    return Diagnosis(timelines, categories, leaks, findings, lifetimes)
