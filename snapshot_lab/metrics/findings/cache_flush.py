"""The allocator flushed its own cache to get memory: the job runs at the edge of an OOM.

When cudaMalloc fails (a per-process cap, or the device is full), the caching allocator frees
every unsplit cached segment and retries (``release_cached_blocks``; torch counts it in
``memory_stats()['num_alloc_retries']``). When the retry succeeds the job goes on, and nothing
but the trace shows it: the segment frees right before the new segment of an allocation, with
that operation's stack and no ``empty_cache`` frame (:mod:`..releases`). It is not the
program's ``torch.cuda.empty_cache()`` (that is ``empty-cache-churn``, :mod:`.churn`): there is
no call to remove. It says the job needs nearly all the memory it may use: a slightly longer
input or a larger batch and the retry fails. Each flush also costs time: the allocator waits
for the device's pending work, frees segments with cudaFree (which synchronises the device) and
reserves them again with cudaMalloc.

Devices whose trace holds an OOM are left to the OOM findings: their flushes come before the
failure they explain.
"""

from __future__ import annotations

from ...units import format_bytes
from ..allocator.releases import Release, find_releases
from ..recording import DeviceRecording
from .base import Finding, FindingContext

TITLE = (
    "The allocator flushed its cache {count} time{s} to retry a cudaMalloc that failed{limit}: "
    "the job runs at the edge of an out-of-memory error"
)
LIMIT = " (the limit: about {limit})"
ADVICE = (
    "These are not torch.cuda.empty_cache() calls in your code: when cudaMalloc failed, the caching allocator "
    "freed every cached segment it could ({released} in {segments} cudaFree calls), waited for the device, and "
    "retried{spent}. Each flush synchronises the device and is followed by cudaMalloc calls to reserve the "
    "memory again ({reserved_again}); the job got through only because the retry succeeded. The next larger "
    "input or batch will raise an out-of-memory error instead. Lower the peak: smaller batches or shorter "
    "sequences (for inference, chunk long prefills or cap the tokens per batch), run inference under "
    "torch.inference_mode(), free large intermediates early, or set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so that freed memory is reused instead of reserved anew. "
    "If a per-process cap (set_per_process_memory_fraction) or another process on the GPU limits the job, "
    "give it more room."
)
SPENT = " (the flushes took {ms:.1f} ms from their first cudaFree to the retried cudaMalloc)"
WHEN = "first flush {first:.3f} s and last {last:.3f} s after the trace's first event"


def _recording(ctx: FindingContext, device: int) -> DeviceRecording | None:
    return next((recording for recording in ctx.stats.recording.devices if recording.device == device), None)


def _seconds_after_start(rec: DeviceRecording | None, flushes: list[Release]) -> tuple[float, float] | None:
    times = [release.time_us for release in flushes if release.time_us is not None]
    if rec is None or rec.first_time_us is None or len(times) < len(flushes):
        return None
    return (min(times) - rec.first_time_us) / 1e6, (max(times) - rec.first_time_us) / 1e6


def _total_time_us(flushes: list[Release]) -> int | None:
    """Time from each flush's first cudaFree to its retried cudaMalloc, summed: what the flushes
    cost inside the allocations that needed them (the re-reserving afterwards comes on top)."""
    spans = [release.duration_us for release in flushes]
    return (
        None
        if any(duration is None for duration in spans)
        else sum(duration for duration in spans if duration is not None)
    )


def _spent(flushes: list[Release]) -> str:
    total = _total_time_us(flushes)
    return "" if total is None else SPENT.format(ms=total / 1000)


def _device_has_oom(ctx: FindingContext, device: int) -> bool:
    events = ctx.frames.events
    return bool(((events["device"] == device) & (events["action"] == "oom")).any())


def _finding(ctx: FindingContext, device: int) -> Finding | None:
    flushes = [release for release in find_releases(ctx.frames, device) if release.cause == "flush"]
    if not flushes or _device_has_oom(ctx, device):
        return None
    whatif = ctx.whatifs.get(device)
    limit = whatif.memory_limit_bytes if whatif is not None else None
    released = sum(release.bytes for release in flushes)
    segments = sum(release.segments for release in flushes)
    reserved_again = sum(release.reserved_again_bytes for release in flushes)
    rec = _recording(ctx, device)
    when = _seconds_after_start(rec, flushes)
    count = len(flushes)
    return Finding(
        id="cache-flush",
        severity="warning",
        title=TITLE.format(
            count=count,
            s="" if count == 1 else "s",
            limit=LIMIT.format(limit=format_bytes(limit)) if limit is not None else "",
        )
        + (f" ({WHEN.format(first=when[0], last=when[1])})" if when is not None else ""),
        advice=ADVICE.format(
            released=format_bytes(released),
            segments=segments,
            reserved_again=f"{format_bytes(reserved_again)} reserved again after the flushes",
            spent=_spent(flushes),
        ),
        evidence={
            "flushes": count,
            "flush_event_positions": [release.start for release in flushes],
            "first_flush_s": when[0] if when is not None else None,
            "last_flush_s": when[1] if when is not None else None,
            "flush_time_us": _total_time_us(flushes),
            "bytes_released": released,
            "segments_released": segments,
            "bytes_reserved_again": reserved_again,
            "largest_retried_request_bytes": max(release.next_segment_bytes for release in flushes),
            "reserved_before_flush_bytes": max(release.reserved_before_bytes for release in flushes),
            "memory_limit_bytes": limit,
            "memory_limit_source": whatif.memory_limit_source if whatif is not None else None,
            # a trace that misses the job's start may miss flushes too: torch's count is then larger
            "history_complete": rec is None or rec.history_complete,
        },
        device=device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    return [finding for dev in ctx.stats.devices if (finding := _finding(ctx, dev)) is not None]
