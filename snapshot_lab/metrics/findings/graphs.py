"""Memory reserved by private pools: CUDA graphs' (with the graph advice), and pools whose owner
the file does not name (``torch.cuda.MemPool``, a shared graph pool), said as such and given no
advice the evidence does not support (see :mod:`..categories.pools` for how they are told apart)."""

from __future__ import annotations

from ...units import format_bytes
from ..categories.pools import pool_owners
from .base import Finding, FindingContext

GRAPH_ADVICE = (
    "Memory captured by CUDA graphs stays reserved for the graph's lifetime and is invisible to other "
    "allocations. Share one pool between graphs (torch.cuda.graph_pool_handle()) or free graphs you no "
    "longer replay."
)
PRIVATE_ADVICE = (
    "A private pool (torch.cuda.MemPool with use_mem_pool, a serving engine's sleep mode, an offloading "
    "library, NCCL symmetric memory) keeps its segments for itself: nothing outside the pool can use them "
    "until the pool is released. The file does not say who made it; its pool id and the stacks of what it "
    "holds are in the evidence."
)


def find(ctx: FindingContext) -> list[Finding]:
    owners = pool_owners(ctx.frames)
    out = []
    for _, pools in owners.groupby(["device", "owner"], sort=True):
        device, owner = int(pools["device"].iloc[0]), str(pools["owner"].iloc[0])
        reserved = int(pools["reserved_bytes"].sum())
        ids = [[int(a), int(b)] for a, b in zip(pools["pool_id_0"], pools["pool_id_1"], strict=True)]
        evidence = {"private_pool_reserved_bytes": reserved, "pool_ids": ids, "rules": sorted(set(pools["rule"]))}
        if owner == "cuda_graph":
            title = f"{format_bytes(reserved)} reserved by CUDA-graph memory pools"
            out.append(Finding("cuda-graph-pool", "info", title, GRAPH_ADVICE, evidence, device=device))
        else:
            title = f"{format_bytes(reserved)} reserved by private memory pools, owner unknown"
            out.append(Finding("private-pool", "info", title, PRIVATE_ADVICE, evidence, device=device))
    return out
