"""Allocator what-if: replay a device's recorded trace through the allocator model under other
settings and predict reserved memory, cudaMalloc calls, retries and OOMs.

The trace supplies the program's requests (``alloc`` with the size asked for, ``free_completed``
when a block really returned to the cache) and its explicit ``torch.cuda.empty_cache()`` calls;
everything the allocator decided by itself (segments, retries, garbage collection) is
recomputed by the model. A ``replay_check`` first replays the trace under the settings the
snapshot recorded and compares the resulting segments with the snapshot's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from ..frames import SnapshotFrames
from .allocator_model import (
    LARGE_BUFFER,
    UNLIMITED,
    AllocatorSettings,
    Block,
    CachingAllocatorModel,
    OutOfMemory,
)

MiB = 1 << 20

_ALLOC, _FREE, _SEG_NEW, _SEG_GONE, _OOM, _OTHER = range(6)


def recorded_settings(info_settings: dict[str, Any] | None) -> AllocatorSettings:
    """The settings a snapshot was recorded with (``allocator_settings``, torch >= 2.3)."""
    s = info_settings or {}
    ms = s.get("max_split_size", -1)
    divisions = s.get("roundup_power2_divisions") or {}
    if isinstance(divisions, dict):
        ordered = [int(divisions[k]) for k in sorted(divisions, key=lambda k: int(k))] if divisions else [0] * 16
    else:
        ordered = [0] * 16
    ordered = (ordered + [0] * 16)[:16]
    return AllocatorSettings(
        max_split_size=UNLIMITED if not isinstance(ms, int) or ms < 0 else ms,
        roundup_power2_divisions=tuple(ordered),
        garbage_collection_threshold=float(s.get("garbage_collection_threshold", 0.0) or 0.0),
        expandable_segments=bool(s.get("expandable_segments", False)),
    )


def apply_conf(base: AllocatorSettings, conf: list[str]) -> AllocatorSettings:
    """Apply ``KEY:VALUE`` items spelled as in PYTORCH_CUDA_ALLOC_CONF."""
    s = base
    for item in conf:
        for part in item.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition(":")
            key, value = key.strip(), value.strip()
            if not sep:
                raise ValueError(f"expected KEY:VALUE, got {part!r}")
            if key == "expandable_segments":
                if value not in ("True", "False", "true", "false", "1", "0"):
                    raise ValueError(f"expandable_segments takes True or False, not {value!r}")
                s = replace(s, expandable_segments=value in ("True", "true", "1"))
            elif key == "max_split_size_mb":
                mb = int(value)
                if mb <= LARGE_BUFFER // MiB:
                    raise ValueError("max_split_size_mb must be larger than 20")
                s = replace(s, max_split_size=mb * MiB)
            elif key == "max_non_split_rounding_mb":
                s = replace(s, max_non_split_rounding=int(value) * MiB)
            elif key == "garbage_collection_threshold":
                t = float(value)
                if not 0.0 < t < 1.0:
                    raise ValueError("garbage_collection_threshold must be between 0 and 1")
                s = replace(s, garbage_collection_threshold=t)
            elif key == "roundup_power2_divisions":
                if value.startswith("["):
                    raise ValueError("per-interval roundup_power2_divisions lists are not supported here")
                d = int(value)
                if d & (d - 1):
                    raise ValueError("roundup_power2_divisions must be a power of 2")
                s = replace(s, roundup_power2_divisions=(d,) * 16)
            else:
                raise ValueError(f"unknown or unsupported setting {key!r}")
    return s


@dataclass(frozen=True)
class ScenarioResult:
    settings: dict[str, Any]
    peak_reserved_bytes: int
    final_reserved_bytes: int
    final_allocated_bytes: int
    cuda_malloc_calls: int
    cuda_free_calls: int
    alloc_retries: int
    ooms: list[dict[str, int]]
    recorded_oom_avoided: bool | None  # None when the recording had no OOM

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplayCheck:
    exact: bool
    approximate: bool  # the trace does not start at the start of the job
    reasons: list[str]
    recorded_reserved_bytes: int
    replayed_reserved_bytes: int
    recorded_segments: int
    replayed_segments: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WhatIf:
    device: int
    events: int
    memory_limit_bytes: int | None
    replay_check: ReplayCheck
    scenarios: list[ScenarioResult] = field(default_factory=list)  # the first: the recorded settings
    memory_limit_source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "events": self.events,
            "memory_limit_bytes": self.memory_limit_bytes,
            "memory_limit_source": self.memory_limit_source,
            "replay_check": self.replay_check.to_dict(),
            "scenarios": [s.to_dict() for s in self.scenarios],
        }


@dataclass(frozen=True)
class _Program:
    """The trace reduced to what the program did, as numpy columns."""

    kind: np.ndarray
    address: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    index: np.ndarray
    empty_cache_at: set[int]


def _program(events: pd.DataFrame, device: int, settings: AllocatorSettings) -> _Program:
    ev = events[events["device"] == device]
    action = ev["action"].astype(str).to_numpy()
    kind = np.full(len(ev), _OTHER, dtype=np.int8)
    kind[action == "alloc"] = _ALLOC
    kind[action == "free_completed"] = _FREE
    kind[np.isin(action, ["segment_alloc", "segment_map"])] = _SEG_NEW
    kind[np.isin(action, ["segment_free", "segment_unmap"])] = _SEG_GONE
    kind[action == "oom"] = _OOM
    # A run of segment frees is an explicit torch.cuda.empty_cache() unless the allocator did it
    # inside a malloc: before a recorded OOM, or (with garbage collection or max_split_size in
    # force) right before the malloc's new segment.
    empty_cache_at: set[int] = set()
    automatic = settings.garbage_collection_threshold > 0 or settings.max_split_size != UNLIMITED
    n = len(kind)
    i = 0
    while i < n:
        if kind[i] != _SEG_GONE:
            i += 1
            continue
        j = i
        while j < n and kind[j] == _SEG_GONE:
            j += 1
        k = j
        while k < n and kind[k] in (_OTHER,):
            k += 1
        follows = kind[k] if k < n else _OTHER
        inside_malloc = follows == _OOM or (automatic and follows == _SEG_NEW)
        if not inside_malloc:
            empty_cache_at.add(i)
        i = j
    return _Program(
        kind=kind,
        address=ev["address"].fillna(-1).astype("int64").to_numpy(),
        size=ev["size_bytes"].to_numpy(),
        stream=ev["stream"].to_numpy(),
        index=ev["event_index"].to_numpy(),
        empty_cache_at=empty_cache_at,
    )


def _replay(
    prog: _Program, settings: AllocatorSettings, limit: int | None, reuse_addresses: bool
) -> tuple[CachingAllocatorModel, dict[int, Block], bool | None]:
    model = CachingAllocatorModel(settings, limit)
    live: dict[int, Block] = {}
    recorded_oom_avoided: bool | None = None
    kind, address, size, stream, index = prog.kind, prog.address, prog.size, prog.stream, prog.index
    for i in range(len(kind)):
        k = kind[i]
        if k == _ALLOC:
            try:
                live[int(address[i])] = model.malloc(int(size[i]), int(stream[i]), int(index[i]))
            except OutOfMemory:
                break  # the program raises OutOfMemoryError here: the rest of the trace never happens
        elif k == _FREE:
            b = live.pop(int(address[i]), None)
            if b is not None:
                model.free(b)
        elif k == _SEG_NEW:
            if reuse_addresses:
                model.recorded_addresses.setdefault(int(size[i]), []).append(int(address[i]))
        elif k == _SEG_GONE:
            if i in prog.empty_cache_at:
                model.empty_cache()
        elif k == _OOM:
            try:
                model.malloc(int(size[i]), int(stream[i]), int(index[i]))
                recorded_oom_avoided = True if recorded_oom_avoided is None else recorded_oom_avoided
            except OutOfMemory:
                recorded_oom_avoided = False
    return model, live, recorded_oom_avoided


def _recorded_layout(frames: SnapshotFrames, device: int) -> list[list[tuple[int, bool]]]:
    seg = frames.segments[(frames.segments["device"] == device) & ~frames.segments["is_private_pool"]]
    blk = frames.blocks[frames.blocks["segment_id"].isin(seg["segment_id"])]
    out = []
    for _, g in blk.groupby("segment_id", sort=False):
        out.append([(int(s), st != "inactive") for s, st in zip(g["size_bytes"], g["state"].astype(str), strict=True)])
    return out


def _canon(layout: list[list[tuple[int, bool]]]) -> list[tuple[tuple[int, bool], ...]]:
    return sorted(tuple(seg) for seg in layout)


def analyse_whatif(
    frames: SnapshotFrames,
    device: int,
    scenarios: list[AllocatorSettings],
    memory_limit: int | None = None,
    history_complete: bool = True,
) -> WhatIf:
    """Replay check under the recorded settings, then each scenario."""
    base = recorded_settings(frames.info.allocator_settings)
    ev = frames.events[frames.events["device"] == device]
    prog = _program(frames.events, device, base)
    # replay check: the recorded settings and segment addresses under the same limit (a limit
    # the recorded run never met shows up here as a mismatch: it is not the one it ran under)
    model, live, _ = _replay(prog, base, memory_limit, reuse_addresses=True)
    replayed = model.layout(list(live.values()))
    recorded = _recorded_layout(frames, device)
    reasons = []
    rec_reserved = sum(sum(s for s, _ in seg) for seg in recorded)
    rep_reserved = sum(sum(s for s, _ in seg) for seg in replayed)
    if not history_complete:
        reasons.append("the trace does not start at the start of the job: earlier allocations are unknown")
    if frames.segments["is_private_pool"].any():
        reasons.append("CUDA-graph private pools are not modelled (replayed in the default pool)")
    if rep_reserved != rec_reserved:
        reasons.append(f"reserved bytes differ: replayed {rep_reserved}, recorded {rec_reserved}")
    if len(replayed) != len(recorded):
        reasons.append(f"segment count differs: replayed {len(replayed)}, recorded {len(recorded)}")
    elif _canon(replayed) != _canon(recorded):
        reasons.append("block layout inside segments differs")
    exact = not reasons
    check = ReplayCheck(
        exact=exact,
        approximate=not history_complete,
        reasons=reasons,
        recorded_reserved_bytes=rec_reserved,
        replayed_reserved_bytes=rep_reserved,
        recorded_segments=len(recorded),
        replayed_segments=len(replayed),
    )
    results = []
    for s in scenarios:
        m, _live_s, avoided = _replay(prog, s, memory_limit, reuse_addresses=True)
        results.append(
            ScenarioResult(
                settings=s.describe(),
                peak_reserved_bytes=m.stats.peak_reserved_bytes,
                final_reserved_bytes=m.stats.reserved_bytes,
                final_allocated_bytes=m.stats.allocated_bytes,
                cuda_malloc_calls=m.stats.cuda_malloc_calls,
                cuda_free_calls=m.stats.cuda_free_calls,
                alloc_retries=m.stats.alloc_retries,
                ooms=[{"event_index": i, "requested_bytes": r} for i, r in m.stats.ooms],
                recorded_oom_avoided=avoided,
            )
        )
    return WhatIf(device, len(ev), memory_limit, check, results)


def grid(base: AllocatorSettings, memory_limit: int | None) -> list[AllocatorSettings]:
    """Sensible alternatives to try when the user names none."""
    out = [replace(base, expandable_segments=True)]
    for mb in (64, 128, 256, 512):
        out.append(replace(base, max_split_size=mb * MiB, expandable_segments=False))
    out.append(replace(base, roundup_power2_divisions=(4,) * 16))
    out.append(replace(base, expandable_segments=True, roundup_power2_divisions=(4,) * 16))
    if memory_limit is not None:
        out.append(replace(base, garbage_collection_threshold=0.6, expandable_segments=False))
    return [s for s in dict.fromkeys(out) if s != base]


def quick_grid(base: AllocatorSettings, memory_limit: int | None) -> list[AllocatorSettings]:
    """The few alternatives the report tries on the way (``snaplab whatif`` sweeps more)."""
    out = [
        replace(base, expandable_segments=True),
        replace(base, expandable_segments=True, roundup_power2_divisions=(4,) * 16),
    ]
    if memory_limit is not None:
        out.append(replace(base, max_split_size=256 * MiB, expandable_segments=False))
    return [s for s in dict.fromkeys(out) if s != base]


def infer_memory_limit(frames: SnapshotFrames, device: int, reserved_peak: int | None) -> tuple[int | None, str]:
    """The limit the job ran under, when the snapshot says: the capture sidecar's OOM record,
    else the OOM event (physical memory when the device was really full; when the device still
    had room, a per-process cap is inferred as the peak reserved before the OOM)."""
    cap = frames.info.capture or {}
    oom = cap.get("oom") if isinstance(cap, dict) else None
    if isinstance(oom, dict) and isinstance(oom.get("limit_bytes"), int) and oom.get("device", device) == device:
        return int(oom["limit_bytes"]), "capture sidecar (the OOM observer's limit)"
    ev = frames.events[(frames.events["device"] == device) & (frames.events["action"] == "oom")]
    if ev.empty:
        return None, "none (unlimited)"
    last = ev.iloc[-1]
    free = last["device_free_bytes"]
    seg = frames.segments[frames.segments["device"] == device]
    reserved = int(seg["total_size_bytes"].sum())
    if not pd.isna(free) and int(last["size_bytes"]) > int(free):
        return reserved + int(free), "the OOM event (device memory was full)"
    if reserved_peak:
        return reserved_peak, "inferred: the device had room, so a per-process cap at the peak reserved before the OOM"
    return None, "none (unlimited)"


WHATIF_MAX_EVENTS = 200_000  # the report and findings replay traces up to this size
MIN_SAVING_BYTES = 256 * MiB
MIN_SAVING_SHARE = 0.10


def settings_label(settings: dict[str, Any]) -> str:
    """``expandable_segments:True,max_split_size_mb:128`` for a scenario's settings."""
    parts = []
    for k, v in settings.items():
        if k == "expandable_segments":
            if v:
                parts.append("expandable_segments:True")
        elif v not in (None, 0, 0.0):
            parts.append(f"{k}:{v}")
    return ",".join(parts) or "(defaults)"


def best_alternative(w: WhatIf) -> tuple[ScenarioResult, str] | None:
    """The alternative worth suggesting: one that avoids the recorded OOM (lowest peak first),
    else one that cuts the peak reserved by a meaningful amount; with why."""
    if not w.scenarios:
        return None
    recorded, alternatives = w.scenarios[0], w.scenarios[1:]
    if recorded.recorded_oom_avoided is False or recorded.ooms:
        fixes = [s for s in alternatives if not s.ooms]
        if fixes:
            best = min(fixes, key=lambda s: s.peak_reserved_bytes)
            return best, "avoids the OOM"
        return None
    better = [
        s
        for s in alternatives
        if not s.ooms
        and recorded.peak_reserved_bytes - s.peak_reserved_bytes >= MIN_SAVING_BYTES
        and recorded.peak_reserved_bytes - s.peak_reserved_bytes >= MIN_SAVING_SHARE * recorded.peak_reserved_bytes
    ]
    if not better:
        return None
    return min(better, key=lambda s: s.peak_reserved_bytes), "lowers the peak reserved memory"
