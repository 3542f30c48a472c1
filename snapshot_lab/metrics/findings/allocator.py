"""Allocator settings that would have avoided the OOM or lowered the peak (from the what-if
replay; see :mod:`snapshot_lab.metrics.whatif`)."""

from __future__ import annotations

from ...units import format_bytes
from ..whatif import WhatIf, best_alternative, settings_label
from .base import Finding, FindingContext


def _finding(w: WhatIf) -> Finding | None:
    found = best_alternative(w)
    if found is None:
        return None
    best, why = found
    recorded = w.scenarios[0]
    label = settings_label(best.settings)
    exact = w.replay_check.exact
    saved = recorded.peak_reserved_bytes - best.peak_reserved_bytes
    assumption = ""
    if w.memory_limit_inferred and w.memory_limit_bytes is not None:
        assumption = (
            f" assuming a per-process cap of {format_bytes(w.memory_limit_bytes)} (the snapshot does not record "
            "the cap; this is the peak reserved before the OOM, the smallest cap consistent with the recording)"
        )
    if why == "avoids the OOM":
        title = (
            f"{label} would have served the allocation that failed{assumption}: predicted peak reserved "
            f"{format_bytes(best.peak_reserved_bytes)} up to that point"
            + (f" instead of {format_bytes(recorded.peak_reserved_bytes)}" if saved > 0 else "")
            + " (the trace ends at the OOM, so later steps are not predicted)"
        )
    else:
        title = (
            f"{label} would lower the peak reserved memory to {format_bytes(best.peak_reserved_bytes)} instead of "
            f"{format_bytes(recorded.peak_reserved_bytes)}"
        )
    return Finding(
        id="allocator-settings",
        severity="warning" if why == "avoids the OOM" else "info",
        title=title,
        advice=(
            f"Set PYTORCH_CUDA_ALLOC_CONF={label} in the job's environment (before its first CUDA allocation). "
            "Predicted by replaying this trace through snaplab's model of the caching allocator; the replay of the "
            f"recorded settings reproduced the snapshot {'exactly' if exact else 'approximately'}. "
            "`snaplab whatif` compares more settings."
        ),
        evidence={
            "settings": label,
            "predicted_peak_reserved_bytes": best.peak_reserved_bytes,
            "recorded_peak_reserved_bytes": recorded.peak_reserved_bytes,
            "memory_limit_bytes": w.memory_limit_bytes,
            "memory_limit_inferred": w.memory_limit_inferred,
            "replay_check": "exact" if exact else "approximate",
        },
        savings_bytes=max(saved, 0) or None,
        device=w.device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    return [f for w in ctx.whatifs.values() if (f := _finding(w)) is not None]
