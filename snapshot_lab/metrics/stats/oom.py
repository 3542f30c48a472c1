"""Why the last out-of-memory error happened, from the trace's ``oom`` entry and the block layout.

The allocator could not serve ``requested_bytes`` (already rounded). It can only serve a request
from free blocks of the same device, stream and pool (small requests <= 1 MiB from the small
pool, others from the large pool; never from a CUDA-graph private pool). If such free blocks add
up to at least the request but none is big enough, the OOM is caused by fragmentation;
otherwise the job simply needed more memory than it had (capacity).

The layout is the one at the moment of the OOM: the snapshot's own when it was dumped from the
OOM observer (``snapshot_at_oom``), else rebuilt from the trace (:mod:`.moments`): a snapshot
dumped after the stack unwound has given back the memory the failing step held, and would make
the OOM look like fragmentation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pandas as pd

from ...frames import SnapshotFrames
from ..history.moments import dumped_at, last_oom_index, oom_moment
from ..history.ooms import fatal

SMALL_REQUEST_MAX_BYTES = 1024 * 1024  # kSmallSize: requests up to this go to the small pool


@dataclass(frozen=True)
class OomAnalysis:
    device: int
    event_index: int
    time_us: int | None
    requested_bytes: int
    device_free_bytes: int | None
    pool: str
    stream: int
    free_in_reserved_bytes: int
    largest_free_block_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    cause: str  # 'fragmentation' or 'capacity'
    snapshot_at_oom: bool
    oom_count: int  # every oom entry of the device, those it went on from included
    stack_id: int | None
    moment: str = "the snapshot as dumped"  # where the layout behind this explanation comes from
    recovered_count: int = 0  # oom entries the job went on from (caught: :mod:`..history.ooms`)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _opt_int(v: object) -> int | None:
    return None if v is None or pd.isna(v) else int(v)  # type: ignore[call-overload]


def analyse_oom(
    segments: pd.DataFrame, blocks: pd.DataFrame, events: pd.DataFrame, moment: str = "the snapshot as dumped"
) -> OomAnalysis | None:
    """Analysis of the ``oom`` entry that ended the job (the last one with no allocation after
    it, :mod:`..history.ooms`; None when there is none), from
    the layout ``segments``/``blocks`` (which should be the one at that OOM)."""
    ooms = events[events["action"] == "oom"]
    ended = fatal(events)
    if ended.empty:
        return None
    last = ended.iloc[-1]
    device = int(last["device"])
    request = int(last["size_bytes"])
    stream = int(last["stream"])
    pool = "small" if request <= SMALL_REQUEST_MAX_BYTES else "large"
    dev_blocks = blocks[blocks["device"] == device]
    usable = dev_blocks[
        (dev_blocks["state"] == "inactive")
        & (dev_blocks["pool"] == pool)
        & (dev_blocks["stream"] == stream)
        & ~dev_blocks["is_private_pool"]
    ]
    free = int(usable["size_bytes"].sum())
    largest = int(usable["size_bytes"].max()) if len(usable) else 0
    cause = "fragmentation" if free >= request and largest < request else "capacity"
    after = events.loc[(events["device"] == device) & (events["event_index"] > last["event_index"]), ["action"]]
    at_oom = bool((after["action"] == "snapshot").all())
    dev_segments = segments[segments["device"] == device]
    return OomAnalysis(
        device=device,
        event_index=int(last["event_index"]),
        time_us=_opt_int(last["time_us"]),
        requested_bytes=request,
        device_free_bytes=_opt_int(last["device_free_bytes"]),
        pool=pool,
        stream=stream,
        free_in_reserved_bytes=free,
        largest_free_block_bytes=largest,
        reserved_bytes=int(dev_segments["total_size_bytes"].sum()),
        allocated_bytes=int(dev_blocks.loc[dev_blocks["state"] == "active_allocated", "size_bytes"].sum()),
        cause=cause,
        snapshot_at_oom=at_oom,
        oom_count=len(ooms),
        recovered_count=len(ooms) - len(ended),
        stack_id=_opt_int(last["stack_id"]),
        moment=moment,
    )


def analyse_device_oom(frames: SnapshotFrames, device: int) -> OomAnalysis | None:
    """The device's last OOM, explained from the layout at that moment."""
    m = oom_moment(frames, device)
    if m is None:
        return None
    ev = frames.device_events(device)
    idx = last_oom_index(frames, device)
    moment = m.description if not dumped_at(frames, device, idx or 0) else "the snapshot, dumped at the OOM"
    return analyse_oom(m.segments, m.blocks, ev, moment)
