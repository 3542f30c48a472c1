"""Memory that grows every iteration (see :mod:`snapshot_lab.metrics.leaks`)."""

from __future__ import annotations

from ...units import format_bytes
from ..leaks import LeakAnalysis
from .base import Finding, FindingContext


def _finding(la: LeakAnalysis) -> Finding | None:
    if not la.suspects:
        return None
    top = la.suspects[0]
    total = la.growth_bytes_per_iteration
    return Finding(
        id="leak-suspect",
        severity="warning",
        title=(
            f"Memory grows by {format_bytes(total)} every iteration: {len(la.suspects)} allocation "
            f"site{'s' if len(la.suspects) > 1 else ''} never free what they allocate (top: {top.site})"
        ),
        advice=(
            "Tensors allocated at these lines stay alive from one iteration to the next. Typical causes: "
            "appending outputs or losses to a list without .detach()/.item() (which also keeps their autograd "
            "graph and saved activations alive), accumulating `total_loss += loss` instead of `loss.item()`, "
            "or caching tensors in a dict that is never cleared. The job will run out of memory after enough "
            "iterations."
        ),
        evidence={
            "iterations": la.iterations,
            "iterations_from": la.iteration_source,
            "growth_bytes_per_iteration": total,
            "top_site": top.site,
            "top_site_growth_bytes_per_iteration": top.growth_bytes_per_iteration,
            "leaked_bytes_live": sum(s.bytes for s in la.suspects),
        },
        savings_bytes=sum(s.bytes for s in la.suspects),
        device=la.device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    return [f for la in ctx.leaks.values() if (f := _finding(la)) is not None]
