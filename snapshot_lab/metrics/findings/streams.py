"""Blocks freed by tensors but still held for work on another stream (``record_stream``)."""

from __future__ import annotations

from ...units import format_bytes
from .base import Finding, FindingContext


def find(ctx: FindingContext) -> list[Finding]:
    out = []
    for dev, device_stats in ctx.stats.devices.items():
        pending = (
            device_stats.torch_stats["active_bytes.all.current"]
            - device_stats.torch_stats["allocated_bytes.all.current"]
        )
        if not pending:
            continue
        out.append(
            Finding(
                id="pending-frees",
                severity="info",
                title=f"{format_bytes(pending)} freed by tensors but still waiting for work on another stream",
                advice=(
                    "These blocks were used on a second stream (Tensor.record_stream) and are released only "
                    "when that stream's work completes and the allocator next runs. If this is large, "
                    "synchronise the streams sooner or avoid record_stream on big buffers."
                ),
                evidence={"pending_free_bytes": pending},
                device=dev,
            )
        )
    return out
