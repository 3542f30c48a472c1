"""Out of memory: fragmentation or capacity, explained from the moment it happened, and from the
whole step where the moment alone would blame fragmentation (fit's model of the step)."""

from __future__ import annotations

from ...frames import SnapshotFrames
from ...units import format_bytes
from ..allocator.whatif import WhatIf, settings_label
from ..stats.oom import OomAnalysis
from ..stats.summary import DeviceStats
from .base import Finding, FindingContext, MiB
from .iteration import over_the_limit, whole_iteration


def _split_size_hint(request_bytes: int) -> int:
    """max_split_size_mb to suggest: the request rounded up to a power of two MiB (>= 20 MiB, the
    large segment size), so cached blocks this big are never carved up by smaller requests."""
    mib = max(20, -(-request_bytes // MiB))
    power = 1
    while power < mib:
        power *= 2
    return power


def _serving_settings(whatif: WhatIf | None) -> list[str]:
    """Settings under which the replay served the request that failed."""
    if whatif is None:
        return []
    return [settings_label(scenario.settings) for scenario in whatif.scenarios[1:] if scenario.recorded_oom_avoided]


def _evidence(oom: OomAnalysis, whatif: WhatIf | None, whole_step: int | None) -> dict[str, object]:
    evidence: dict[str, object] = {
        "requested_bytes": oom.requested_bytes,
        "pool": oom.pool,
        "free_in_reserved_bytes": oom.free_in_reserved_bytes,
        "largest_free_block_bytes": oom.largest_free_block_bytes,
        "reserved_bytes": oom.reserved_bytes,
        "allocated_bytes": oom.allocated_bytes,
        "device_free_bytes": oom.device_free_bytes,
        "oom_count": oom.oom_count,
        "snapshot_at_oom": oom.snapshot_at_oom,
        "layout_from": oom.moment,
    }
    if whatif is not None and whatif.memory_limit_bytes is not None:
        evidence["memory_limit_bytes"] = whatif.memory_limit_bytes
        evidence["memory_limit_inferred"] = whatif.memory_limit_inferred
        evidence["settings_that_serve_the_request"] = _serving_settings(whatif)
    if whole_step is not None:
        evidence["whole_step_peak_allocated_bytes"] = whole_step
    return evidence


def _assumption(whatif: WhatIf | None) -> str:
    """What the replay found, said with its assumption when the cap was inferred."""
    serving = _serving_settings(whatif)
    if whatif is None or whatif.memory_limit_bytes is None or not whatif.scenarios:
        return ""
    cap = format_bytes(whatif.memory_limit_bytes)
    if whatif.memory_limit_inferred:
        prefix = (
            f" The snapshot does not record the per-process cap the job ran under; assuming it was {cap} (inferred "
            "from the trace, whose peak reserved bounds it from below and whose failing request from above), "
        )
    else:
        prefix = f" Under the {cap} limit, "
    if serving:
        return prefix + f"the replayed trace shows {', '.join(serving)} would have served the failing request."
    return prefix + "no allocator setting the replay tried would have served the failing request."


def _replay_refutes_fragmentation(whatif: WhatIf | None) -> bool:
    """The replay under the cap ran and no setting it tried served the failing request: the free
    holes were enough for this request, not for the job (BERT's first forward under 6 GiB: 48 MiB
    asked with 67.75 MiB free in holes of 17.75 MiB, and a step that needs 10.6 GiB)."""
    return (
        whatif is not None
        and whatif.memory_limit_bytes is not None
        and len(whatif.scenarios) > 1
        and not _serving_settings(whatif)
    )


def _whole_step(frames: SnapshotFrames, oom: OomAnalysis, whatif: WhatIf | None) -> int | None:
    """What one whole iteration (a training step, or a forward in inference) at the recorded batch
    holds at once (fit's model of it), where it can decide a fragmentation verdict the moment alone
    would give: the failing request would fit in the free holes, the replay does not refute it, and
    the limit is known. A job that ran out in its first forward at 64 samples of a Mixtral-config
    model, 64 MiB asked with 67 MiB free in holes of 32 MiB, needs 33 GiB for its step under a 6 GiB
    limit: capacity, whatever the allocator does."""
    if oom.cause != "fragmentation" or _replay_refutes_fragmentation(whatif):
        return None
    return whole_iteration(frames, oom.device, whatif)


NEAR_LIMIT = 0.95  # a whole iteration above this share of the limit: within fit's error of it


def _near_the_limit(whatif: WhatIf | None, whole_step: int | None) -> str:
    """A caution where the whole iteration (under the limit) comes within fit's error of it."""
    if whole_step is None or whatif is None or whatif.memory_limit_bytes is None:
        return ""
    if whole_step <= NEAR_LIMIT * whatif.memory_limit_bytes:
        return ""
    return (
        f" One whole iteration at this batch holds about {format_bytes(whole_step)} at once (snaplab fit's model of "
        f"it), close to the {format_bytes(whatif.memory_limit_bytes)} limit: a setting that serves this request may "
        "only move the error later (snaplab fit says which batch fits)."
    )


def _capacity_reason(oom: OomAnalysis, whatif: WhatIf | None, whole_step: int | None) -> str:
    if oom.cause != "fragmentation":
        return "Fragmentation is not the cause: too little memory was free even counting every cached hole. "
    if whatif is not None and whatif.memory_limit_bytes is not None and over_the_limit(whatif, whole_step):
        return (
            f"Fragmentation decided only this request: {format_bytes(oom.free_in_reserved_bytes)} was free in "
            f"reserved memory (in holes no larger than {format_bytes(oom.largest_free_block_bytes)}), but one whole "
            f"iteration at this batch holds about {format_bytes(whole_step or 0)} at once (snaplab fit's model of it, "
            f"from this trace), more than the {format_bytes(whatif.memory_limit_bytes)} limit: no allocator setting "
            "lets the job finish. "
        )
    return (
        f"Fragmentation did not decide it: {format_bytes(oom.free_in_reserved_bytes)} was free in reserved memory "
        f"(in holes no larger than {format_bytes(oom.largest_free_block_bytes)}), but no allocator setting the "
        "replay tried would have served the request, so the job needs more memory than it had. "
    )


def _oom_finding(oom: OomAnalysis, device_stats: DeviceStats, whatif: WhatIf | None, whole_step: int | None) -> Finding:
    moment = "" if oom.snapshot_at_oom else f" (explained from the allocator's state at the OOM: {oom.moment})"
    refuted = _replay_refutes_fragmentation(whatif) or over_the_limit(whatif, whole_step)
    if oom.cause == "fragmentation" and not refuted:
        split_hint = ""
        split_mb = _split_size_hint(oom.requested_bytes)
        # max_split_size only protects blocks at least that large: advise it only when such
        # segments exist and were carved up
        if device_stats.split_segments_larger_than(split_mb * MiB - 1):
            split_hint = (
                f" Segments of {split_mb} MiB and more were split by smaller allocations: "
                f"max_split_size_mb:{split_mb} keeps blocks that large whole for requests like this one."
            )
        return Finding(
            id="oom-fragmentation",
            severity="critical",
            title=(
                f"Out of memory caused by fragmentation: {format_bytes(oom.requested_bytes)} could not be "
                f"placed although {format_bytes(oom.free_in_reserved_bytes)} was free in reserved memory" + moment
            ),
            advice=(
                "The free memory was split into holes no larger than "
                f"{format_bytes(oom.largest_free_block_bytes)}. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                "so the allocator maps memory into one growing range per stream instead of needing a "
                f"contiguous hole.{split_hint} Keeping allocation sizes steady (padding variable-length "
                "batches to a few bucket sizes) also prevents the holes."
                + _assumption(whatif)
                + _near_the_limit(whatif, whole_step)
            ),
            evidence=_evidence(oom, whatif, whole_step),
            savings_bytes=oom.free_in_reserved_bytes,
            device=oom.device,
        )
    return Finding(
        id="oom-capacity",
        severity="critical",
        title=(
            f"Out of memory: the job needed more than the device had ({format_bytes(oom.requested_bytes)} "
            f"requested with {format_bytes(oom.allocated_bytes)} already allocated)" + moment
        ),
        advice=(
            _capacity_reason(oom, whatif, whole_step)
            + "Reduce what is live at the peak: a smaller batch or sequence length, activation checkpointing, "
            "bf16/fp16 autocast, sharding optimizer state and gradients (FSDP/ZeRO), or freeing tensors "
            "kept across iterations (see the top allocation sites)." + _assumption(whatif)
        ),
        evidence=_evidence(oom, whatif, whole_step),
        device=oom.device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    out = []
    for dev, device_stats in ctx.stats.devices.items():
        if device_stats.oom is None:
            continue
        whatif = ctx.whatifs.get(dev)
        whole_step = _whole_step(ctx.frames, device_stats.oom, whatif)
        out.append(_oom_finding(device_stats.oom, device_stats, whatif, whole_step))
    return out
