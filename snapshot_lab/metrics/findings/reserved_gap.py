"""Peak reserved far above peak in use: the allocator's cache grew far beyond what the tensors
ever needed at once, and what other settings would have reserved (from the what-if replay; see
:mod:`snapshot_lab.metrics.allocator.whatif`).

The thresholds are set on the real recordings: every run recorded under ``max_split_size_mb``
(64 or 128) on a job whose sizes change from step to step reserves at least 2x its peak in use,
and more than 1 GiB beyond it (``gaptwin_split64``/``split128``: 5.09 / 5.17 GiB for 2.01 GiB,
``twin_split64``: 3.37 for 1.39); the clean runs stay under either bound (``cnn_clean`` 1.7x and
0.6 GiB, ``whatif_default_*`` 1.5x, ``twin_complete`` 1.25x, ``gaptwin_complete`` 1.05x). A
ratio alone would flag tiny runs (``pending_free``: 1.9x of 60 MiB); bytes alone, large jobs'
ordinary cache.

A trace that starts mid-run may begin with a cache that an earlier workload of the process left
(``lightning_fit_*``: the fit finds 1.25 GiB reserved and never uses more than 0.26 GiB). Its gap
is the allocator's own only if the trace's work shows it too: the recorded settings replayed from
a steady state (the what-if's ``steady_baseline``) must reserve at least 1.25x the peak in use
(``gaptwin_split64_wrapped``: 3.26 GiB for 2.01, 1.6x; ``twin_split64_wrapped``: 1.97 for 1.20,
1.6x; ``lightning_fit_end``: 0.29 for 0.26, 1.1x).
"""

from __future__ import annotations

from ...units import format_bytes
from ..allocator.whatif import START_STEADY, WhatIf, settings_label
from ..history.timeline import Timeline
from .base import Finding, FindingContext, MiB

GAP_MIN_BYTES = 1024 * MiB
GAP_MIN_RATIO = 2.0
# a mid-run trace: what its own work reserves under the recorded settings
STEADY_MIN_RATIO = 1.25

TITLE = (
    "Reserved memory peaked at {reserved} for {in_use} of tensors at their peak ({ratio:.1f}x): {gap} of "
    "cache the program never needed at once"
)
ADVICE_SPLIT = (
    "The job ran with max_split_size_mb:{mb}: the allocator never splits a cached block larger than that, and a "
    "request above it takes a cached block only if it is at most max_non_split_rounding_mb (20 MiB by default) "
    "larger, else cudaMallocs a new one of its own size. When tensor sizes change from step to step (variable "
    "sequence lengths, batch shapes), every size ever asked for keeps its own segments. "
)
ADVICE_PLAIN = (
    "The cache grows when freed blocks do not fit the next requests (sizes that change from step to step) and "
    "keeps what it reserved until empty_cache(). "
)
ADVICE_ROWS = "Replayed through snaplab's model of the caching allocator{how}: {rows}. "
ADVICE_NONE = "`snaplab whatif` replays the trace under other settings. "
ADVICE_TAIL = "`snaplab whatif` compares more settings."
DROPS_SPLIT = " without max_split_size_mb"
STEADY_NOTE = (
    " (the trace starts mid-run: other settings replayed from a steady state, and a max_split_size_mb row is a "
    "lower bound)"
)


def _rows(whatif: WhatIf | None) -> list[tuple[str, int]]:
    """Each alternative the what-if replayed without running out: (settings, predicted peak)."""
    if whatif is None or not whatif.scenarios:
        return []
    split = whatif.scenarios[0].settings.get("max_split_size_mb")
    rows = []
    for scenario in whatif.scenarios[1:]:
        if not scenario.ooms:
            drops_split = bool(split) and not scenario.settings.get("max_split_size_mb")
            rows.append(
                (settings_label(scenario.settings) + (DROPS_SPLIT if drops_split else ""), scenario.peak_reserved_bytes)
            )
    return rows


def _advice(whatif: WhatIf | None, rows: list[tuple[str, int]]) -> str:
    recorded = whatif.scenarios[0].settings if whatif is not None and whatif.scenarios else {}
    split_mb = recorded.get("max_split_size_mb")
    text = ADVICE_SPLIT.format(mb=split_mb) if split_mb else ADVICE_PLAIN
    if not rows or whatif is None:
        return text + ADVICE_NONE
    steady = any(scenario.start == START_STEADY for scenario in whatif.scenarios)
    listed = "; ".join(f"{label} {format_bytes(peak)}" for label, peak in sorted(rows, key=lambda row: row[1]))
    return text + ADVICE_ROWS.format(how=STEADY_NOTE if steady else "", rows=listed) + ADVICE_TAIL


def _finding(device: int, timeline: Timeline, whatif: WhatIf | None) -> Finding | None:
    reserved, in_use = timeline.peak_reserved_bytes, timeline.peak_requested_bytes
    gap = reserved - in_use
    if in_use <= 0 or gap < GAP_MIN_BYTES or reserved < GAP_MIN_RATIO * in_use:
        return None
    steady = whatif.steady_baseline if whatif is not None else None
    if steady is not None and steady.peak_reserved_bytes < STEADY_MIN_RATIO * in_use:
        # the cache came before the trace, not from the allocator's handling of its work
        return None
    rows = _rows(whatif)
    best = min((peak for _, peak in rows), default=None)
    return Finding(
        id="reserved-gap",
        severity="warning",
        title=TITLE.format(
            reserved=format_bytes(reserved), in_use=format_bytes(in_use), ratio=reserved / in_use, gap=format_bytes(gap)
        ),
        advice=_advice(whatif, rows),
        evidence={
            "peak_reserved_bytes": reserved,
            "peak_requested_bytes": in_use,
            "gap_bytes": gap,
            "reserved_over_requested": round(reserved / in_use, 3),
            "whatif_peak_reserved_bytes": dict(rows),
            **({"steady_baseline_peak_reserved_bytes": steady.peak_reserved_bytes} if steady is not None else {}),
        },
        savings_bytes=reserved - best if best is not None and best < reserved else None,
        device=device,
    )


def gap_finding(ctx: FindingContext, device: int) -> Finding | None:
    """The reserved-gap finding on ``device``, if the gap is there (high-fragmentation defers to it)."""
    timeline = ctx.timelines.get(device)
    return None if timeline is None else _finding(device, timeline, ctx.whatifs.get(device))


def find(ctx: FindingContext) -> list[Finding]:
    out = []
    for dev in ctx.stats.devices:
        finding = gap_finding(ctx, dev)
        if finding is not None:
            out.append(finding)
    return out
