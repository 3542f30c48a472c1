"""Plain-text rendering for the terminal (``snaplab stats`` without ``--json``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..metrics import SnapshotStats
from ..metrics.allocator.whatif import START_STEADY, ScenarioResult, WhatIf, settings_label
from ..metrics.attribution.modules import ModuleBreakdown
from ..metrics.findings import Finding, FleetFindings
from ..metrics.leaks import STATE_SOURCE, LeakAnalysis
from ..metrics.stats.summary import DeviceStats
from ..units import format_bytes, format_percent

_POOLS = (("all", "all"), ("large_pool", "large"), ("small_pool", "small"))


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for j, r in enumerate([header, *rows]):
        cells = [str(c).ljust(widths[i]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_modules(m: ModuleBreakdown, limit: int = 12) -> str:
    """The modules holding the most bytes at the peak (self bytes), and the totals' other rows."""
    head = f"memory by module at the peak ({format_bytes(m.peak_bytes)} requested, event {m.peak_index:,}): " + (
        "from module tags" if m.source == "tags" else "APPROXIMATE. " + m.note
    )
    body = [
        [
            r.label,
            format_bytes(r.self_bytes),
            format_bytes(r.inclusive_bytes) if m.source == "tags" else "",
            format_bytes(r.by_phase.get("fwd", 0)),
            format_bytes(r.by_phase.get("bwd", 0)),
            format_bytes(r.by_phase.get("rec", 0)),
            format_bytes(r.peak_bytes),
        ]
        for r in m.largest(limit)
    ]
    body.append(["<outside any module>", format_bytes(m.outside_bytes), "", "", "", "", ""])
    if m.before_trace_bytes:
        body.append(["<allocated before the trace>", format_bytes(m.before_trace_bytes), "", "", "", "", ""])
    cols = ["module", "self at peak", "with children", "forward", "backward", "recomputed", "own peak"]
    return head + "\n" + table(cols, body)


def _device_text(d: DeviceStats) -> str:
    ts = d.torch_stats
    rows = []
    for name in ("reserved_bytes", "allocated_bytes", "active_bytes", "requested_bytes", "inactive_split_bytes"):
        rows.append([name] + [format_bytes(ts[f"{name}.{k}.current"]) for k, _ in _POOLS])
    for name in ("segment", "allocation", "active", "inactive_split"):
        rows.append([name] + [str(ts[f"{name}.{k}.current"]) for k, _ in _POOLS])
    out = [table(["counter (.current)", "all", "large pool", "small pool"], rows)]
    fr = d.fragmentation
    frows = [
        ["fragmentation (stranded share)"] + [format_percent(fr[k].stranded_share) for k, _ in _POOLS],
        ["stranded (holes beside live blocks)"] + [format_bytes(fr[k].stranded_bytes) for k, _ in _POOLS],
        ["cached, releasable (empty_cache)"] + [format_bytes(fr[k].cached_releasable_bytes) for k, _ in _POOLS],
        ["free in reserved"] + [format_bytes(fr[k].free_bytes) for k, _ in _POOLS],
        ["largest free block"] + [format_bytes(fr[k].largest_free_block_bytes) for k, _ in _POOLS],
        ["external fragmentation"] + [format_percent(fr[k].external_fragmentation) for k, _ in _POOLS],
        ["internal waste (rounding)"] + [format_bytes(fr[k].internal_waste_bytes) for k, _ in _POOLS],
    ]
    a = fr["all"]
    out.append("")
    out.append(
        f"fragmentation: {format_percent(a.stranded_share)} of reserved memory is stranded "
        f"({format_bytes(a.stranded_bytes)} in holes of segments that still hold live blocks); "
        f"{format_bytes(a.cached_releasable_bytes)} is cached in whole free segments, reusable by any request "
        "and released by empty_cache()"
    )
    out.append("")
    out.append(table(["fragmentation", "all", "large pool", "small pool"], frows))
    if d.private_pool_reserved_bytes or d.expandable_reserved_bytes:
        out.append("")
        if d.private_pool_reserved_bytes:
            out.append(f"private pools (CUDA graphs, MemPool): {format_bytes(d.private_pool_reserved_bytes)} reserved")
        if d.expandable_reserved_bytes:
            out.append(f"expandable segments: {format_bytes(d.expandable_reserved_bytes)} mapped")
    if d.modules is not None and d.modules.source != "none":
        out.append("")
        out.append(format_modules(d.modules))
    if d.oom:
        o = d.oom
        out.append("")
        out.append(
            f"OUT OF MEMORY ({o.cause}): a request of {format_bytes(o.requested_bytes)} from the {o.pool} pool failed; "
            f"{format_bytes(o.free_in_reserved_bytes)} was free in reserved memory, largest free block "
            f"{format_bytes(o.largest_free_block_bytes)}; CUDA reported {format_bytes(o.device_free_bytes)} free"
            + ("" if o.snapshot_at_oom else " (layout from a later dump; approximate)")
        )
    return "\n".join(out)


def format_stats(s: SnapshotStats) -> str:
    f = s.file
    rec = s.recording
    head = [
        f"{f['path']}  ({format_bytes(f['file_size_bytes'])}"
        + (f", {f['compression']}" if f["compression"] else "")
        + f"; {f['segments']} segments, {f['blocks']} blocks, {f['trace_entries']} trace entries)",
        f"recording: {rec.mode}, stacks: {rec.stacks}"
        + (
            ""
            if rec.history_complete or rec.mode != "trace"
            else "; early history missing (ring buffer wrapped or recording started late)"
        ),
    ]
    parts = ["\n".join(head)]
    for d, ds in s.devices.items():
        parts.append(f"== device {d}\n" + _device_text(ds))
    if not s.devices:
        parts.append("(no segments: nothing was reserved on any device)")
    return "\n\n".join(parts) + "\n"


def format_leaks(result: dict[int, LeakAnalysis]) -> str:
    parts = []
    for dev, la in result.items():
        head = f"== device {dev}: "
        if la.note and not la.suspects:
            parts.append(head + la.note)
            continue
        if la.iteration_source == STATE_SOURCE:
            parts.append(head + _state_only_suspects(la))
            continue
        head += f"{la.iterations} iterations (from {la.iteration_source}: {la.iteration_label})"
        if not la.suspects:
            parts.append(head + "\nno leak suspects: no allocation site keeps growing across iterations")
            continue
        rows = [
            [
                s.site,
                format_bytes(s.growth_bytes_per_iteration),
                f"{s.iterations_growing}/{s.iterations_considered}",
                format_bytes(s.bytes),
                str(s.count),
                f"{s.confidence:.2f}",
            ]
            for s in la.suspects
        ]
        parts.append(
            head
            + f"\nmemory grows by {format_bytes(la.growth_bytes_per_iteration)} per iteration\n"
            + table(["site (allocation line)", "growth/iter", "iters", "live now", "blocks", "confidence"], rows)
        )
    return "\n\n".join(parts) + "\n"


def _state_only_suspects(la: LeakAnalysis) -> str:
    """A state-only snapshot has no iterations: say what one site holds, not growth per iteration."""
    rows = [[s.site, format_bytes(s.bytes), f"{s.count:,}", f"{s.confidence:.2f}"] for s in la.suspects]
    return f"{la.note or 'no allocation history'}; leak suspects from {STATE_SOURCE}\n" + table(
        ["site (allocation line)", "live now", "blocks", "confidence"], rows
    )


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "No findings: no OOM, no leak, no notable fragmentation or allocator churn.\n"
    out = []
    for f in findings:
        dev = f" [device {f.device}]" if f.device is not None else ""
        lines = [f"{f.severity.upper():8s} {f.id}{dev}: {f.title}", f"         advice: {f.advice}"]
        if f.savings_bytes:
            lines.append(f"         at stake: {format_bytes(f.savings_bytes)}")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def format_fleet_findings(result: FleetFindings) -> str:
    """``findings`` over several files: those across the files, then each file's."""
    out = []
    if result.across_files:
        out.append(f"== across the {len(result.files)} files\n{format_findings(result.across_files)}")
    for path, found in result.files.items():
        out.append(f"== {path}\n{format_findings(found)}")
    return "\n".join(out)


STEADY_MARK = " (steady state)"
STEADY_LOWER_BOUND_MARK = " (steady state; a lower bound)"
LOWER_BOUND_MARK = " (a lower bound)"
BASELINE_LABEL = "as recorded, from the same steady state: "


def _whatif_row(sc: ScenarioResult, prefix: str) -> dict[str, Any]:
    """One scenario's display strings; a row replayed from a steady state (a trace that starts
    mid-run) is marked, and a max_split_size_mb row there as a lower bound (the steady state
    does not see the segments earlier steps kept at their own sizes)."""
    first = sc.ooms[0] if sc.ooms else None
    oom = "no" if first is None else f"at event {first['event_index']:,} ({format_bytes(first['requested_bytes'])})"
    steady = sc.start == START_STEADY
    lower_bound = steady and bool(sc.settings.get("max_split_size_mb"))
    if prefix == BASELINE_LABEL:
        mark = LOWER_BOUND_MARK if lower_bound else ""
    elif steady:
        mark = STEADY_LOWER_BOUND_MARK if lower_bound else STEADY_MARK
    else:
        mark = ""
    return {
        "settings": prefix + settings_label(sc.settings) + mark,
        "steady": steady,
        "baseline": prefix == BASELINE_LABEL,
        "peak": format_bytes(sc.peak_reserved_bytes),
        "final": format_bytes(sc.final_reserved_bytes),
        "mallocs": f"{sc.cuda_malloc_calls:,}",
        "retries": f"{sc.alloc_retries:,}",
        "oom": oom,
    }


def whatif_view(w: WhatIf) -> dict[str, Any]:
    """The what-if result as display strings (shared by the terminal and the HTML report). On a
    trace that starts mid-run, the recorded settings replayed from the steady state follow the
    recorded row, so the rows replayed from a steady state compare like for like."""
    rows = [_whatif_row(sc, "as recorded: " if i == 0 else "") for i, sc in enumerate(w.scenarios)]
    if w.steady_baseline is not None:
        rows.insert(1 if rows else 0, _whatif_row(w.steady_baseline, BASELINE_LABEL))
    c = w.replay_check
    limit = format_bytes(w.memory_limit_bytes) if w.memory_limit_bytes else "unlimited"
    # the limit's own source says how it was inferred, where it says anything: never twice
    if w.memory_limit_bytes and w.memory_limit_inferred and not w.memory_limit_source:
        limit += (
            " (inferred: the snapshot does not record the per-process cap the OOM happened under; the peak "
            "reserved before it stands in)"
        )
    return {
        "rows": rows,
        "check": ("exact" if c.exact else "approximate: " + "; ".join(c.reasons)) + f"; started from {c.start}",
        "limit": limit,
        "scenario_start": w.scenario_start,
    }


def format_whatif(result: list[WhatIf]) -> str:
    out = []
    for w in result:
        v = whatif_view(w)
        head = (
            f"== device {w.device}: {w.events:,} events replayed; memory limit {v['limit']}"
            + (f" ({w.memory_limit_source})" if w.memory_limit_source else "")
            + f"\nreplay check under the recorded settings: {v['check']}"
            + (f"\n{v['scenario_start']}" if v["scenario_start"] else "")
        )
        rows = [[r["settings"], r["peak"], r["final"], r["mallocs"], r["retries"], r["oom"]] for r in v["rows"]]
        out.append(
            head + "\n" + table(["settings", "peak reserved", "final reserved", "cudaMalloc", "retries", "OOM"], rows)
        )
    return "\n\n".join(out) + "\n"
