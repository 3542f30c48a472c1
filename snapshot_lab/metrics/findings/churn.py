"""cudaFree/cudaMalloc churn: memory given back to CUDA again and again, and reserved again.

Churn is a cycle that repeats: the program releases the cache (``torch.cuda.empty_cache()``,
:mod:`..releases`) and then reserves memory again, several times over. One bulk release is not
churn: freeing the cache once before profiling a step (``bulk_release_python``: 47 segments
released at the trace's start, then re-reserved by the step) is a common, harmless habit, and
the simpler rule "many segment frees, later cudaMallocs of the same sizes" called it churn. The
allocator's own releases inside an allocation (garbage collection, retries under a memory cap:
``gcwhatif_gc06_capM``) are the price of running near the cap, not something the program does,
and are left to the allocator-settings advice; its cache flushes before a retried cudaMalloc
(``inf_flush_python``: an inference job that calls no empty_cache()) are ``cache-flush``
(:mod:`.cache_flush`).
"""

from __future__ import annotations

from ..allocator.releases import find_releases
from .base import Finding, FindingContext

CHURN_MIN_SEGMENT_FREES = 8
# releases by the program, each followed by reserving memory again
CHURN_MIN_CYCLES = 3
# of what the release gave back, before the next release
CHURN_MIN_RESERVED_AGAIN = 0.25


def find(ctx: FindingContext) -> list[Finding]:
    out = []
    for dev in ctx.stats.devices:
        releases = [
            release for release in find_releases(ctx.frames, dev) if release.cause in ("empty_cache", "unknown")
        ]
        segments = sum(release.segments for release in releases)
        cycles = sum(
            1
            for release in releases
            if release.bytes and release.reserved_again_bytes >= CHURN_MIN_RESERVED_AGAIN * release.bytes
        )
        if segments < CHURN_MIN_SEGMENT_FREES or cycles < CHURN_MIN_CYCLES:
            continue
        out.append(
            Finding(
                id="empty-cache-churn",
                severity="warning",
                title=(
                    f"Memory given back to CUDA {cycles} times and reserved again each time ({segments} segments "
                    "released): cudaFree/cudaMalloc churn"
                ),
                advice=(
                    "Each cudaFree synchronises the device and each cudaMalloc is slow; the memory was needed again "
                    "soon after. This pattern comes from calling torch.cuda.empty_cache() inside the training loop. "
                    "Remove it from the loop; call it only between phases that really change memory use."
                ),
                evidence={
                    "releases": len(releases),
                    "released_by_empty_cache": sum(1 for release in releases if release.cause == "empty_cache"),
                    "reserved_again_after": cycles,
                    "segments_released": segments,
                    "bytes_released": sum(release.bytes for release in releases),
                },
                device=dev,
            )
        )
    return out
