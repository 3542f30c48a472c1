"""Memory by compiled region (``stats --compiled-regions``) in words."""

from __future__ import annotations

from ..metrics.history.compiled import CompiledRegion
from ..units import format_bytes
from .text import table


def format_compiled_regions(regions: list[CompiledRegion]) -> str:
    """One table of every compiled region: its device, the allocations made inside it, their
    bytes, the most of them live at once and what was still live at the end of the trace."""
    if not regions:
        return (
            "== compiled regions: none recorded (record with "
            "torch.cuda.memory._record_memory_history(compile_context=True), torch >= 2.8)\n"
        )
    rows = [
        [
            region.compile_context,
            str(region.device),
            f"{region.allocations:,}",
            format_bytes(region.allocated_bytes),
            format_bytes(region.peak_bytes),
            format_bytes(region.live_at_end_bytes),
        ]
        for region in regions
    ]
    text = table(["compiled region", "device", "allocations", "allocated", "peak live", "live at end"], rows)
    return f"== memory by compiled region ({len(regions)})\n" + text + "\n"
