"""One process driving several GPUs (``nn.DataParallel``): the first one carries the rest."""

from __future__ import annotations

from ...units import format_bytes
from .base import Finding, FindingContext, MiB

DP_MIN_RATIO = 2.0  # first device's allocated bytes vs the others' mean
DP_MIN_EXCESS_BYTES = 64 * MiB


def find(ctx: FindingContext) -> list[Finding]:
    stats, timelines = ctx.stats, ctx.timelines
    devs = sorted(stats.devices)
    if len(devs) < 2:
        return []
    alloc = {device: stats.devices[device].torch_stats["allocated_bytes.all.current"] for device in devs}
    first, rest = devs[0], devs[1:]
    others = sum(alloc[device] for device in rest) / len(rest)
    excess = alloc[first] - others
    if excess < DP_MIN_EXCESS_BYTES or alloc[first] < DP_MIN_RATIO * max(others, 1):
        return []
    peaks = {
        device: timeline.peak_requested_bytes for device in devs if (timeline := timelines.get(device)) is not None
    }
    peak_excess = 0
    if first in peaks and all(device in peaks for device in rest):
        peak_excess = max(0, int(peaks[first] - sum(peaks[device] for device in rest) / len(rest)))
    return [
        Finding(
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
                **{f"allocated_bytes_device_{device}": alloc[device] for device in devs},
                **{f"peak_requested_bytes_device_{device}": peaks[device] for device in devs if device in peaks},
            },
            savings_bytes=peak_excess or int(excess),
            device=first,
        )
    ]
