"""The stage view in words: memory by the user's own ``record_function`` ranges (text), and two
runs' stages side by side (``diff --stages``)."""

from __future__ import annotations

from typing import Any

from ..metrics.comparison.stages import StagesDiff
from ..metrics.history.stages import Stages
from ..units import format_bytes
from .text import table

MAX_TEXT_ROWS = 60  # ranges printed per device; --json has them all


def _flags(flags: tuple[str, ...]) -> str:
    return ", ".join(flags)


def _categories(by_category: dict[str, int]) -> str:
    return ", ".join(f"{c} {format_bytes(b)}" for c, b in sorted(by_category.items(), key=lambda x: -x[1]))


def format_stages(stages: dict[int, Stages]) -> str:
    """One table per device: each range (indented by its depth) with its peak, the levels at its
    start and end, what it allocated and what it kept; then what could not be decided."""
    parts = []
    for device, st in stages.items():
        head = f"== stages of device {device}: {len(st.ranges)} record_function ranges"
        if not st.ranges:
            parts.append(head + "\n" + "\n".join(f"  {n}" for n in st.notes))
            continue
        rows = [
            [
                "  " * r.depth + r.name,
                r.kind,
                format_bytes(r.peak_requested_bytes),
                format_bytes(r.live_at_start_bytes),
                format_bytes(r.live_at_end_bytes),
                format_bytes(r.allocated_bytes),
                format_bytes(r.kept_bytes),
                _categories(r.kept_by_category),
                _flags(r.flags),
            ]
            for r in st.ranges[:MAX_TEXT_ROWS]
        ]
        text = table(
            ["stage", "kind", "peak", "at start", "at end", "allocated", "kept", "kept by category", "flags"], rows
        )
        more = len(st.ranges) - MAX_TEXT_ROWS
        notes = ([f"... {more} more ranges (--json has them all)"] if more > 0 else []) + list(st.notes)
        notes.append(st.threads)
        parts.append(head + "\n" + text + "\n" + "\n".join(f"  {n}" for n in notes))
    return "\n\n".join(parts) + "\n"


def _signed(value: int) -> str:
    return ("+" if value > 0 else "-" if value < 0 else "") + format_bytes(abs(value))


def format_stages_diff(d: StagesDiff) -> str:
    """Stages of two runs by name: the largest peak, allocation and kept bytes of each name."""
    if not d.rows:
        return "== stages: neither run records record_function ranges\n"
    rows = [
        [
            row.name,
            f"{row.count_before}/{row.count_after}",
            format_bytes(row.peak_before) if row.peak_before is not None else "-",
            format_bytes(row.peak_after) if row.peak_after is not None else "-",
            _signed(row.peak_change) if row.peak_change is not None else row.status,
            _signed(row.kept_change) if row.kept_change is not None else "",
        ]
        for row in d.rows
    ]
    text = table(["stage", "ranges (before/after)", "peak before", "peak after", "peak change", "kept change"], rows)
    return f"== stages by name (device {d.device_before} -> {d.device_after})\n" + text + "\n"


MAX_HTML_ROWS = 200  # ranges shown per device in the report


def stages_view(stages: dict[int, Stages]) -> list[dict[str, Any]]:
    """The report's "Memory by stage" section: per device with ranges, its rows and notes (an
    empty list when no device has ranges: the section is left out)."""
    out = []
    for device, st in stages.items():
        if not st.ranges:
            continue
        rows = [
            {
                "name": r.name,
                "kind": r.kind,
                "depth": r.depth,
                "peak": r.peak_requested_bytes,
                "start": r.live_at_start_bytes,
                "end": r.live_at_end_bytes,
                "allocated": r.allocated_bytes,
                "kept": r.kept_bytes,
                "kept_by_category": _categories(r.kept_by_category),
                "flags": _flags(r.flags),
            }
            for r in st.ranges[:MAX_HTML_ROWS]
        ]
        notes = [*st.notes, st.threads]
        out.append({"device": device, "rows": rows, "hidden": max(len(st.ranges) - MAX_HTML_ROWS, 0), "notes": notes})
    return out
