"""The allocator's layout at a chosen moment: the dump, or an event of the trace.

An OOM is explained from the moment it happened. A snapshot dumped from the OOM observer shows
that moment; one dumped after the stack unwound (``except torch.OutOfMemoryError:
_dump_snapshot(...)``, or ``snaplab run``'s ``_exception`` file) shows the memory the unwinding
gave back, so the layout at the OOM event is rebuilt from the trace
(:mod:`~snapshot_lab.metrics.allocator.state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo
from ..allocator.model import recorded_settings
from ..allocator.state import follow, followed_tables
from .ooms import fatal


@dataclass(frozen=True)
class Moment:
    device: int
    event_index: int | None  # None: the dump itself
    description: str  # what the layout shows, for people
    segments: pd.DataFrame
    blocks: pd.DataFrame

    @property
    def at_dump(self) -> bool:
        return self.event_index is None


def dump_moment(frames: SnapshotFrames, device: int) -> Moment:
    return Moment(
        device,
        None,
        "the snapshot as dumped",
        frames.segments[frames.segments["device"] == device],
        frames.blocks[frames.blocks["device"] == device],
    )


def last_oom_index(frames: SnapshotFrames, device: int) -> int | None:
    """The device's out-of-memory error that ended the job (None: none did, :mod:`.ooms`)."""
    events = frames.events
    ooms = fatal(events[events["device"] == device])["event_index"]
    return int(ooms.iloc[-1]) if len(ooms) else None


def dumped_at(frames: SnapshotFrames, device: int, event_index: int) -> bool:
    """Whether nothing but ``snapshot`` markers follows the event: the dump shows its moment."""
    events = frames.events
    after = events[(events["device"] == device) & (events["event_index"] > event_index)]
    return bool((after["action"] == "snapshot").all())


def moment_at(frames: SnapshotFrames, device: int, event_index: int) -> Moment | None:
    """The layout right after event ``event_index``, rebuilt from the trace; None when the
    trace and the snapshot disagree (the rebuilt state could not follow the recording)."""

    def compute() -> Moment | None:
        if dumped_at(frames, device, event_index):
            return dump_moment(frames, device)
        followed = follow(
            frames,
            device,
            recorded_settings(frames.info.allocator_settings),
            event_index,
        )
        if followed.mismatches:
            return None
        events = frames.device_events(device)
        later = int((events["event_index"] > event_index).sum())
        segments, blocks = followed_tables(frames, device, followed)
        return Moment(
            device,
            event_index,
            f"rebuilt from the trace at event {event_index:,} (the snapshot was dumped {later:,} events later)",
            segments,
            blocks,
        )

    return memo(frames, ("moment", device, event_index), compute)


def oom_moment(frames: SnapshotFrames, device: int) -> Moment | None:
    """The layout at the device's last OOM (None when it had none); the dump when it could
    not be rebuilt, which the description says."""
    idx = last_oom_index(frames, device)
    if idx is None:
        return None
    moment = moment_at(frames, device, idx)
    if moment is not None:
        return moment
    dumped = dump_moment(frames, device)
    return Moment(
        device,
        None,
        "the snapshot as dumped after the OOM (the moment of the OOM could not be rebuilt from the trace)",
        dumped.segments,
        dumped.blocks,
    )
