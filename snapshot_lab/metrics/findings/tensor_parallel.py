"""Tensor parallelism: parameters every rank holds in full.

A tensor-parallel rank holds its shard of each parallelised layer (``distribute_tensor``:
DTensor's ``_shard_tensor`` frames on the allocation) and the whole of every layer left
replicated: embeddings, norms, an unparallelised head. Those replicas, with their gradients and
optimizer state, are memory the TP degree does not divide (``tp_transformer``: 49 MiB of
embeddings, norms and head on each rank, 31% of its parameters; ``tp_mlp`` replicates only its
biases and stays silent).
"""

from __future__ import annotations

import numpy as np

from ...units import format_bytes
from ..attribution.sites import snapshot_sites
from ..categories import categorize
from ..categories.parallel import sharded_parameter_stacks
from ..parallel.parallelism import detect_parallel
from .base import Finding, FindingContext, MiB

MIN_SHARE = 0.10  # of the rank's parameter bytes
MIN_BYTES = 16 * MiB


def find(ctx: FindingContext) -> list[Finding]:
    frames = ctx.frames
    layout = detect_parallel(frames)
    if "tp" not in layout.strategies:
        return []
    cats = categorize(frames).block_category
    sharded = sharded_parameter_stacks(frames)
    sites = snapshot_sites(frames)
    out = []
    for dev in ctx.stats.devices:
        blocks = frames.blocks
        params = (blocks["device"] == dev) & (blocks["state"] == "active_allocated") & (cats == "parameter")
        param_blocks = blocks[params]
        stack_ids = param_blocks["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
        replicated = ~np.isin(stack_ids, np.fromiter(sharded, dtype=np.int64, count=len(sharded)))
        total = int(param_blocks["requested_size_bytes"].sum())
        rep = int(param_blocks.loc[replicated, "requested_size_bytes"].sum())
        if not total or rep < MIN_BYTES or rep < MIN_SHARE * total:
            continue
        tp_degree = layout.degrees.get("tp") or layout.world_size or 2
        by_site = (
            param_blocks[replicated]
            .assign(
                site=[
                    sites.label(int(stack_id)) if stack_id >= 0 else sites.label(None)
                    for stack_id in stack_ids[replicated]
                ]
            )
            .groupby("site")["requested_size_bytes"]
            .sum()
            .sort_values(ascending=False)
        )
        # with Adam-family optimizers each replicated parameter also has a gradient and two states
        at_stake = int(rep * 4 * (tp_degree - 1) / tp_degree)
        out.append(
            Finding(
                id="tp-replicated-params",
                severity="info",
                title=(
                    f"{format_bytes(rep)} of parameters ({rep / total:.0%} of this rank's) are replicated on every "
                    f"tensor-parallel rank"
                ),
                advice=(
                    "Layers left out of the tensor-parallel plan (embeddings, norms, the output head) are held in "
                    "full by every TP rank, with their gradients and optimizer state. Sharding the embedding "
                    "(RowwiseParallel on nn.Embedding) and the head (ColwiseParallel with loss_parallel) divides "
                    f"them by the TP degree ({tp_degree}); sequence parallelism shards the norms' activations. "
                    "Largest replicated sites: "
                    + "; ".join(
                        f"{site} ({format_bytes(int(site_bytes))})" for site, site_bytes in by_site.head(3).items()
                    )
                ),
                evidence={
                    "replicated_parameter_bytes": rep,
                    "parameter_bytes": total,
                    "tp_degree": tp_degree,
                    "replicated_sites": {
                        str(site_name): int(total_bytes) for site_name, total_bytes in by_site.head(8).items()
                    },
                },
                savings_bytes=at_stake,
                device=dev,
            )
        )
    return out
