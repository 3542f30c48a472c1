"""What was recorded: no trace at all, or a trace that misses the start of the job."""

from __future__ import annotations

from ...units import format_bytes
from ..recording import Recording
from .base import Finding, FindingContext


def _cause(overflowed: bool | None, max_entries: int | None) -> str:
    """Why the trace misses the job's start: the file's own flag when it has one (newer than
    torch 2.14.1), else the two causes it cannot tell apart."""
    if overflowed:
        at = f" at {max_entries:,} entries" if max_entries is not None else ""
        return f"The ring buffer overflowed{at}: earlier events were lost."
    if overflowed is False:
        return "Recording started after these blocks were made (the ring buffer did not overflow)."
    return "The ring buffer wrapped or recording started after the model was built."


def _cause_and_remedy(rec: Recording) -> tuple[str, str]:
    """Why the trace misses the job's start, and how to see what it misses: the window snaplab
    read the file with, when it left entries out; else the recording's own cause."""
    if rec.window_cause:
        return (
            f"{rec.window_cause[0].upper()}{rec.window_cause[1:]}.",
            "Read the whole trace (without max_entries), where the memory allows, to see them.",
        )
    return _cause(rec.overflowed, rec.max_entries), "Start recording earlier or raise max_entries to see them."


def find(ctx: FindingContext) -> list[Finding]:
    rec = ctx.stats.recording
    out = []
    if rec.mode in ("state", "none"):
        out.append(
            Finding(
                id="no-trace",
                severity="info",
                title=(
                    "State-only recording: no allocation history, so no timeline or peak analysis"
                    if rec.mode == "state"
                    else "Nothing was recorded: no allocation history and no stacks, so every category is "
                    "inferred from the blocks' sizes alone"
                ),
                advice=(
                    "Record with torch.cuda.memory._record_memory_history(max_entries=100000) "
                    "(enabled='all', the default) to get the event history."
                ),
                evidence={"mode": rec.mode},
            )
        )
    cause, remedy = _cause_and_remedy(rec)
    for device in rec.devices:
        if rec.mode != "trace" or device.history_complete:
            continue
        if device.live_blocks_before_trace:
            what = f"{format_bytes(device.live_bytes_before_trace)} still live was allocated before its first event"
        elif not device.orphan_frees:  # only the window's cut: what it left out left no trace
            what = f"its first {device.entries_left_out:,} entries were not read"
        else:  # all that predates the trace was freed inside it
            orphans = device.orphan_frees
            blocks, were = ("blocks", "were") if orphans != 1 else ("block", "was")
            what = f"{orphans} {blocks} allocated before its first event {were} freed inside it"
        out.append(
            Finding(
                id="history-incomplete",
                severity="info",
                title=f"The trace of device {device.device} misses the start of the job: {what}",
                advice=(
                    f"{cause} Timelines are anchored at the dump and exact inside the trace, and the "
                    "allocator's state at the trace's start is rebuilt from the dump for the what-if replay; sites "
                    f"at the peak miss allocations older than the trace. {remedy}"
                ),
                evidence={
                    "trace_events": device.events,
                    "orphan_frees": device.orphan_frees,
                    "live_blocks_before_trace": device.live_blocks_before_trace,
                    "live_bytes_before_trace": device.live_bytes_before_trace,
                    # allocator_settings.trace_alloc_overflowed, only where the file says it
                    **({} if rec.overflowed is None else {"trace_alloc_overflowed": rec.overflowed}),
                    **({} if rec.window is None else {"entries_left_out": device.entries_left_out}),
                },
                device=device.device,
            )
        )
    return out
