"""Plain-text rendering for the terminal (``snaplab stats`` without ``--json``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..metrics import SnapshotStats
from ..metrics.allocator.whatif import START_STEADY, ScenarioResult, WhatIf, settings_label
from ..metrics.attribution.annotations import AnnotatedAllocation
from ..metrics.attribution.modules import ModuleBreakdown
from ..metrics.findings import Finding, FleetFindings
from ..metrics.leaks import STATE_SOURCE, LeakAnalysis
from ..metrics.stats.host import HostMemory
from ..metrics.stats.summary import DeviceStats
from ..units import format_bytes, format_percent

_POOLS = (("all", "all"), ("large_pool", "large"), ("small_pool", "small"))


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for j, row in enumerate([header, *rows]):
        cells = [str(cell).ljust(widths[i]) if i == 0 else str(cell).rjust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_modules(m: ModuleBreakdown, limit: int = 12) -> str:
    """The modules holding the most bytes at the peak (self bytes), and the totals' other rows."""
    head = f"memory by module at the peak ({format_bytes(m.peak_bytes)} requested, event {m.peak_index:,}): " + (
        "from module tags" if m.source == "tags" else "APPROXIMATE. " + m.note
    )
    body = [
        [
            row.label,
            format_bytes(row.self_bytes),
            format_bytes(row.inclusive_bytes) if m.source == "tags" else "",
            format_bytes(row.by_phase.get("fwd", 0)),
            format_bytes(row.by_phase.get("bwd", 0)),
            format_bytes(row.by_phase.get("rec", 0)),
            format_bytes(row.peak_bytes),
        ]
        for row in m.largest(limit)
    ]
    body.append(["<outside any module>", format_bytes(m.outside_bytes), "", "", "", "", ""])
    if m.before_trace_bytes:
        body.append(["<allocated before the trace>", format_bytes(m.before_trace_bytes), "", "", "", "", ""])
    cols = ["module", "self at peak", "with children", "forward", "backward", "recomputed", "own peak"]
    return head + "\n" + table(cols, body)


def _device_text(device_stats: DeviceStats) -> str:
    torch_stats = device_stats.torch_stats
    rows = []
    for name in ("reserved_bytes", "allocated_bytes", "active_bytes", "requested_bytes", "inactive_split_bytes"):
        rows.append([name] + [format_bytes(torch_stats[f"{name}.{pool}.current"]) for pool, _ in _POOLS])
    for name in ("segment", "allocation", "active", "inactive_split"):
        rows.append([name] + [str(torch_stats[f"{name}.{pool}.current"]) for pool, _ in _POOLS])
    out = [table(["counter (.current)", "all", "large pool", "small pool"], rows)]
    by_pool = device_stats.fragmentation
    frows = [
        ["fragmentation (stranded share)"] + [format_percent(by_pool[pool].stranded_share) for pool, _ in _POOLS],
        ["stranded (holes beside live blocks)"] + [format_bytes(by_pool[pool].stranded_bytes) for pool, _ in _POOLS],
        ["cached, releasable (empty_cache)"]
        + [format_bytes(by_pool[pool].cached_releasable_bytes) for pool, _ in _POOLS],
        ["free in reserved"] + [format_bytes(by_pool[pool].free_bytes) for pool, _ in _POOLS],
        ["largest free block"] + [format_bytes(by_pool[pool].largest_free_block_bytes) for pool, _ in _POOLS],
        ["external fragmentation"] + [format_percent(by_pool[pool].external_fragmentation) for pool, _ in _POOLS],
        ["internal waste (rounding)"] + [format_bytes(by_pool[pool].internal_waste_bytes) for pool, _ in _POOLS],
    ]
    whole = by_pool["all"]
    out.append("")
    out.append(
        f"fragmentation: {format_percent(whole.stranded_share)} of reserved memory is stranded "
        f"({format_bytes(whole.stranded_bytes)} in holes of segments that still hold live blocks); "
        f"{format_bytes(whole.cached_releasable_bytes)} is cached in whole free segments, reusable by any request "
        "and released by empty_cache()"
    )
    out.append("")
    out.append(table(["fragmentation", "all", "large pool", "small pool"], frows))
    if device_stats.private_pool_reserved_bytes or device_stats.expandable_reserved_bytes:
        out.append("")
        if device_stats.private_pool_reserved_bytes:
            out.append(
                "private pools (CUDA graphs, MemPool): "
                f"{format_bytes(device_stats.private_pool_reserved_bytes)} reserved"
            )
        if device_stats.expandable_reserved_bytes:
            out.append(f"expandable segments: {format_bytes(device_stats.expandable_reserved_bytes)} mapped")
    if device_stats.modules is not None and device_stats.modules.source != "none":
        out.append("")
        out.append(format_modules(device_stats.modules))
    if device_stats.oom:
        oom = device_stats.oom
        out.append("")
        out.append(
            f"OUT OF MEMORY ({oom.cause}): a request of {format_bytes(oom.requested_bytes)} "
            f"from the {oom.pool} pool failed; "
            f"{format_bytes(oom.free_in_reserved_bytes)} was free in reserved memory, largest free block "
            f"{format_bytes(oom.largest_free_block_bytes)}; CUDA reported {format_bytes(oom.device_free_bytes)} free"
            + ("" if oom.snapshot_at_oom else " (layout from a later dump; approximate)")
        )
    return "\n".join(out)


def format_stats(s: SnapshotStats) -> str:
    file_info = s.file
    rec = s.recording
    head = [
        f"{file_info['path']}  ({format_bytes(file_info['file_size_bytes'])}"
        + (f", {file_info['compression']}" if file_info["compression"] else "")
        + f"; {file_info['segments']} segments, {file_info['blocks']} blocks, "
        f"{file_info['trace_entries']} trace entries)",
        f"recording: {rec.mode}, stacks: {rec.stacks}"
        + (
            ""
            if rec.history_complete or rec.mode != "trace"
            else f"; early history missing ({rec.missing_history_cause})"
        ),
    ]
    if file_info.get("backend"):
        head.append(f"backend: {file_info['backend']} (as the file names it)")
    parts = ["\n".join(head)]
    for device, device_stats in s.devices.items():
        parts.append(f"== device {device}\n" + _device_text(device_stats))
    if s.host is not None:
        parts.append(format_host(s.host))
    elif not s.devices:
        parts.append("(no segments: nothing was reserved on any device)")
    if s.annotations:  # only files with annotate entries (_annotate_tensor)
        parts.append(format_annotations(s.annotations))
    if s.stages is not None:  # only when asked for (stats --stages)
        from .stages import format_stages

        parts.append(format_stages(s.stages).rstrip("\n"))
    if s.compiled_regions is not None:  # only when asked for (stats --compiled-regions)
        from .compiled import format_compiled_regions

        parts.append(format_compiled_regions(s.compiled_regions).rstrip("\n"))
    if s.category_rules is not None:  # only when asked for (stats --category)
        parts.append(format_categories(s))
    return "\n\n".join(parts) + "\n"


def format_categories(s: SnapshotStats) -> str:
    """Bytes by category at the dump (all devices) and at each device's peak, the user's rules
    first: every category with bytes, the built-in ones then the user's."""
    peaks = [ds.categories_at_peak for ds in s.devices.values() if ds.categories_at_peak is not None]
    total = sum(s.categories.values()) or 1
    rows = [
        [
            name,
            format_bytes(nbytes),
            format_percent(nbytes / total),
            format_bytes((s.categories_requested or {}).get(name, 0)),
            format_bytes(sum(peak.get(name, 0) for peak in peaks)) if peaks else "",
        ]
        for name, nbytes in s.categories.items()
        if nbytes or any(peak.get(name, 0) for peak in peaks)
    ]
    rules = s.category_rules.rules if s.category_rules is not None else ()
    head = "categories, your rules first (the first that matches an allocation's stack wins): " + "; ".join(
        rule.spec for rule in rules
    )
    return head + "\n" + table(["category", "allocated", "share", "requested", "at the peak"], rows)


MAX_ANNOTATION_ROWS = 20  # annotated allocations printed; --json has them all


def format_annotations(annotated: list[AnnotatedAllocation]) -> str:
    """The annotated allocations (torch >= 2.14's ``_annotate_tensor``): each allocation's size,
    site and annotation, on one line each."""
    rows = [
        [
            str(item.device),
            format_bytes(item.size_bytes) if item.size_bytes is not None else "?",
            item.site,
            " ".join(item.annotation.split())[:120],
        ]
        for item in annotated[:MAX_ANNOTATION_ROWS]
    ]
    more = len(annotated) - MAX_ANNOTATION_ROWS
    tail = f"\n  ... {more} more (--json has them all)" if more > 0 else ""
    head = f"== annotated allocations ({len(annotated)})\n"
    return head + table(["device", "size", "allocation site", "annotation"], rows) + tail


def format_host(host: HostMemory) -> str:
    """Pinned host memory's lines (torch >= 2.14), printed beside the devices'."""
    out = [
        f"== pinned host memory: {format_bytes(host.reserved_bytes)} reserved in {host.segments} blocks, "
        f"{format_bytes(host.allocated_bytes)} allocated, {format_bytes(host.pending_free_bytes)} awaiting free, "
        f"{format_bytes(host.cached_bytes)} cached"
    ]
    if host.private_pool_bytes:
        out.append(f"in private pools: {format_bytes(host.private_pool_bytes)}")
    if host.peak_allocated_in_trace_bytes is not None:
        out.append(f"peak allocated over {host.events} host events: {format_bytes(host.peak_allocated_in_trace_bytes)}")
    for site in host.sites:
        out.append(f"  {format_bytes(site.allocated_bytes):>10}  {site.blocks:>4} blocks  {site.frame}")
    return "\n".join(out)


def format_leaks(result: dict[int, LeakAnalysis]) -> str:
    parts = []
    for dev, leaks in result.items():
        head = f"== device {dev}: "
        if leaks.note and not leaks.suspects:
            parts.append(head + leaks.note)
            continue
        if leaks.iteration_source == STATE_SOURCE:
            parts.append(head + _state_only_suspects(leaks))
            continue
        head += f"{leaks.iterations} iterations (from {leaks.iteration_source}: {leaks.iteration_label})"
        if not leaks.suspects:
            parts.append(head + "\nno leak suspects: no allocation site keeps growing across iterations")
            continue
        rows = [
            [
                suspect.site,
                format_bytes(suspect.growth_bytes_per_iteration),
                f"{suspect.iterations_growing}/{suspect.iterations_considered}",
                format_bytes(suspect.bytes),
                str(suspect.count),
                f"{suspect.confidence:.2f}",
            ]
            for suspect in leaks.suspects
        ]
        parts.append(
            head
            + f"\nmemory grows by {format_bytes(leaks.growth_bytes_per_iteration)} per iteration\n"
            + table(["site (allocation line)", "growth/iter", "iters", "live now", "blocks", "confidence"], rows)
        )
    return "\n\n".join(parts) + "\n"


def _state_only_suspects(leaks: LeakAnalysis) -> str:
    """A state-only snapshot has no iterations: say what one site holds, not growth per iteration."""
    rows = [
        [suspect.site, format_bytes(suspect.bytes), f"{suspect.count:,}", f"{suspect.confidence:.2f}"]
        for suspect in leaks.suspects
    ]
    return f"{leaks.note or 'no allocation history'}; leak suspects from {STATE_SOURCE}\n" + table(
        ["site (allocation line)", "live now", "blocks", "confidence"], rows
    )


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "No findings: no OOM, no leak, no notable fragmentation or allocator churn.\n"
    out = []
    for finding in findings:
        dev = f" [device {finding.device}]" if finding.device is not None else ""
        lines = [
            f"{finding.severity.upper():8s} {finding.id}{dev}: {finding.title}",
            f"         advice: {finding.advice}",
        ]
        if finding.savings_bytes:
            lines.append(f"         at stake: {format_bytes(finding.savings_bytes)}")
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


def _whatif_row(scenario: ScenarioResult, prefix: str) -> dict[str, Any]:
    """One scenario's display strings; a row replayed from a steady state (a trace that starts
    mid-run) is marked, and a max_split_size_mb row there as a lower bound (the steady state
    does not see the segments earlier steps kept at their own sizes)."""
    first = scenario.ooms[0] if scenario.ooms else None
    oom = "no" if first is None else f"at event {first['event_index']:,} ({format_bytes(first['requested_bytes'])})"
    steady = scenario.start == START_STEADY
    lower_bound = steady and bool(scenario.settings.get("max_split_size_mb"))
    if prefix == BASELINE_LABEL:
        mark = LOWER_BOUND_MARK if lower_bound else ""
    elif steady:
        mark = STEADY_LOWER_BOUND_MARK if lower_bound else STEADY_MARK
    else:
        mark = ""
    return {
        "settings": prefix + settings_label(scenario.settings) + mark,
        "steady": steady,
        "baseline": prefix == BASELINE_LABEL,
        "peak": format_bytes(scenario.peak_reserved_bytes),
        "final": format_bytes(scenario.final_reserved_bytes),
        "mallocs": f"{scenario.cuda_malloc_calls:,}",
        "retries": f"{scenario.alloc_retries:,}",
        "oom": oom,
    }


def whatif_view(w: WhatIf) -> dict[str, Any]:
    """The what-if result as display strings (shared by the terminal and the HTML report). On a
    trace that starts mid-run, the recorded settings replayed from the steady state follow the
    recorded row, so the rows replayed from a steady state compare like for like."""
    rows = [_whatif_row(scenario, "as recorded: " if i == 0 else "") for i, scenario in enumerate(w.scenarios)]
    if w.steady_baseline is not None:
        rows.insert(1 if rows else 0, _whatif_row(w.steady_baseline, BASELINE_LABEL))
    check = w.replay_check
    limit = format_bytes(w.memory_limit_bytes) if w.memory_limit_bytes else "unlimited"
    # the limit's own source says how it was inferred, where it says anything: never twice
    if w.memory_limit_bytes and w.memory_limit_inferred and not w.memory_limit_source:
        limit += (
            " (inferred: the snapshot does not record the per-process cap the OOM happened under; the peak "
            "reserved before it stands in)"
        )
    return {
        "rows": rows,
        "check": ("exact" if check.exact else "approximate: " + "; ".join(check.reasons))
        + f"; started from {check.start}",
        "limit": limit,
        "scenario_start": w.scenario_start,
    }


def format_whatif(result: list[WhatIf]) -> str:
    out = []
    for whatif in result:
        view = whatif_view(whatif)
        head = (
            f"== device {whatif.device}: {whatif.events:,} events replayed; memory limit {view['limit']}"
            + (f" ({whatif.memory_limit_source})" if whatif.memory_limit_source else "")
            + f"\nreplay check under the recorded settings: {view['check']}"
            + (f"\n{view['scenario_start']}" if view["scenario_start"] else "")
        )
        rows = [
            [row["settings"], row["peak"], row["final"], row["mallocs"], row["retries"], row["oom"]]
            for row in view["rows"]
        ]
        out.append(
            head + "\n" + table(["settings", "peak reserved", "final reserved", "cudaMalloc", "retries", "OOM"], rows)
        )
    return "\n\n".join(out) + "\n"
