"""Findings: what the numbers mean for the user, each with its evidence and advice.

Every finding is raised only when the snapshot shows the situation, and carries the numbers
that show it. ``savings_bytes`` is the memory the advice would free or make usable, when that
can be computed from the snapshot (None otherwise).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from ..units import format_bytes
from .categories import CategoryBreakdown
from .leaks import LeakAnalysis
from .oom import OomAnalysis
from .recording import Recording
from .summary import DeviceStats, SnapshotStats
from .timeline import Timeline
from .whatif import WhatIf, best_alternative, settings_label

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
MiB = 1024 * 1024

# thresholds, chosen so that clean runs stay quiet (see tests/test_findings.py)
FRAG_MIN_BYTES = 512 * MiB
FRAG_MIN_SHARE = 0.30
CHURN_MIN_SEGMENT_FREES = 8
DDP_MIN_GRAD_SHARE = 0.5  # separate gradients must add up to this share of the bucket bytes
DP_MIN_RATIO = 2.0  # first device's allocated bytes vs the others' mean
DP_MIN_EXCESS_BYTES = 64 * MiB


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str  # 'critical', 'warning', 'info'
    title: str
    advice: str
    evidence: dict[str, Any] = field(default_factory=dict)
    savings_bytes: int | None = None
    device: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _split_size_hint(request_bytes: int) -> int:
    """max_split_size_mb to suggest: the request rounded up to a power of two MiB (>= 20 MiB, the
    large segment size), so cached blocks this big are never carved up by smaller requests."""
    mib = max(20, -(-request_bytes // MiB))
    p = 1
    while p < mib:
        p *= 2
    return p


def _oom_findings(o: OomAnalysis, d: DeviceStats) -> list[Finding]:
    ev = {
        "requested_bytes": o.requested_bytes,
        "pool": o.pool,
        "free_in_reserved_bytes": o.free_in_reserved_bytes,
        "largest_free_block_bytes": o.largest_free_block_bytes,
        "reserved_bytes": o.reserved_bytes,
        "allocated_bytes": o.allocated_bytes,
        "device_free_bytes": o.device_free_bytes,
        "oom_count": o.oom_count,
        "snapshot_at_oom": o.snapshot_at_oom,
    }
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
        return [
            Finding(
                id="oom-fragmentation",
                severity="critical",
                title=(
                    f"Out of memory caused by fragmentation: {format_bytes(o.requested_bytes)} could not be "
                    f"placed although {format_bytes(o.free_in_reserved_bytes)} was free in reserved memory"
                ),
                advice=(
                    "The free memory was split into holes no larger than "
                    f"{format_bytes(o.largest_free_block_bytes)}. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                    "so the allocator maps memory into one growing range per stream instead of needing a "
                    f"contiguous hole.{split_hint} Keeping allocation sizes steady (padding variable-length "
                    "batches to a few bucket sizes) also prevents the holes."
                ),
                evidence=ev,
                savings_bytes=o.free_in_reserved_bytes,
                device=o.device,
            )
        ]
    return [
        Finding(
            id="oom-capacity",
            severity="critical",
            title=(
                f"Out of memory: the job needed more than the device had ({format_bytes(o.requested_bytes)} "
                f"requested with {format_bytes(o.allocated_bytes)} already allocated)"
            ),
            advice=(
                "Fragmentation is not the cause: too little memory was free even counting every cached hole. "
                "Reduce what is live at the peak: a smaller batch or sequence length, activation checkpointing, "
                "bf16/fp16 autocast, sharding optimizer state and gradients (FSDP/ZeRO), or freeing tensors "
                "kept across iterations (see the top allocation sites)."
            ),
            evidence=ev,
            device=o.device,
        )
    ]


def _fragmentation_finding(d: DeviceStats, tl: Timeline | None) -> Finding | None:
    f = d.fragmentation["all"]
    reserved = f.reserved_bytes
    stranded = f.stranded_bytes
    overhead = (tl.peak_reserved_bytes - tl.peak_requested_bytes) if tl is not None else 0
    at_dump = stranded >= FRAG_MIN_BYTES and reserved and stranded / reserved >= FRAG_MIN_SHARE
    at_peak = (
        tl is not None
        and not tl.anchored_at_end
        and overhead >= FRAG_MIN_BYTES
        and overhead / max(tl.peak_reserved_bytes, 1) >= FRAG_MIN_SHARE
    )
    if not (at_dump and f.external_fragmentation >= 0.5) and not at_peak:
        return None
    if at_peak and tl is not None:
        title = (
            f"Fragmentation: at the peak {format_bytes(tl.peak_reserved_bytes)} was reserved for "
            f"{format_bytes(tl.peak_requested_bytes)} of tensors; {format_bytes(overhead)} "
            f"({overhead / tl.peak_reserved_bytes:.0%}) sat in cached blocks no request could use"
        )
    else:
        title = (
            f"Fragmentation: {format_bytes(stranded)} of free memory is stranded in segments that hold live "
            "tensors, in holes too small for large requests"
        )
    return Finding(
        id="high-fragmentation",
        severity="warning",
        title=title,
        advice=(
            "The caching allocator carves segments into blocks; when tensor sizes vary (variable sequence "
            "lengths, changing batch shapes), freed blocks do not fit the next requests and new segments are "
            "reserved instead. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow in place "
            "and usually removes most of this overhead; padding shapes to a few fixed sizes helps too."
        ),
        evidence={
            "reserved_bytes": reserved,
            "stranded_bytes": stranded,
            "external_fragmentation": f.external_fragmentation,
            "largest_free_block_bytes": f.largest_free_block_bytes,
            "peak_reserved_bytes": tl.peak_reserved_bytes if tl else None,
            "peak_requested_bytes": tl.peak_requested_bytes if tl else None,
            "overhead_at_peak_bytes": overhead if tl else None,
        },
        savings_bytes=max(stranded, overhead),
        device=d.device,
    )


def _churn_finding(events: pd.DataFrame, device: int) -> Finding | None:
    ev = events[events["device"] == device]
    frees = ev[ev["action"].isin(["segment_free", "segment_unmap"])]
    if len(frees) < CHURN_MIN_SEGMENT_FREES:
        return None
    allocs = ev[ev["action"].isin(["segment_alloc", "segment_map"])]
    # a free followed later by an allocation of the same size is churn: memory given back only to
    # be requested again
    later = allocs.merge(frees[["size_bytes", "event_index"]], on="size_bytes", suffixes=("", "_free"))
    churned = later[later["event_index"] > later["event_index_free"]].drop_duplicates("event_index_free")
    if len(churned) < CHURN_MIN_SEGMENT_FREES:
        return None
    return Finding(
        id="empty-cache-churn",
        severity="warning",
        title=(
            f"{len(frees)} segments given back to CUDA and {len(churned)} of them allocated again: "
            "cudaFree/cudaMalloc churn"
        ),
        advice=(
            "Each cudaFree synchronises the device and each cudaMalloc is slow; the memory was needed again soon "
            "after. This pattern comes from calling torch.cuda.empty_cache() inside the training loop (or from "
            "garbage_collection_threshold set too low). Remove empty_cache() from the loop; call it only "
            "between phases that really change memory use."
        ),
        evidence={
            "segment_frees": len(frees),
            "segment_allocs": len(allocs),
            "reallocated_after_free": len(churned),
            "bytes_freed": int(frees["size_bytes"].sum()),
        },
        device=device,
    )


def _recording_findings(rec: Recording) -> list[Finding]:
    out = []
    if rec.mode == "state":
        out.append(
            Finding(
                id="no-trace",
                severity="info",
                title="State-only recording: no allocation history, so no timeline or peak analysis",
                advice=(
                    "Record with torch.cuda.memory._record_memory_history(max_entries=100000) "
                    "(enabled='all', the default) to get the event history."
                ),
                evidence={"mode": rec.mode},
            )
        )
    for d in rec.devices:
        if rec.mode == "trace" and not d.history_complete:
            out.append(
                Finding(
                    id="history-incomplete",
                    severity="info",
                    title=(
                        f"The trace of device {d.device} misses the start of the job: "
                        f"{format_bytes(d.live_bytes_before_trace)} still live was allocated before its first event"
                    ),
                    advice=(
                        "The ring buffer wrapped or recording started after the model was built. Timelines are "
                        "anchored at the dump and exact inside the trace; sites at the peak miss older "
                        "allocations. Start recording earlier or raise max_entries."
                    ),
                    evidence={
                        "trace_events": d.events,
                        "orphan_frees": d.orphan_frees,
                        "live_blocks_before_trace": d.live_blocks_before_trace,
                        "live_bytes_before_trace": d.live_bytes_before_trace,
                    },
                    device=d.device,
                )
            )
    return out


def _ddp_finding(dev: int, cats: CategoryBreakdown) -> Finding | None:
    bucket = cats.live_bytes["ddp_bucket"]
    grads = cats.live_bytes["gradient"]
    if not bucket or grads < DDP_MIN_GRAD_SHARE * bucket:
        return None
    saved = min(bucket, grads)
    return Finding(
        id="ddp-bucket-duplicate-grads",
        severity="warning",
        title=(
            f"DDP keeps gradients twice: {format_bytes(grads)} of gradients beside {format_bytes(bucket)} "
            "of DDP gradient buckets"
        ),
        advice=(
            "DistributedDataParallel copies every gradient into its communication buckets. With "
            "DistributedDataParallel(model, gradient_as_bucket_view=True) the gradients become views into the "
            f"buckets, saving about {format_bytes(saved)} on every rank (the size of the gradients). Standard "
            "optimizers and gradient clipping work unchanged; only code that replaces p.grad with a new tensor "
            "must not be used with it."
        ),
        evidence={
            "ddp_bucket_bytes": bucket,
            "gradient_bytes": grads,
            "gradient_blocks": cats.live_blocks["gradient"],
            "ddp_bucket_blocks": cats.live_blocks["ddp_bucket"],
        },
        savings_bytes=saved,
        device=dev,
    )


def _dataparallel_finding(stats: SnapshotStats, timelines: dict[int, Timeline | None]) -> Finding | None:
    devs = sorted(stats.devices)
    if len(devs) < 2:
        return None
    alloc = {d: stats.devices[d].torch_stats["allocated_bytes.all.current"] for d in devs}
    first, rest = devs[0], devs[1:]
    others = sum(alloc[d] for d in rest) / len(rest)
    excess = alloc[first] - others
    if excess < DP_MIN_EXCESS_BYTES or alloc[first] < DP_MIN_RATIO * max(others, 1):
        return None
    peaks = {d: tl.peak_requested_bytes for d in devs if (tl := timelines.get(d)) is not None}
    peak_excess = 0
    if first in peaks and all(d in peaks for d in rest):
        peak_excess = max(0, int(peaks[first] - sum(peaks[d] for d in rest) / len(rest)))
    return Finding(
        id="dataparallel-imbalance",
        severity="warning",
        title=(
            f"Device {first} carries {format_bytes(excess)} more than the other devices of this process "
            f"({format_bytes(alloc[first])} vs {format_bytes(int(others))} allocated)"
        ),
        advice=(
            "One process drives several GPUs and the first one holds the parameters, gradients, optimizer "
            "state and the gathered outputs (nn.DataParallel does this): it runs out of memory first while the "
            "others have room. Use DistributedDataParallel (one process per GPU, torchrun) so every GPU holds "
            "the same, or move the loss computation into the replicated module so outputs are not gathered."
        ),
        evidence={
            **{f"allocated_bytes_device_{d}": alloc[d] for d in devs},
            **{f"peak_requested_bytes_device_{d}": peaks[d] for d in devs if d in peaks},
        },
        savings_bytes=peak_excess or int(excess),
        device=first,
    )


def _leak_finding(la: LeakAnalysis) -> Finding | None:
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


def _whatif_finding(w: WhatIf) -> Finding | None:
    found = best_alternative(w)
    if found is None:
        return None
    best, why = found
    recorded = w.scenarios[0]
    label = settings_label(best.settings)
    check = "exact" if w.replay_check.exact else "approximate"
    saved = recorded.peak_reserved_bytes - best.peak_reserved_bytes
    if why == "avoids the OOM":
        title = (
            f"{label} would have served the allocation that failed: predicted peak reserved "
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
            f"recorded settings reproduced the snapshot {'exactly' if check == 'exact' else 'approximately'}. "
            "`snaplab whatif` compares more settings."
        ),
        evidence={
            "settings": label,
            "predicted_peak_reserved_bytes": best.peak_reserved_bytes,
            "recorded_peak_reserved_bytes": recorded.peak_reserved_bytes,
            "memory_limit_bytes": w.memory_limit_bytes,
            "replay_check": check,
        },
        savings_bytes=max(saved, 0) or None,
        device=w.device,
    )


def compute_findings(
    stats: SnapshotStats,
    events: pd.DataFrame,
    timelines: dict[int, Timeline | None] | None = None,
    categories: dict[int, CategoryBreakdown] | None = None,
    leaks: dict[int, LeakAnalysis] | None = None,
    whatifs: dict[int, WhatIf] | None = None,
) -> list[Finding]:
    """All findings, most severe first."""
    timelines = timelines or {}
    out: list[Finding] = []
    for dev, d in stats.devices.items():
        if whatifs and dev in whatifs:
            wf = _whatif_finding(whatifs[dev])
            if wf:
                out.append(wf)
        if categories and dev in categories:
            ddp = _ddp_finding(dev, categories[dev])
            if ddp:
                out.append(ddp)
        if leaks and dev in leaks:
            leak = _leak_finding(leaks[dev])
            if leak:
                out.append(leak)
        if d.oom is not None:
            out.extend(_oom_findings(d.oom, d))
        if d.oom is None or d.oom.cause != "fragmentation":
            frag = _fragmentation_finding(d, timelines.get(dev))
            if frag:
                out.append(frag)
        churn = _churn_finding(events, dev)
        if churn:
            out.append(churn)
        pending = d.torch_stats["active_bytes.all.current"] - d.torch_stats["allocated_bytes.all.current"]
        if pending:
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
        if d.private_pool_reserved_bytes:
            out.append(
                Finding(
                    id="cuda-graph-pool",
                    severity="info",
                    title=f"{format_bytes(d.private_pool_reserved_bytes)} reserved by CUDA-graph/private memory pools",
                    advice=(
                        "Memory captured by CUDA graphs (or torch.cuda.MemPool) stays reserved for the graph's "
                        "lifetime and is invisible to other allocations. Share one pool between graphs "
                        "(torch.cuda.graph_pool_handle()) or free graphs you no longer replay."
                    ),
                    evidence={"private_pool_reserved_bytes": d.private_pool_reserved_bytes},
                    device=dev,
                )
            )
    dp = _dataparallel_finding(stats, timelines)
    if dp:
        out.append(dp)
    out.extend(_recording_findings(stats.recording))
    out.sort(key=lambda f: (SEVERITY_ORDER[f.severity], f.device if f.device is not None else -1))
    return out
