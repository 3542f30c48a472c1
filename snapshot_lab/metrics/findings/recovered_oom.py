"""Out-of-memory errors the job went on from: it ran at its memory limit.

Which errors those are is :mod:`..history.ooms`'s question (a later allocation on the device).
The job that ended on one of its own is explained by :mod:`.oom`; this finding says what came
before it, or, for a job that finished, that it had no headroom.
"""

from __future__ import annotations

import numpy as np

from ...units import format_bytes
from ..history.ooms import recovered
from .base import Finding, FindingContext

FINDING_ID = "oom-recovered"
ADVICE = (
    "Each was an out-of-memory error that something caught: PyTorch's cuDNN convolutions catch it on "
    "their workspace and run an algorithm that needs less, often a slower one; a program may catch it "
    "itself (skip or halve a batch). Before refusing each, the allocator released every cached block it "
    "could. The job has no headroom: a little more memory in use (a larger batch, a longer sequence, "
    "another process on the GPU) ends it. `snaplab fit` gives the largest batch that fits a limit, "
    "and the changes that make room."
)


def _finding(ctx: FindingContext, device: int) -> Finding | None:
    events = ctx.frames.device_events(device)
    caught = recovered(events)
    if not caught.any():
        return None
    sizes = events["size_bytes"].to_numpy()[caught]
    where = events["event_index"].to_numpy()[caught]
    n = int(caught.sum())
    ended = ctx.stats.devices[device].oom is not None  # the OOM that ended the job, as the stats explain it
    whatif = ctx.whatifs.get(device)
    evidence: dict[str, object] = {
        "recovered_count": n,
        "largest_request_bytes": int(np.max(sizes)),
        "smallest_request_bytes": int(np.min(sizes)),
        "first_event_index": int(where.min()),
        "last_event_index": int(where.max()),
        "ended_by_an_oom": ended,
    }
    if whatif is not None and whatif.memory_limit_bytes is not None:
        evidence["memory_limit_bytes"] = whatif.memory_limit_bytes
    then = ", until one ended it" if ended else ""
    return Finding(
        id=FINDING_ID,
        severity="info" if ended else "warning",
        title=(
            f"{n} allocation{'s' if n > 1 else ''} failed and the job went on{then}: it ran at its memory "
            f"limit (requests of {format_bytes(int(np.min(sizes)))} to {format_bytes(int(np.max(sizes)))} refused)"
        ),
        advice=ADVICE,
        evidence=evidence,
        device=device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    found = (_finding(ctx, dev) for dev in ctx.stats.devices)
    return [f for f in found if f is not None]
