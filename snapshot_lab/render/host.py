"""The report's "Pinned host memory" section (torch >= 2.14, ``record_pinned_host_memory=True``):
host totals beside each device's, and the top host allocation sites, as plain data for the HTML
template and the Markdown report."""

from __future__ import annotations

from typing import Any

from ..metrics.stats.host import HostMemory
from ..metrics.stats.summary import SnapshotStats

MAX_HOST_SITES = 10


def host_view(stats: SnapshotStats) -> dict[str, Any]:
    """The section's data: ``rows`` (pinned host memory, then each device, with reserved and
    allocated bytes), ``totals`` of the host's states and ``sites``; empty when the file records
    no host memory (the section is then left out)."""
    host: HostMemory | None = stats.host
    if host is None:
        return {}
    rows = [{"memory": "pinned host", "reserved": host.reserved_bytes, "allocated": host.allocated_bytes}]
    rows += [
        {
            "memory": f"device {device}",
            "reserved": int(device_stats.torch_stats["reserved_bytes.all.current"]),
            "allocated": int(device_stats.torch_stats["allocated_bytes.all.current"]),
        }
        for device, device_stats in stats.devices.items()
    ]
    totals = [
        ("allocated (held by tensors)", host.allocated_bytes),
        ("freed, waiting on a CUDA event", host.pending_free_bytes),
        ("cached, free for reuse", host.cached_bytes),
        ("in a private pool", host.private_pool_bytes),
    ]
    return {
        "segments": host.segments,
        "events": host.events,
        "peak": host.peak_allocated_in_trace_bytes,
        "rows": rows,
        "totals": [{"label": label, "bytes": nbytes} for label, nbytes in totals],
        "sites": [
            {"frame": site.frame, "bytes": site.allocated_bytes, "blocks": site.blocks}
            for site in host.sites[:MAX_HOST_SITES]
        ],
    }
