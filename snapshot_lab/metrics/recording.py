"""What was recorded: trace or state only, stack kind, and whether early history is missing."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from ..frames import SnapshotFrames


@dataclass(frozen=True)
class DeviceRecording:
    device: int
    events: int
    first_time_us: int | None
    last_time_us: int | None
    action_counts: dict[str, int]
    # frees of addresses whose allocation is not in the trace: the ring buffer wrapped or
    # recording started late, so history before the first entry is missing
    orphan_frees: int
    # live blocks at dump time with no alloc event in the trace (allocated before it began)
    live_blocks_before_trace: int
    live_bytes_before_trace: int
    # the trace's first entries snaplab did not read (a window: Recording.window)
    entries_left_out: int = 0

    @property
    def history_complete(self) -> bool:
        return self.orphan_frees == 0 and self.live_blocks_before_trace == 0 and self.entries_left_out == 0


@dataclass(frozen=True)
class Recording:
    mode: str  # 'trace' (alloc/free history), 'state' (live blocks only), 'none'
    stacks: str  # 'none', 'python', 'python+cpp'
    devices: tuple[DeviceRecording, ...]
    # allocator_settings.trace_alloc_overflowed / trace_alloc_max_entries (newer than torch
    # 2.14.1): whether the ring buffer dropped events, and its size; None where the file is silent
    overflowed: bool | None = None
    max_entries: int | None = None
    # the window the file was read with: each device's last `window` entries (None: every entry)
    window: int | None = None

    @property
    def history_complete(self) -> bool:
        return all(d.history_complete for d in self.devices)

    @property
    def entries_left_out(self) -> int:
        """The trace entries the window left out, every device's together."""
        return sum(d.entries_left_out for d in self.devices)

    @property
    def window_cause(self) -> str | None:
        """What the window left out, in words; None when it left nothing out."""
        if self.window is None or not self.entries_left_out:
            return None
        return (
            f"only each device's last {self.window:,} trace entries were read, as max_entries asked; "
            f"the {self.entries_left_out:,} before them were left out"
        )

    @property
    def missing_history_cause(self) -> str:
        """Why history before the trace's first entry is missing, exactly when the file says it."""
        if self.window_cause is not None:
            return self.window_cause
        if self.overflowed:
            at = f" at {self.max_entries:,} entries" if self.max_entries is not None else ""
            return f"the ring buffer overflowed{at}: earlier events were lost"
        if self.overflowed is False:
            return "recording started after these blocks were made"
        return "ring buffer wrapped or recording started late"

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        for key in ("overflowed", "max_entries", "window"):  # only files that say it carry the keys
            if d[key] is None:
                del d[key]
        d["history_complete"] = self.history_complete
        for dev, rec in zip(d["devices"], self.devices, strict=True):
            dev["history_complete"] = rec.history_complete
            if self.window is None:  # read whole: nothing was left out
                del dev["entries_left_out"]
        return d


def _opt(v: object) -> int | None:
    return None if v is None or pd.isna(v) else int(v)  # type: ignore[call-overload]


def device_recording(device: int, events: pd.DataFrame, blocks: pd.DataFrame, left_out: int = 0) -> DeviceRecording:
    on_device = events["device"] == device
    columns = ["action", "address", "event_index", "time_us"]  # all it reads, not a copy of every column
    ev = events[columns] if bool(on_device.all()) else events.loc[on_device, columns]
    counts = ev["action"].value_counts()
    action_counts = {str(k): int(v) for k, v in counts.items() if v}
    is_alloc = (ev["action"] == "alloc").to_numpy()
    alloc_addresses = ev["address"][is_alloc].dropna()
    live = blocks[(blocks["device"] == device) & (blocks["state"] != "inactive")]
    has_history = len(ev) > 1
    if has_history:
        before = ~live["address"].isin(alloc_addresses.to_numpy())
    else:  # state-only recording: there is no history to be missing from
        before = pd.Series(np.zeros(len(live), dtype=bool), index=live.index)
    times = ev["time_us"].dropna()
    return DeviceRecording(
        device=device,
        events=len(ev),
        first_time_us=_opt(times.iloc[0]) if len(times) else None,
        last_time_us=_opt(times.iloc[-1]) if len(times) else None,
        action_counts=action_counts,
        orphan_frees=_orphan_frees(ev, is_alloc),
        live_blocks_before_trace=int(before.sum()),
        live_bytes_before_trace=int(live.loc[before, "size_bytes"].sum()),
        entries_left_out=left_out,
    )


def _orphan_frees(ev: pd.DataFrame, is_alloc: np.ndarray) -> int:
    """Addresses freed before the trace allocates them (or never allocated there): those whose
    first allocation or free in the trace is a free. One hashing pass over the addresses."""
    either = is_alloc | ev["action"].isin(["free_requested", "free_completed"]).to_numpy()
    addresses = ev["address"][either]
    known = addresses.notna().to_numpy()
    first = ~addresses[known].duplicated(keep="first").to_numpy()
    return int((first & ~is_alloc[either][known]).sum())


def recording_of(frames: SnapshotFrames) -> Recording:
    """:func:`describe_recording` of a snapshot's frames."""
    return describe_recording(
        frames.info.devices,
        frames.info.stacks_kind,
        frames.events,
        frames.blocks,
        frames.trace_overflowed,
        frames.trace_max_entries,
        frames.info.max_entries,
        frames.info.entries_left_out,
    )


def describe_recording(
    devices: tuple[int, ...],
    stacks_kind: str,
    events: pd.DataFrame,
    blocks: pd.DataFrame,
    overflowed: bool | None = None,
    max_entries: int | None = None,
    window: int | None = None,
    left_out: tuple[int, ...] = (),
) -> Recording:
    """Facts about the recording, one entry per device; ``window`` and ``left_out``: the window
    the file was read with and the entries it left out on each device (by ordinal)."""
    # enabled='state' shrinks the ring buffer to one entry (the last event, or the 'snapshot'
    # marker): a trace of at most one entry per device carries no history
    per_device = events.groupby("device").size()
    if len(per_device) and int(per_device.max()) > 1:
        mode = "trace"
    elif len(events) or stacks_kind != "none":
        mode = "state"
    else:
        mode = "none"
    return Recording(
        mode=mode,
        stacks=stacks_kind,
        devices=tuple(
            device_recording(d, events, blocks, left_out[d] if 0 <= d < len(left_out) else 0) for d in devices
        ),
        overflowed=overflowed,
        max_entries=max_entries,
        window=window,
    )
