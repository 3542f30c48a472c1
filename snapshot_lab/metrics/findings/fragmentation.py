"""High fragmentation without an OOM: reserved memory no request could use.

Where the reserved-gap finding fires (peak reserved at least twice the peak in use and 1 GiB
above it), this one does not judge the peak: it would say the same gap in other words (on every
real run where both fired, the same peaks and the same bytes: ``gaptwin_split64_complete`` 3.08
GiB of 5.09, ``twin_split64_complete`` 1.99 of 3.37, ``whatif_maxsplit_uncapped`` 2.20 of 4.08,
``gcwhatif_split128gc08_uncapped`` 2.51 of 4.90...), while reserved-gap names the cause
(max_split_size_mb) and what each replayed setting would reserve. Stranded holes at the dump are
still this finding's to say (none of those runs has them: 0.05-0.11 GiB stranded). Below
reserved-gap's bounds it still fires at the peak (``whatif_default_capA``: 1.02 GiB of 2.90,
1.5x).
"""

from __future__ import annotations

from ...units import format_bytes
from ..history.timeline import Timeline
from ..stats.summary import DeviceStats
from .base import Finding, FindingContext, MiB
from .reserved_gap import gap_finding

# thresholds, chosen so that clean runs stay quiet (see tests/test_diagnostics.py)
FRAG_MIN_BYTES = 512 * MiB
FRAG_MIN_SHARE = 0.30


def _finding(device_stats: DeviceStats, timeline: Timeline | None, gap_said: bool = False) -> Finding | None:
    """``gap_said``: the reserved-gap finding fires on the device and says the peak's gap."""
    fragmentation = device_stats.fragmentation["all"]
    reserved = fragmentation.reserved_bytes
    stranded = fragmentation.stranded_bytes
    overhead = 0
    if timeline is not None and timeline.n_events:
        # what the trace reserved beyond its own need: cache already held when the trace began
        # (an earlier phase of the process; a late start) is not the trace's fragmentation (a
        # Lightning fit after another workload in the process: 1 GiB cached, 267 MiB used)
        held_at_start = int(timeline.reserved_bytes[0])
        overhead = max(timeline.peak_reserved_bytes - max(timeline.peak_requested_bytes, held_at_start), 0)
    at_dump = stranded >= FRAG_MIN_BYTES and reserved and stranded / reserved >= FRAG_MIN_SHARE
    # levels anchored at the dump are exact too (the trace's changes are exact): a trace whose
    # ring buffer wrapped is judged at its peak like a complete one
    at_peak = (
        not gap_said
        and timeline is not None
        and overhead >= FRAG_MIN_BYTES
        and overhead / max(timeline.peak_reserved_bytes, 1) >= FRAG_MIN_SHARE
    )
    if not (at_dump and fragmentation.external_fragmentation >= 0.5) and not at_peak:
        return None
    if at_peak and timeline is not None:
        title = (
            f"Fragmentation: at the peak {format_bytes(timeline.peak_reserved_bytes)} was reserved for "
            f"{format_bytes(timeline.peak_requested_bytes)} of tensors; {format_bytes(overhead)} "
            f"({overhead / timeline.peak_reserved_bytes:.0%}) sat in cached blocks no request could use"
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
            "external_fragmentation": fragmentation.external_fragmentation,
            "largest_free_block_bytes": fragmentation.largest_free_block_bytes,
            "peak_reserved_bytes": timeline.peak_reserved_bytes if timeline else None,
            "peak_requested_bytes": timeline.peak_requested_bytes if timeline else None,
            "overhead_at_peak_bytes": overhead if timeline else None,
            "levels_anchored_at_dump": timeline.anchored_at_end if timeline else None,
        },
        savings_bytes=max(stranded, overhead),
        device=device_stats.device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    out = []
    for dev, device_stats in ctx.stats.devices.items():
        if device_stats.oom is not None and device_stats.oom.cause == "fragmentation":
            continue  # the OOM finding says it
        finding = _finding(device_stats, ctx.timelines.get(dev), gap_said=gap_finding(ctx, dev) is not None)
        if finding is not None:
            out.append(finding)
    return out
