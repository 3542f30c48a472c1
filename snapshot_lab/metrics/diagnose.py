"""Everything the diagnostics need, computed once per snapshot and shared by the commands and
the report: timelines, categories, leak suspects and the findings drawn from them."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..frames import SnapshotFrames
from .categories import CategoryBreakdown, compute_categories
from .findings import Finding, compute_findings
from .leaks import LeakAnalysis, find_leaks
from .lifetimes import device_lifetimes
from .summary import SnapshotStats
from .timeline import Timeline, compute_timeline
from .whatif import WHATIF_MAX_EVENTS, WhatIf, analyse_whatif, infer_memory_limit, quick_grid, recorded_settings


@dataclass(frozen=True)
class Diagnosis:
    timelines: dict[int, Timeline | None]
    categories: dict[int, CategoryBreakdown]
    leaks: dict[int, LeakAnalysis]
    findings: list[Finding]
    lifetimes: dict[int, pd.DataFrame]
    whatifs: dict[int, WhatIf]


def diagnose(frames: SnapshotFrames, stats: SnapshotStats, with_category_timelines: bool = True) -> Diagnosis:
    timelines: dict[int, Timeline | None] = {}
    categories: dict[int, CategoryBreakdown] = {}
    leaks: dict[int, LeakAnalysis] = {}
    lifetimes: dict[int, pd.DataFrame] = {}
    for dev, d in stats.devices.items():
        lifetimes[dev] = device_lifetimes(frames, dev)
        timelines[dev] = compute_timeline(
            frames.events,
            dev,
            d.torch_stats["requested_bytes.all.current"],
            d.torch_stats["reserved_bytes.all.current"],
            frames.annotations,
        )
        categories[dev] = compute_categories(frames, dev, with_timeline=with_category_timelines)
        leaks[dev] = find_leaks(frames, dev, lifetimes[dev])
    whatifs = _whatifs(frames, stats, timelines)
    findings = compute_findings(stats, frames.events, timelines, categories, leaks, whatifs)
    return Diagnosis(timelines, categories, leaks, findings, lifetimes, whatifs)


def _whatifs(frames: SnapshotFrames, stats: SnapshotStats, timelines: dict[int, Timeline | None]) -> dict[int, WhatIf]:
    """Replay the grid of alternative settings for traces small enough to do it on the way
    (the full sweep is ``snaplab whatif``)."""
    out = {}
    base = recorded_settings(frames.info.allocator_settings)
    for i, dev in enumerate(stats.devices):
        rec = stats.recording.devices[i]
        tl = timelines.get(dev)
        if tl is None or not rec.history_complete or tl.n_events > WHATIF_MAX_EVENTS:
            continue
        if frames.segments.loc[frames.segments["device"] == dev, "is_private_pool"].any():
            continue  # private pools are not modelled: no advice from an approximate replay
        limit, source = infer_memory_limit(frames, dev, tl.peak_reserved_bytes)
        if source.startswith("inferred"):
            continue  # an OOM under an unknown per-process cap: no claim about what would avoid it
        out[dev] = analyse_whatif(frames, dev, [base, *quick_grid(base, limit)], limit, True)
    return out
