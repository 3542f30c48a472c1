"""Memory reserved by CUDA-graph (or ``torch.cuda.MemPool``) private pools."""

from __future__ import annotations

from ...units import format_bytes
from .base import Finding, FindingContext


def find(ctx: FindingContext) -> list[Finding]:
    return [
        Finding(
            id="cuda-graph-pool",
            severity="info",
            title=f"{format_bytes(stats.private_pool_reserved_bytes)} reserved by CUDA-graph/private memory pools",
            advice=(
                "Memory captured by CUDA graphs (or torch.cuda.MemPool) stays reserved for the graph's "
                "lifetime and is invisible to other allocations. Share one pool between graphs "
                "(torch.cuda.graph_pool_handle()) or free graphs you no longer replay."
            ),
            evidence={"private_pool_reserved_bytes": stats.private_pool_reserved_bytes},
            device=dev,
        )
        for dev, stats in ctx.stats.devices.items()
        if stats.private_pool_reserved_bytes
    ]
