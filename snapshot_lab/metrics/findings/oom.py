"""Out of memory: fragmentation or capacity, explained from the moment it happened."""

from __future__ import annotations

from ...units import format_bytes
from ..allocator.whatif import WhatIf, settings_label
from ..stats.oom import OomAnalysis
from ..stats.summary import DeviceStats
from .base import Finding, FindingContext, MiB


def _split_size_hint(request_bytes: int) -> int:
    """max_split_size_mb to suggest: the request rounded up to a power of two MiB (>= 20 MiB, the
    large segment size), so cached blocks this big are never carved up by smaller requests."""
    mib = max(20, -(-request_bytes // MiB))
    p = 1
    while p < mib:
        p *= 2
    return p


def _serving_settings(w: WhatIf | None) -> list[str]:
    """Settings under which the replay served the request that failed."""
    if w is None:
        return []
    return [settings_label(s.settings) for s in w.scenarios[1:] if s.recorded_oom_avoided]


def _evidence(o: OomAnalysis, w: WhatIf | None) -> dict[str, object]:
    ev: dict[str, object] = {
        "requested_bytes": o.requested_bytes,
        "pool": o.pool,
        "free_in_reserved_bytes": o.free_in_reserved_bytes,
        "largest_free_block_bytes": o.largest_free_block_bytes,
        "reserved_bytes": o.reserved_bytes,
        "allocated_bytes": o.allocated_bytes,
        "device_free_bytes": o.device_free_bytes,
        "oom_count": o.oom_count,
        "snapshot_at_oom": o.snapshot_at_oom,
        "layout_from": o.moment,
    }
    if w is not None and w.memory_limit_bytes is not None:
        ev["memory_limit_bytes"] = w.memory_limit_bytes
        ev["memory_limit_inferred"] = w.memory_limit_inferred
        ev["settings_that_serve_the_request"] = _serving_settings(w)
    return ev


def _assumption(w: WhatIf | None) -> str:
    """What the replay found, said with its assumption when the cap was inferred."""
    serving = _serving_settings(w)
    if w is None or w.memory_limit_bytes is None or not w.scenarios:
        return ""
    cap = format_bytes(w.memory_limit_bytes)
    if w.memory_limit_inferred:
        prefix = (
            f" The snapshot does not record the per-process cap the job ran under; assuming it was {cap} (the peak "
            "reserved before the OOM, the smallest cap consistent with the recording), "
        )
    else:
        prefix = f" Under the {cap} limit, "
    if serving:
        return prefix + f"the replayed trace shows {', '.join(serving)} would have served the failing request."
    return prefix + "no allocator setting the replay tried would have served the failing request."


def _oom_finding(o: OomAnalysis, d: DeviceStats, w: WhatIf | None) -> Finding:
    moment = "" if o.snapshot_at_oom else f" (explained from the allocator's state at the OOM: {o.moment})"
    if o.cause == "fragmentation":
        split_hint = ""
        split_mb = _split_size_hint(o.requested_bytes)
        # max_split_size only protects blocks at least that large: advise it only when such
        # segments exist and were carved up
        if d.split_segments_larger_than(split_mb * MiB - 1):
            split_hint = (
                f" Segments of {split_mb} MiB and more were split by smaller allocations: "
                f"max_split_size_mb:{split_mb} keeps blocks that large whole for requests like this one."
            )
        return Finding(
            id="oom-fragmentation",
            severity="critical",
            title=(
                f"Out of memory caused by fragmentation: {format_bytes(o.requested_bytes)} could not be "
                f"placed although {format_bytes(o.free_in_reserved_bytes)} was free in reserved memory" + moment
            ),
            advice=(
                "The free memory was split into holes no larger than "
                f"{format_bytes(o.largest_free_block_bytes)}. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                "so the allocator maps memory into one growing range per stream instead of needing a "
                f"contiguous hole.{split_hint} Keeping allocation sizes steady (padding variable-length "
                "batches to a few bucket sizes) also prevents the holes." + _assumption(w)
            ),
            evidence=_evidence(o, w),
            savings_bytes=o.free_in_reserved_bytes,
            device=o.device,
        )
    return Finding(
        id="oom-capacity",
        severity="critical",
        title=(
            f"Out of memory: the job needed more than the device had ({format_bytes(o.requested_bytes)} "
            f"requested with {format_bytes(o.allocated_bytes)} already allocated)" + moment
        ),
        advice=(
            "Fragmentation is not the cause: too little memory was free even counting every cached hole. "
            "Reduce what is live at the peak: a smaller batch or sequence length, activation checkpointing, "
            "bf16/fp16 autocast, sharding optimizer state and gradients (FSDP/ZeRO), or freeing tensors "
            "kept across iterations (see the top allocation sites)." + _assumption(w)
        ),
        evidence=_evidence(o, w),
        device=o.device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    return [_oom_finding(d.oom, d, ctx.whatifs.get(dev)) for dev, d in ctx.stats.devices.items() if d.oom is not None]
