"""Text and HTML for ``snaplab plan``: the plan beside the recorded run, what the peak is made
of and where each part came from, what was assumed and what is not modelled."""

from __future__ import annotations

from typing import Any

from ..metrics.plan import MemoryPlan, PlanTable, RankPlan
from ..plots.palette import CATEGORY_COLORS as COLORS  # the report's colours, for HTML bars
from ..units import format_bytes
from .html import _css, _environment
from .text import table

MiB = 1 << 20


NO_LIMIT = "no limit known"  # headroom without a memory limit (--memory-limit gives one)


def _fits(r: RankPlan) -> str:
    if r.fits is None:
        return "unknown"
    return "yes" if r.fits else "NO"


def _headroom(r: RankPlan) -> str:
    if r.headroom_bytes is not None:
        return format_bytes(r.headroom_bytes)
    return NO_LIMIT if r.fits is None else "none"


def _events(first: int, last: int) -> str:
    return f"event {first:,}" if first == last else f"events {first:,}–{last:,}"


def _limit_line(limit: int | None, source: str) -> str:
    if limit is None:
        return "No memory limit known (give --memory-limit to judge the fit)."
    return f"Fits in {format_bytes(limit)} per GPU? ({source}; memory outside the caching allocator not counted.)"


def _rank_rows(p: MemoryPlan) -> list[list[str]]:
    rec = p.recorded
    rows = [
        [
            "recorded run (1 GPU, replayed)",
            format_bytes(rec.peak_allocated_bytes),
            format_bytes(rec.peak_reserved_bytes),
            _fits(rec),
            _headroom(rec),
        ]
    ]
    for k, name in (("allocated_bytes.all.peak", "allocated"), ("reserved_bytes.all.peak", "reserved")):
        if k in p.recorded_torch_peaks:
            rows[0][1 if name == "allocated" else 2] += f" (torch: {format_bytes(p.recorded_torch_peaks[k])})"
    for r in p.ranks:
        rows.append(
            [r.label, format_bytes(r.peak_allocated_bytes), format_bytes(r.peak_reserved_bytes), _fits(r), _headroom(r)]
        )
    return rows


def _where(part: Any) -> str:
    ev = _events(part.first_event, part.last_event)
    return f"added at recorded {ev}" if not part.recorded_bytes else f"from recorded {ev}"


def _parts_text(r: RankPlan, limit: int = 14) -> str:
    rows = []
    for part in r.parts[:limit]:
        rows.append(
            [
                part.category,
                format_bytes(part.planned_bytes),
                format_bytes(part.recorded_bytes) if part.recorded_bytes else "added",
                f"{part.rule}: {part.count:,} allocations, {_where(part)}",
            ]
        )
    rest = r.parts[limit:]
    if rest:
        rows.append(["…", format_bytes(sum(x.planned_bytes for x in rest)), "", f"{len(rest)} smaller kinds"])
    head = ["category", "planned", "recorded", "what, and where in the recorded run it came from"]
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(3)]
    lines = []
    for j, x in enumerate([head, *rows]):
        lines.append(f"  {x[0].ljust(widths[0])}  {x[1].rjust(widths[1])}  {x[2].rjust(widths[2])}  {x[3]}".rstrip())
        if j == 0:
            lines.append("  " + "  ".join("-" * w for w in widths) + "  " + "-" * len(head[3]))
    return "\n".join(lines)


def format_plan(result: MemoryPlan | PlanTable, name: str = "") -> str:
    if isinstance(result, PlanTable):
        return _format_table(result, name)
    p = result
    out = [f"{p.strategy.label()} — planned from {name or 'the snapshot'} (device {p.device}, {p.events:,} events)", ""]
    out.append(_limit_line(p.memory_limit_bytes, p.memory_limit_source))
    out.append(table(["", "peak allocated", "peak reserved", "fits", "headroom"], _rank_rows(p)))
    for r in p.ranks:
        out.append("")
        out.append(
            f"{r.label}: peak at {r.peak_moment or 'the recorded event'} (recorded event {r.peak_event:,}); "
            "what it is made of, and where it came from:"
        )
        out.append(_parts_text(r))
        if r.fits_note:
            out.append(f"  note: {r.fits_note}")
    out.append("")
    out.append("Assumed (read from the trace, or defaults; see --help to override):")
    out += [f"  - {a}" for a in p.assumptions]
    out.append("Not modelled:")
    out += [f"  - {a}" for a in p.not_modelled]
    return "\n".join(out) + "\n"


def _table_rows(t: PlanTable) -> list[list[str]]:
    rows = []
    if t.plans:
        rec = t.plans[0].recorded
        rows.append(
            [
                "recorded run (1 GPU)",
                format_bytes(rec.peak_allocated_bytes),
                format_bytes(rec.peak_reserved_bytes),
                _fits(rec),
                _headroom(rec),
            ]
        )
    for p in t.plans:
        worst = max(p.ranks, key=lambda r: r.peak_reserved_bytes)
        rows.append(
            [
                p.strategy.label(),
                format_bytes(p.peak_allocated_bytes),
                format_bytes(p.peak_reserved_bytes),
                _fits(worst),
                _headroom(worst),
            ]
        )
    return rows


def _format_table(t: PlanTable, name: str) -> str:
    out = [f"Memory per GPU over {t.world_size} GPUs — planned from {name or 'the snapshot'}", ""]
    if t.plans:
        out.append(_limit_line(t.plans[0].memory_limit_bytes, t.plans[0].memory_limit_source))
    out.append(table(["strategy", "peak allocated", "peak reserved", "fits", "headroom"], _table_rows(t)))
    for label, why in t.skipped.items():
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
            "plans": [plan_view(p) for p in plans],
        }
    p = result
    biggest = max([p.recorded.peak_allocated_bytes, *[r.peak_allocated_bytes for r in p.ranks]], default=1) or 1
    ranks = []
    for r in [p.recorded, *p.ranks]:
        bars = [
            # width: percent of the bar cell, the largest peak filling it (one line at any width)
            {"category": c, "bytes": b, "width": round(100 * b / biggest, 2), "color": COLORS.get(c, "#999")}
            for c, b in r.by_category.items()
            if b > 0
        ]
        ranks.append(
            {
                "label": r.label,
                "allocated": r.peak_allocated_bytes,
                "reserved": r.peak_reserved_bytes,
                "fits": _fits(r),
                "headroom": _headroom(r),
                "moment": r.peak_moment,
                "event": r.peak_event,
                "bars": bars,
                "parts": [
                    {
                        "category": x.category,
                        "what": x.rule,
                        "planned": x.planned_bytes,
                        "recorded": x.recorded_bytes,
                        "count": x.count,
                        "events": _where(x),
                    }
                    for x in r.parts
                ],
                "note": r.fits_note,
            }
        )
    return {
        "kind": "plan",
        "label": p.strategy.label(),
        "limit": _limit_line(p.memory_limit_bytes, p.memory_limit_source),
        "ranks": ranks,
        "assumptions": list(p.assumptions),
        "not_modelled": list(p.not_modelled),
        "structure": p.structure,
    }


def render_plan_html(result: MemoryPlan | PlanTable, name: str, version: str) -> str:
    ctx = {"css": _css(), "version": version, "name": name, "view": plan_view(result)}
    return _environment().get_template("plan.html.j2").render(ctx=ctx)
