"""Text and HTML for ``snaplab plan``: the plan beside the recorded run, what the peak is made
of and where each part came from, what was assumed and what is not modelled."""

from __future__ import annotations

from typing import Any

from ..metrics.plan import MemoryPlan, PlanTable, RankPlan

# the report's colours, for HTML bars
from ..plots.palette import CATEGORY_COLORS as COLORS
from ..units import format_bytes
from .html import _css, _environment
from .text import table

MiB = 1 << 20


# headroom without a memory limit (--memory-limit gives one)
NO_LIMIT = "no limit known"


def _fits(rank: RankPlan) -> str:
    if rank.fits is None:
        return "unknown"
    return "yes" if rank.fits else "NO"


def _headroom(rank: RankPlan) -> str:
    if rank.headroom_bytes is not None:
        return format_bytes(rank.headroom_bytes)
    return NO_LIMIT if rank.fits is None else "none"


def _events(first: int, last: int) -> str:
    return f"event {first:,}" if first == last else f"events {first:,}–{last:,}"


def _limit_line(limit: int | None, source: str) -> str:
    if limit is None:
        return "No memory limit known (give --memory-limit to judge the fit)."
    return f"Fits in {format_bytes(limit)} per GPU? ({source}; memory outside the caching allocator not counted.)"


def _rank_rows(plan: MemoryPlan) -> list[list[str]]:
    rec = plan.recorded
    rows = [
        [
            "recorded run (1 GPU, replayed)",
            format_bytes(rec.peak_allocated_bytes),
            format_bytes(rec.peak_reserved_bytes),
            _fits(rec),
            _headroom(rec),
        ]
    ]
    for key, name in (("allocated_bytes.all.peak", "allocated"), ("reserved_bytes.all.peak", "reserved")):
        if key in plan.recorded_torch_peaks:
            rows[0][1 if name == "allocated" else 2] += f" (torch: {format_bytes(plan.recorded_torch_peaks[key])})"
    for rank in plan.ranks:
        rows.append(
            [
                rank.label,
                format_bytes(rank.peak_allocated_bytes),
                format_bytes(rank.peak_reserved_bytes),
                _fits(rank),
                _headroom(rank),
            ]
        )
    return rows


def _where(part: Any) -> str:
    events = _events(part.first_event, part.last_event)
    return f"added at recorded {events}" if not part.recorded_bytes else f"from recorded {events}"


def _parts_text(rank: RankPlan, limit: int = 14) -> str:
    rows = []
    for part in rank.parts[:limit]:
        rows.append(
            [
                part.category,
                format_bytes(part.planned_bytes),
                format_bytes(part.recorded_bytes) if part.recorded_bytes else "added",
                f"{part.rule}: {part.count:,} allocations, {_where(part)}",
            ]
        )
    rest = rank.parts[limit:]
    if rest:
        rows.append(["…", format_bytes(sum(part.planned_bytes for part in rest)), "", f"{len(rest)} smaller kinds"])
    head = ["category", "planned", "recorded", "what, and where in the recorded run it came from"]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(3)]
    lines = []
    for j, row in enumerate([head, *rows]):
        lines.append(
            f"  {row[0].ljust(widths[0])}  {row[1].rjust(widths[1])}  {row[2].rjust(widths[2])}  {row[3]}".rstrip()
        )
        if j == 0:
            lines.append("  " + "  ".join("-" * width for width in widths) + "  " + "-" * len(head[3]))
    return "\n".join(lines)


def format_plan(result: MemoryPlan | PlanTable, name: str = "") -> str:
    if isinstance(result, PlanTable):
        return _format_table(result, name)
    plan = result
    out = [
        f"{plan.strategy.label()} — planned from {name or 'the snapshot'} "
        f"(device {plan.device}, {plan.events:,} events)",
        "",
    ]
    out.append(_limit_line(plan.memory_limit_bytes, plan.memory_limit_source))
    out.append(table(["", "peak allocated", "peak reserved", "fits", "headroom"], _rank_rows(plan)))
    for rank in plan.ranks:
        out.append("")
        out.append(
            f"{rank.label}: peak at {rank.peak_moment or 'the recorded event'} (recorded event {rank.peak_event:,}); "
            "what it is made of, and where it came from:"
        )
        out.append(_parts_text(rank))
        if rank.fits_note:
            out.append(f"  note: {rank.fits_note}")
    out.append("")
    out.append("Assumed (read from the trace, or defaults; see --help to override):")
    out += [f"  - {line}" for line in plan.assumptions]
    out.append("Not modelled:")
    out += [f"  - {line}" for line in plan.not_modelled]
    return "\n".join(out) + "\n"


def _table_rows(plan_table: PlanTable) -> list[list[str]]:
    rows = []
    if plan_table.plans:
        rec = plan_table.plans[0].recorded
        rows.append(
            [
                "recorded run (1 GPU)",
                format_bytes(rec.peak_allocated_bytes),
                format_bytes(rec.peak_reserved_bytes),
                _fits(rec),
                _headroom(rec),
            ]
        )
    for plan in plan_table.plans:
        worst = max(plan.ranks, key=lambda rank: rank.peak_reserved_bytes)
        rows.append(
            [
                plan.strategy.label(),
                format_bytes(plan.peak_allocated_bytes),
                format_bytes(plan.peak_reserved_bytes),
                _fits(worst),
                _headroom(worst),
            ]
        )
    return rows


def _format_table(plan_table: PlanTable, name: str) -> str:
    out = [f"Memory per GPU over {plan_table.world_size} GPUs — planned from {name or 'the snapshot'}", ""]
    if plan_table.plans:
        out.append(_limit_line(plan_table.plans[0].memory_limit_bytes, plan_table.plans[0].memory_limit_source))
    out.append(table(["strategy", "peak allocated", "peak reserved", "fits", "headroom"], _table_rows(plan_table)))
    for label, why in plan_table.skipped.items():
        out.append(f"  {label}: not planned: {why}")
    out.append("")
    out.append("Per rank and per pipeline stage, the worst is shown; snaplab plan SNAP --strategy S for the details.")
    return "\n".join(out) + "\n"


def plan_view(result: MemoryPlan | PlanTable) -> dict[str, Any]:
    """What the HTML templates show (shared by the plan page and the report's "would it fit")."""
    if isinstance(result, PlanTable):
        plans = list(result.plans)
        return {
            "kind": "table",
            "world_size": result.world_size,
            "limit": _limit_line(plans[0].memory_limit_bytes, plans[0].memory_limit_source) if plans else "",
            "rows": _table_rows(result),
            "skipped": result.skipped,
            "plans": [plan_view(plan) for plan in plans],
        }
    plan = result
    biggest = (
        max([plan.recorded.peak_allocated_bytes, *[rank.peak_allocated_bytes for rank in plan.ranks]], default=1) or 1
    )
    ranks = []
    for rank in [plan.recorded, *plan.ranks]:
        bars = [
            # width: percent of the bar cell, the largest peak filling it (one line at any width)
            {
                "category": category,
                "bytes": nbytes,
                "width": round(100 * nbytes / biggest, 2),
                "color": COLORS.get(category, "#999"),
            }
            for category, nbytes in rank.by_category.items()
            if nbytes > 0
        ]
        ranks.append(
            {
                "label": rank.label,
                "allocated": rank.peak_allocated_bytes,
                "reserved": rank.peak_reserved_bytes,
                "fits": _fits(rank),
                "headroom": _headroom(rank),
                "moment": rank.peak_moment,
                "event": rank.peak_event,
                "bars": bars,
                "parts": [
                    {
                        "category": part.category,
                        "what": part.rule,
                        "planned": part.planned_bytes,
                        "recorded": part.recorded_bytes,
                        "count": part.count,
                        "events": _where(part),
                    }
                    for part in rank.parts
                ],
                "note": rank.fits_note,
            }
        )
    return {
        "kind": "plan",
        "label": plan.strategy.label(),
        "limit": _limit_line(plan.memory_limit_bytes, plan.memory_limit_source),
        "ranks": ranks,
        "assumptions": list(plan.assumptions),
        "not_modelled": list(plan.not_modelled),
        "structure": plan.structure,
    }


def render_plan_html(result: MemoryPlan | PlanTable, name: str, version: str) -> str:
    ctx = {"css": _css(), "version": version, "name": name, "view": plan_view(result)}
    return _environment().get_template("plan.html.j2").render(ctx=ctx)
