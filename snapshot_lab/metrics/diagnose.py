"""Everything the diagnostics need, computed once per snapshot and shared by the commands and
the report: timelines, categories, leak suspects and the findings drawn from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pandas as pd

from ..frames import SnapshotFrames
from ._jobs import Spread, in_turn
from .allocator.whatif import WhatIf, analyse_whatif, infer_memory_limit, quick_grid, recorded_settings
from .categories import CategoryBreakdown, compute_categories
from .findings import Finding, compute_findings
from .history.lifetimes import device_lifetimes
from .history.timeline import Timeline, device_timeline
from .leaks import LeakAnalysis, find_leaks
from .stats.summary import SnapshotStats


@dataclass(frozen=True)
class Diagnosis:
    timelines: dict[int, Timeline | None]
    categories: dict[int, CategoryBreakdown]
    leaks: dict[int, LeakAnalysis]
    findings: list[Finding]
    lifetimes: dict[int, pd.DataFrame]
    whatifs: dict[int, WhatIf]


def diagnose(
    frames: SnapshotFrames,
    stats: SnapshotStats,
    with_category_timelines: bool = True,
    whatifs: Callable[[], dict[int, WhatIf]] | None = None,
    spread: Spread = in_turn,
) -> Diagnosis:
    """Timelines, categories, leaks, the what-if and the findings of every device; ``whatifs``
    gives :func:`device_whatifs`'s answer when it was computed elsewhere (the report computes it
    beside the rest), and is asked for only when the findings need it; ``spread``: how the
    what-if's replays are computed otherwise (:mod:`._jobs`)."""
    categories: dict[int, CategoryBreakdown] = {}
    leaks: dict[int, LeakAnalysis] = {}
    lifetimes: dict[int, pd.DataFrame] = {}
    timelines = device_timelines(frames, stats)
    for dev in stats.devices:
        lifetimes[dev] = device_lifetimes(frames, dev)
        categories[dev] = compute_categories(frames, dev, with_timeline=with_category_timelines)
        leaks[dev] = find_leaks(frames, dev, lifetimes[dev])
    replays = whatifs() if whatifs is not None else _whatifs(frames, stats, timelines, spread)
    findings = compute_findings(stats, frames, timelines, categories, leaks, replays)
    return Diagnosis(timelines, categories, leaks, findings, lifetimes, replays)


def device_timelines(frames: SnapshotFrames, stats: SnapshotStats) -> dict[int, Timeline | None]:
    return {
        dev: device_timeline(
            frames, dev, d.torch_stats["requested_bytes.all.current"], d.torch_stats["reserved_bytes.all.current"]
        )
        for dev, d in stats.devices.items()
    }


def device_whatifs(frames: SnapshotFrames, stats: SnapshotStats, spread: Spread = in_turn) -> dict[int, WhatIf]:
    """The what-if replays :func:`diagnose` makes, on their own."""
    return _whatifs(frames, stats, device_timelines(frames, stats), spread)


def _whatifs(
    frames: SnapshotFrames, stats: SnapshotStats, timelines: dict[int, Timeline | None], spread: Spread
) -> dict[int, WhatIf]:
    """Replay a few alternative settings on the way (the full sweep is ``snaplab whatif``), at
    any trace length: a trace that does not start at the start of the job replays from the
    state rebuilt backwards from the dump."""
    out = {}
    base = recorded_settings(frames.info.allocator_settings)
    for dev in stats.devices:
        tl = timelines.get(dev)
        if tl is None:
            continue
        if frames.segments.loc[frames.segments["device"] == dev, "is_private_pool"].any():
            continue  # private pools are not modelled: no advice from an approximate replay
        limit = infer_memory_limit(frames, dev, tl.peak_reserved_bytes)
        w = analyse_whatif(
            frames, dev, [base, *quick_grid(base, limit.bytes, tl.n_events)], limit.bytes, limit.is_cap, spread
        )
        out[dev] = replace(w, memory_limit_source=limit.source, memory_limit_inferred=limit.inferred)
    return out
