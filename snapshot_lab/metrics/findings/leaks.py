"""Memory that grows every iteration (see :mod:`snapshot_lab.metrics.leaks`)."""

from __future__ import annotations

from ...units import format_bytes
from ..leaks import STATE_SOURCE, LeakAnalysis
from .base import Finding, FindingContext

STATE_TITLE = (
    "{count:,} live blocks of {size} ({total}) all allocated at one line in a forward pass (top: {site}): far "
    "more activations than one forward pass keeps"
)
STATE_ADVICE = (
    "This snapshot has no allocation history, so it cannot show memory growing; it shows the outputs of one "
    "line kept alive many times over, which is how a leak across forward passes looks at one moment (lower "
    "confidence than a trace's growth per iteration). Typical causes: forward hooks that store outputs and are "
    "never removed (keep the handle register_forward_hook returns and call .remove()), outputs appended to a "
    "list or cache that is never cleared, or outputs kept with their autograd graph (use .detach(), or run "
    "inference under torch.inference_mode()). Record a trace (torch.cuda.memory._record_memory_history) to "
    "see the growth per iteration."
)


def _state_only_finding(leaks: LeakAnalysis) -> Finding:
    top = leaks.suspects[0]
    return Finding(
        id="leak-suspect",
        severity="warning",
        title=STATE_TITLE.format(
            count=top.count,
            size=format_bytes(top.bytes // max(top.count, 1)),
            total=format_bytes(top.bytes),
            site=top.site,
        ),
        advice=STATE_ADVICE,
        evidence={
            "iterations": 0,
            "iterations_from": leaks.iteration_source,
            "top_site": top.site,
            "top_site_live_blocks": top.count,
            "top_site_live_bytes": top.bytes,
            "leaked_bytes_live": sum(suspect.bytes for suspect in leaks.suspects),
            "confidence": top.confidence,
        },
        savings_bytes=sum(suspect.bytes for suspect in leaks.suspects),
        device=leaks.device,
    )


def _finding(leaks: LeakAnalysis) -> Finding | None:
    if not leaks.suspects:
        return None
    if leaks.iteration_source == STATE_SOURCE:
        return _state_only_finding(leaks)
    top = leaks.suspects[0]
    total = leaks.growth_bytes_per_iteration
    return Finding(
        id="leak-suspect",
        severity="warning",
        title=(
            f"Memory grows by {format_bytes(total)} every iteration: {len(leaks.suspects)} allocation "
            f"site{'s' if len(leaks.suspects) > 1 else ''} never free what they allocate (top: {top.site})"
        ),
        advice=(
            "Tensors allocated at these lines stay alive from one iteration to the next. Typical causes: "
            "appending outputs or losses to a list without .detach()/.item() (which also keeps their autograd "
            "graph and saved activations alive), accumulating `total_loss += loss` instead of `loss.item()`, "
            "or caching tensors in a dict that is never cleared. The job will run out of memory after enough "
            "iterations."
        ),
        evidence={
            "iterations": leaks.iterations,
            "iterations_from": leaks.iteration_source,
            "growth_bytes_per_iteration": total,
            "top_site": top.site,
            "top_site_growth_bytes_per_iteration": top.growth_bytes_per_iteration,
            "leaked_bytes_live": sum(suspect.bytes for suspect in leaks.suspects),
        },
        savings_bytes=sum(suspect.bytes for suspect in leaks.suspects),
        device=leaks.device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    return [finding for leaks in ctx.leaks.values() if (finding := _finding(leaks)) is not None]
